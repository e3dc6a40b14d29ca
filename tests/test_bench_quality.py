"""Smoke test of ``bench/quality.py`` on tiny random-weight checkpoints: it runs the product's search path end to
end, prints the settings it ran with and every table, and writes its JSON (the numbers mean nothing here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

from rubricsearch.app.demo.faces import candidate_images

ROOT = Path(__file__).resolve().parents[1]


def test_quality_bench_runs_and_reports(tiny_embedding_dir: Path, tiny_reranker_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "quality.json"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "quality.py"), "--embedding", str(tiny_embedding_dir),
         "--reranker", str(tiny_reranker_dir), "--docs", "12", "--queries", "1", "--shortlist", "6",
         "--rubrics", "2", "--trust-rubrics", "2", "--trust-shortlist", "6", "--json", str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    text = proc.stdout
    assert "settings: docs 12" in text and "trust shortlist 6" in text
    assert "share of criteria met by the top 5: product" in text and "'no X'" in text and "threshold 0.5" in text
    assert re.search(r"nDCG@10 [a-z+]+: recall [0-9.]+ \| reranked [0-9.]+ \| fused w=0.25", text), text
    report = json.loads(out.read_text())
    trust = report["model"]["trust"]
    assert set(trust["criteria_met_top5"]) == {"product", "recall", "mean", "min", "geometric mean"}
    assert 0.0 <= trust["single_precision5"] <= 1.0
    shown = report["demo_set"]  # the Compare page's set: every single criterion judged on each of its 40 faces
    assert "## demo set" in text and shown["pairs"] == 40 * 27, shown
    assert 0.0 <= shown["match_precision"] <= 1.0 and 0.0 <= shown["no_match_precision"] <= 1.0
    assert {t[0] for t in shown["twins"]} <= {name for name, _ in candidate_images()}, shown["twins"]
