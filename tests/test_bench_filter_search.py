"""Smoke test of bench/filter_search.py on the CPU: it runs, prints its settings, and its recall column is
computed against exact filtered search (the exact path and the device path, torch on the CPU, must be 1.0)."""

from __future__ import annotations

import pytest

from bench.filter_search import main


@pytest.mark.parametrize("extra", [[], ["--device-search", "torch", "--search-device", "cpu"]])
def test_filter_bench_runs_and_is_exact_below_the_ann_threshold(extra: list[str],
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    rows = main(["--n", "3000", "--dim", "32", "--queries", "8", "--fractions", "0.5,0.05,0.005", *extra])
    out = capsys.readouterr().out
    assert "p50 / unfiltered" in out and "exact_filter_rows=20000" in out and "ann_threshold=50000" in out
    assert [r["filter"] for r in rows] == ["none", "50.0%", "5.0%", "0.5%"]
    assert all(r["recall"] == 1.0 for r in rows[1:])
    assert 1000 < int(rows[1]["kept"]) < 2000 and 0 < int(rows[3]["kept"]) < 40  # type: ignore[call-overload]
