"""The facet benches start, run and print well-formed numbers on tiny random checkpoints on the CPU (timings and
accuracies are not checked here: with random weights nothing about quality is claimed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bench_smoke import bench, numbers, settings_of

pytestmark = pytest.mark.timeout(600)


def test_facet_throughput_runs_from_packages_only() -> None:
    out = bench("facet_throughput.py", "--refs", "4", "--attributes", "1", "--values", "3")
    assert settings_of(out)["values"] == "3"
    rate, tokens, encodes = numbers(r"= ([\d.]+) \(references x values\)/s, (\d+) LM tokens/pass, vision encodes "
                                    r"(\d+)", out)
    assert rate > 0 and tokens > 0 and encodes == 0
    assert numbers(r"= ([\d.]+)x the facets from packages", out)[0] > 1
    assert numbers(r"for 1,000,000 references: (\d+) s at the FLOP limit", out)[0] > 0
    limit, measured, mfu = numbers(r"tokens/pass: (\d+) \(references x values\)/s at the H100's bf16 peak .*; "
                                   r"measured ([\d.]+)/s = MFU ([\d.e-]+)%", out)
    assert limit > measured > 0 and mfu == pytest.approx(100 * measured / limit, rel=0.01)
    assert settings_of(out)["device_in_use"] == "cpu" and settings_of(out)["side"] == "128"


def test_facet_quality_runs_beside_a_random_baseline(tiny_reranker_dir: Path, tiny_embedding_dir: Path) -> None:
    out = bench("facet_quality.py", "--reranker", str(tiny_reranker_dir), "--embedding", str(tiny_embedding_dir),
                "--docs", "6")
    assert settings_of(out)["docs"] == "6"
    for attr in ("species", "fur", "ears", "stripes", "eyes"):
        accuracies = numbers(rf"\| {attr} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \|", out)
        assert max(accuracies) <= 1
    assert numbers(r"vision encodes during the facet computation: trained (\d+), random (\d+)", out) == [0, 0]
