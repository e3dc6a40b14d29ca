"""``bench/demo_progress.py`` runs (a smoke plan: a few steps on a few images) and prints every phase's cost beside
the constants the progress bar uses, and the tracker's worst time-left ratio on the run."""

from __future__ import annotations

import pytest

from rubricsearch.app.demo.progress import PHASES
from tests.test_bench_smoke import bench, numbers

NUMBER = r"(-?\d+(?:\.\d+)?)"


@pytest.mark.timeout(600)
def test_demo_progress_bench_prints_the_phase_costs() -> None:
    out = bench("demo_progress.py", "--smoke", timeout=600)
    for phase in PHASES:
        numbers(rf"{phase} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}", out)
    numbers(rf"tail +{NUMBER} +{NUMBER}", out)
    numbers(rf"worst {NUMBER}x the truth", out)
