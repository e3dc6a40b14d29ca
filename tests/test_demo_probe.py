"""The tower probe bench starts, runs and prints one accuracy per attribute and checkpoint, on a tiny random
checkpoint on the CPU (with random weights nothing about what the tower shows is claimed)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.test_bench_smoke import bench, numbers, settings_of

pytestmark = pytest.mark.timeout(600)


def test_tower_probe_runs_beside_a_random_tower(tiny_embedding_dir: Path) -> None:
    out = bench("tower_probe.py", str(tiny_embedding_dir), "--fit", "12", "--held-out", "6")
    assert settings_of(out)["fit"] == "12" and settings_of(out)["held_out"] == "12"
    for attr in ("species", "fur", "ears", "stripes", "eyes"):
        given, random_tower = numbers(rf"\| {attr} \| ([\d.]+) \| ([\d.]+) \|", out)
        assert given <= 1 and random_tower <= 1
