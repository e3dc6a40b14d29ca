"""``bench/demo_progress.py`` runs (a smoke plan: a few steps on a few images) and prints every phase's cost beside
the constants the progress bar uses, and the tracker's worst time-left ratio on the run; its replay of a recorded
log feeds the product's tracker as the server does and judges it against the log's end."""

from __future__ import annotations

import statistics
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from bench import demo_progress
from rubricsearch.app.demo.checkpoints import DemoPlan
from rubricsearch.app.demo.progress import COSTS, PHASES, TAIL_S
from rubricsearch.app.warmup import duration
from tests.test_bench_smoke import bench, numbers
from tests.test_demo_progress import step_line

NUMBER = r"(-?\d+(?:\.\d+)?)"


@pytest.mark.timeout(600)
def test_demo_progress_bench_prints_the_phase_costs() -> None:
    out = bench("demo_progress.py", "--smoke", timeout=600)
    for phase in PHASES:
        numbers(rf"{phase} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER} +{NUMBER}", out)
    numbers(rf"tail +{NUMBER} +{NUMBER}", out)
    numbers(rf"worst {NUMBER}x the truth", out)


# The replay (`--replay FILE`) on a small synthetic log whose answer is known: a box that runs every phase at its
# constants' cost, half a second per unit, so the tracker's time left is the truth at every line; and the same box
# whose tail (saving, the policy measurement) takes three times its weight.
PLAN = {"vision tower": 20, "embedder": 10, "reranker": 200}
T0, UNIT = 1_796_616_000.0, 0.5


def synthetic_log(tail: float = 1.0, stamp: Callable[[float], str] = lambda t: f"{t:.3f}") -> tuple[str, float]:
    """The log's text (each line stamped by ``stamp``) and the run's true end."""
    t = T0
    out = [f"{stamp(t)} Loading weights:   0%|    | 0/92\rLoading weights: 100%|####| 92/92"]
    for phase in PHASES:
        t += UNIT * COSTS[phase].setup_s
        what = "reranker (150 pairs)" if phase == "reranker" else phase
        for step in range(PLAN[phase]):
            t += UNIT * COSTS[phase].step_s
            if step % 10 == 0 or step == PLAN[phase] - 1:
                out.append(f"{stamp(t)} {step_line(what, step, PLAN[phase], t - T0)}")
    t += UNIT * TAIL_S * tail
    out.append(f"{stamp(t)} demo reranker trained in {t - T0:.0f} s -> /tmp/demo-reranker")
    return "\n".join(out) + "\n", t


def replayed(text: str) -> tuple[list[demo_progress.Shown], float]:
    lines = demo_progress.read_log(text)
    steps = demo_progress.planned(lines, DemoPlan())
    return demo_progress.replay(lines, steps, lines[0][0], lines[-1][0]), lines[-1][0] - lines[0][0]


def test_the_replay_gives_the_tracker_the_plan_the_run_had() -> None:
    """The server's trainer knows its plan before the first line: the replay reads it from the log's step lines (a
    shortened plan, as the bench runs), and keeps the default plan's count for a phase that logged nothing."""
    lines = demo_progress.read_log(synthetic_log()[0])
    assert demo_progress.planned(lines, DemoPlan()) == PLAN
    reused = [(at, text) for at, text in lines if not text.startswith("embedder")]
    assert demo_progress.planned(reused, DemoPlan()) == PLAN | {"embedder": DemoPlan().embedder.steps}


def test_the_replay_of_a_run_at_the_constants_pace_is_exact(capsys: pytest.CaptureFixture[str]) -> None:
    text, end = synthetic_log()
    shown, run_s = replayed(text)
    assert run_s == pytest.approx(end - T0)
    assert len(shown) == sum(len(range(0, n, 10)) + 1 for n in PLAN.values())  # every step line, nothing else
    assert shown[0].left is None and shown[0].at < 0.1 * run_s  # no pace before the second line
    judged = [s for s in shown if s.at >= 0.1 * run_s and s.truth > 0]
    for s in judged:
        assert s.left == pytest.approx(s.truth, rel=1e-6)
    v = demo_progress.report(shown, run_s, every=False)
    assert (v.judged, v.blank, v.worst, v.median) == (len(judged), 0, pytest.approx(1.0), pytest.approx(1.0))
    out = capsys.readouterr().out
    for share in demo_progress.CHECKPOINTS:  # each checkpoint is the first step line from its share of the run on
        at = next(s for s in shown if s.at >= share * run_s)
        assert f"{100 * share:3.0f}% {duration(at.at):>12}" in out and f"about {duration(at.truth)} left" in out
    assert numbers(rf"worst {NUMBER}x the truth", out) == [pytest.approx(1.0, abs=0.006)]


def test_the_replay_judges_a_slow_tail_by_the_truth() -> None:
    """The tail takes 3x its weight: the time left shown lacks 2 tail weights, worst at the last reranker line."""
    text, _ = synthetic_log(tail=3.0)
    shown, run_s = replayed(text)
    extra = 2 * UNIT * TAIL_S
    ratios = [(s.truth - extra) / s.truth for s in shown if s.at >= 0.1 * run_s and s.truth > 0]
    v = demo_progress.verdict(shown, run_s)
    assert v.worst == pytest.approx(1 / 3) and v.off == pytest.approx(3.0)
    assert v.median == pytest.approx(statistics.median(ratios)) and v.judged == len(ratios)


def test_the_replay_reads_dates_as_well_as_unix_seconds() -> None:
    def iso(t: float) -> str:
        return datetime.fromtimestamp(t, UTC).strftime("%Y-%m-%d %H:%M:%S.%f")[:-3]

    by_epoch, _ = replayed(synthetic_log()[0])
    by_date, _ = replayed(synthetic_log(stamp=iso)[0])
    assert [s.fraction for s in by_date] == [s.fraction for s in by_epoch]
    assert [s.at for s in by_date] == pytest.approx([s.at for s in by_epoch], abs=0.002)  # ms cut, not rounded
    lines = demo_progress.read_log(synthetic_log(stamp=lambda t: iso(t).replace(".", ",") + "+00:00")[0])
    assert lines[:2] == [(T0, "Loading weights:   0%|    | 0/92"), (T0, "Loading weights: 100%|####| 92/92")]
