"""``bench/fine_tune_speed.py`` runs on the CPU (tiny checkpoint, small images, a few steps): the FLOP arithmetic
first, then one row per path, and the paths that claim to run the vision tower in the loop really ran it inside the
training (the trainer's own count), while the packages path never did."""

from __future__ import annotations

import pytest

from tests.test_bench_smoke import NUMBER, bench, numbers


@pytest.mark.timeout(600)
def test_fine_tune_speed_times_the_three_paths_and_counts_their_tower_calls() -> None:
    out = bench("fine_tune_speed.py", "--size", "tiny", "--side", "64", "--refs", "16", "--batch", "4",
                "--steps", "4", "--profile", "2", timeout=600)
    lines = out.splitlines()
    arithmetic = next(i for i, line in enumerate(lines) if line.startswith("FLOP arithmetic per row"))
    table = next(i for i, line in enumerate(lines) if line.startswith("path "))
    assert arithmetic < table
    tokens, run, lm, _tower, ratio = numbers(rf"per row: {NUMBER} tokens \({NUMBER} run after prefix sharing\); "
                                            rf"LM forward\+backward {NUMBER} GFLOP, tower forward {NUMBER} GFLOP: "
                                            rf"\(LM \+ tower\) / LM = {NUMBER}x", out)
    assert 0 < run <= tokens and lm > 0 and ratio >= 1
    judged, kept = numbers(rf"per step: {NUMBER} judged pairs and {NUMBER} answers kept", out)
    assert (judged, kept) == (4, 4)  # every reference is judged on one criterion: the others are kept at the base
    padded = numbers(rf"tokens run in {NUMBER} padded positions \(padding {NUMBER}%\)", out)
    assert padded[0] > 0 and padded[1] < 100
    rows: dict[str, tuple[int, int]] = {}
    for label in ("packages (as shipped)", "tower in the loop", "public recipe (decode+resize)"):
        line = next(line for line in lines if line.startswith(label))
        ms, pairs_s, mfu, peak, wall, timed_run, calls = line.removeprefix(label).split()
        timed, steps = (int(v) for v in timed_run.split("/"))
        assert float(ms) > 0 and abs(float(pairs_s) - 4 / float(ms) * 1000) <= 0.1 + 0.01 * float(pairs_s)
        assert abs(float(wall) - 30_000 / float(pairs_s) / 60) <= 0.1 + 0.01 * float(wall)
        assert (mfu, peak) == ("-", "0.00")  # no GPU: no MFU, no device memory
        assert 1 <= timed <= steps
        rows[label] = (steps, int(calls))
    assert rows["packages (as shipped)"][1] == 0
    for label in ("tower in the loop", "public recipe (decode+resize)"):
        run, tower_calls = rows[label]
        assert tower_calls >= run - 1, (label, rows[label])  # once after every step but the first
    assert "operators by host self time" in out
