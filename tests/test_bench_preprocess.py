"""Smoke test of bench/gpu_preprocess_deviation.py (tiny checkpoint, CPU, small photos): it starts, the resize alone
agrees with Pillow, and the official mode's pixels are the official ones."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_preprocess_deviation_bench_runs(tiny_embedding_dir: Path) -> None:
    out = subprocess.run([sys.executable, "bench/gpu_preprocess_deviation.py", "--checkpoint", str(tiny_embedding_dir),
                          "--photos", "2", "--sides", "320"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "sides=[320]" in out.stdout and "identical: True" in out.stdout
    assert "official: preprocess" in out.stdout and "max |delta| vs the official CPU path 0.000000" in out.stdout
