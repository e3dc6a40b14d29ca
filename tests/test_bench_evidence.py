"""bench/evidence_quality.py starts, runs and prints a well-formed table on a tiny random checkpoint on the CPU (with
random weights nothing about quality is claimed: the numbers only have to be shares)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bench_smoke import bench, numbers, settings_of

pytestmark = pytest.mark.timeout(300)


def test_evidence_quality_prints_every_attribute_beside_random_weights(tiny_reranker_dir: Path) -> None:
    out = bench("evidence_quality.py", "--reranker", str(tiny_reranker_dir), "--faces", "1", "--sizes", "128",
                "--methods", "occlusion")
    assert settings_of(out)["faces"] == "1" and settings_of(out)["methods"] == "occlusion"
    table = out.split("\n\n")[-1]
    for model in ("trained", "random weights"):
        for attribute in ("ears", "stripes", "eyes"):
            shares = numbers(rf"\| {model} \| occlusion \| 128 \| {attribute} \| 1 \| ([\d.]+) \| ([\d.]+) \| "
                             r"([\d.]+) \| ([\d.]+) \| ([\d.]+) \| (\d+) \|", table)
            assert max(shares[:5]) <= 1
