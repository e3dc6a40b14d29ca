"""Smoke test of bench/filter_search.py on the CPU: it runs, prints its settings, and its recall columns are
computed against exact filtered search (the exact path and the device path, torch on the CPU, must be 1.0; on a
small HNSW set the recurring filters that keep few rows search their own graphs)."""

from __future__ import annotations

import pytest

from bench.filter_search import main


def test_filter_bench_runs_and_is_exact_below_the_ann_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--n", "3000", "--dim", "32", "--queries", "8", "--fractions", "0.5,0.05,0.005",
                 "--paths", "cpu,device", "--search-device", "cpu"])
    out = capsys.readouterr().out
    assert "/ unfilt." in out and "filter_scan_ratio=1.0" in out and "ann_threshold=50000" in out
    assert [(r["path"], r["filter"]) for r in rows] == [(p, f) for p in ("cpu", "device")
                                                        for f in ("none", "50.0%", "5.0%", "0.5%")]
    assert all(r["new_recall"] == 1.0 for r in rows if r["filter"] != "none")
    assert all(r["recall"] == 1.0 and r["graphs"] == 0 for r in rows if r["path"] == "cpu" and r["filter"] != "none")
    assert 1000 < int(rows[1]["kept"]) < 2000 and 0 < int(rows[3]["kept"]) < 40


def test_filter_bench_times_recurring_filters_on_their_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--n", "3000", "--dim", "32", "--queries", "8", "--ann-threshold", "1000"])
    out = capsys.readouterr().out
    assert "search path hnsw" in out and "ann_threshold=1000 (not the default)" in out
    by_filter = {r["filter"]: r for r in rows}
    assert by_filter["50.0%"]["graphs"] == 0  # half the set: the selector walk, no graph
    assert by_filter["5.0%"]["graphs"] == 1 and by_filter["0.5%"]["graphs"] == 2
    assert all(r["new_graphs"] == 0 for r in rows[1:])  # no two new filters share a mask: none recurs
    assert all(r["recall"] >= 0.9 for r in rows[1:]) and by_filter["5.0%"]["graph_s"] > 0


def test_filter_bench_runs_against_an_older_product(tmp_path, capfd: pytest.CaptureFixture[str]) -> None:
    """``--against DIR`` runs the bench once more on the product in DIR (here a copy of this one) and prints the
    two arms' p50s side by side; each arm says which product it imported."""
    import shutil
    from pathlib import Path

    old = tmp_path / "old"
    shutil.copytree(Path(__file__).resolve().parents[1] / "retrieval", old / "retrieval")
    rows = main(["--n", "2000", "--dim", "16", "--queries", "4", "--paths", "device", "--search-device", "cpu",
                 "--against", str(old)])
    out = capfd.readouterr().out
    assert f"product: {old / 'retrieval'}" in out and "this tree vs" in out
    assert [r["filter"] for r in rows] == ["none", "50.0%", "5.0%", "0.5%"]
    assert all(set(r["steps_ms"]) == {"mask", "device", "rescore", "other"} for r in rows[1:])
