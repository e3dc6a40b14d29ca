"""Smoke test of bench/filter_search.py on the CPU: it runs, prints its settings, and its recall columns are
computed against exact filtered search (the exact path and the device path, torch on the CPU, must be 1.0; on a
small HNSW set the recurring leaves and filters that keep few rows get their graphs, first uses none)."""

from __future__ import annotations

import math

import pytest

from bench.filter_search import main


def test_filter_bench_runs_and_is_exact_below_the_ann_threshold(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--n", "3000", "--dim", "32", "--queries", "8", "--fractions", "0.5,0.05,0.005",
                 "--paths", "cpu,device", "--search-device", "cpu"])
    out = capsys.readouterr().out
    assert "/ unf." in out and "filter_scan_ratio=1.0" in out and "ann_threshold=50000" in out
    assert "first use (a new leaf)" in out and "new filter, recurring leaf" in out and "recurring filter" in out
    assert [(r["path"], r["filter"]) for r in rows] == [(p, f) for p in ("cpu", "device")
                                                        for f in ("none", "50.0%", "5.0%", "0.5%")]
    assert all(r["new_recall"] == 1.0 and r["use_recall"] == 1.0 for r in rows if r["filter"] != "none")
    assert all(r["recall"] == 1.0 and r["graphs"] == 0 for r in rows if r["path"] == "cpu" and r["filter"] != "none")
    assert 1000 < int(rows[1]["kept"]) < 2000 and 0 < int(rows[3]["kept"]) < 40


def test_filter_bench_times_recurring_leaves_and_filters_on_their_graphs(capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--n", "3000", "--dim", "32", "--queries", "8", "--ann-threshold", "1000"])
    out = capsys.readouterr().out
    assert "search path hnsw" in out and "ann_threshold=1000 (not the default)" in out
    by_filter = {r["filter"]: r for r in rows}
    assert by_filter["50.0%"]["graphs"] == 0 and by_filter["50.0%"]["new_graphs"] == 0  # the selector walk
    # per fraction under 20 %: the new filters' shared leaf gets one graph, the recurring filter another
    assert by_filter["5.0%"]["new_graphs"] == 1 and by_filter["5.0%"]["graphs"] == 2
    assert by_filter["0.5%"]["new_graphs"] == 1 and by_filter["0.5%"]["graphs"] == 4
    assert by_filter["5.0%"]["new_graph_s"] > 0 and by_filter["5.0%"]["graph_s"] > 0
    assert all(r["use_graphs"] == 0 for r in rows[1:])  # first uses: no two share a leaf
    assert all(r[c + "recall"] >= 0.9 for r in rows[1:] for c in ("use_", "new_", ""))


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
    assert all(set(r["new_steps_ms"]) == set(r["use_steps_ms"]) == {"mask", "device", "rescore", "other"}
               for r in rows[1:])


def test_graph_share_bench_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """bench/filter_graph_share.py: a graph's walk with a selector against the scan of the filter's rows, per share
    of the graph kept; the walk's recall is against the exact scan."""
    from bench.filter_graph_share import main as share_main

    rows = share_main(["--rows", "600", "--dim", "16", "--queries", "5", "--shares", "0.2,1"])
    out = capsys.readouterr().out
    assert "walk/scan" in out and "rows=600 dim=16" in out and "from a share of 20%" in out
    assert [r["share"] for r in rows] == [0.2, 1.0] and rows[1]["kept"] == 600 and 60 < rows[0]["kept"] < 180
    assert all(r["recall"] >= 0.9 and r["walk_ms"] > 0 and r["scan_ms"] > 0 for r in rows)


def test_widening_rows_run_each_value_product_first(capsys: pytest.CaptureFixture[str]) -> None:
    """``--ef-scales`` repeats the selector walk's cases per value of the widening rule, the product's value
    first: the walk's beam (faiss' distance count per query) must grow with the value, and the override must not
    outlive the run. The walk is forced (``--filter-scan-ratio 0``: a tiny set would otherwise be scanned)."""
    from rubricsearch.retrieval.index.faiss_accel import plans

    product = plans.FILTER_EF_SCALE
    rows = main(["--n", "3000", "--dim", "32", "--queries", "8", "--ann-threshold", "1000", "--fractions", "0.5",
                 "--filter-scan-ratio", "0", "--ef-scales", "2,4," + str(product), "--ef-kept", "0.5,0.05"])
    out = capsys.readouterr().out
    assert "widening rule" in out and f"product {product} first" in out and "the unfiltered walk" in out
    assert f"ef_scales=[2.0, 4.0, {product}] ef_kept=[0.5, 0.05] (bench-only)" in out
    sweep = [r for r in rows if "ef_scale" in r]
    assert [(r["filter"], r["ef_scale"]) for r in sweep] == [(f, v) for f in ("50.0%", "5.0%")
                                                                for v in (product, 2.0, 4.0)]
    half = sweep[:3]
    widths = [int(r["plan"].removeprefix("walk ")) for r in half]  # the walk's efSearch (the scan never wins here)
    assert widths[0] == math.ceil(128 * plans.walk_boost(half[0]["kept"], 3000)) and widths == sorted(set(widths))
    for c in ("use_", "new_"):
        assert half[0][c + "ndis"] < half[1][c + "ndis"] < half[2][c + "ndis"]
        assert all(r[c + "recall"] >= 0.9 and r[c + "p50_ms"] > 0 for r in half)
    assert sweep[3]["use_ndis"] < sweep[4]["use_ndis"]  # at 5 %: x4.7 against x8.9
    assert all("new_p50_ms" not in r for r in sweep[3:])  # a 5 % leaf recurring gets a graph: not a selector walk
    assert product == plans.FILTER_EF_SCALE  # restored
    assert sum(line.startswith("   cpu     3000  50.0%") for line in out.splitlines()) == 1  # main table: one row
