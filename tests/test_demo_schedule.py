"""The demo trainers' learning-rate schedule (``app/demo/training.one_cycle``): any number of steps trains (a plan of
10 embedder steps divided by zero in torch's OneCycleLR, issue 50), and the default plan's schedules are torch's,
learning rate for learning rate, so its models come out as before."""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
import torch

from rubricsearch.app.demo.checkpoints import DemoPlan
from rubricsearch.app.demo.training import one_cycle

Schedule = Callable[[torch.optim.Optimizer], torch.optim.lr_scheduler.LRScheduler]


def learning_rates(schedule: Schedule, steps: int, lr: float) -> list[float]:
    """The learning rate of each step, stepped as the training loop steps (``retrieval.tuning.loop.fit``)."""
    weight = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([weight], lr=lr, weight_decay=0.01)
    sched = schedule(opt)
    rates = []
    for _ in range(steps):
        rates.append(opt.param_groups[0]["lr"])
        opt.step()  # no gradient: nothing to compute, only the order the schedule expects
        sched.step()
    return rates


def test_the_default_plans_schedules_are_torchs_unchanged() -> None:
    plan = DemoPlan()
    # the vision tower's and the embedder's warm-up is a tenth of their steps (app/demo/train_embedder.py)
    for lr, steps, warmup in ((plan.embedder.tower_lr, plan.embedder.tower_steps, 0.1),
                              (plan.embedder.lr, plan.embedder.steps, 0.1),
                              (plan.reranker.lr, plan.reranker.steps, plan.reranker.warmup)):
        torch_rates = learning_rates(lambda opt, lr=lr, steps=steps, warmup=warmup: torch.optim.lr_scheduler.OneCycleLR(
            opt, max_lr=lr, total_steps=steps, pct_start=warmup), steps, lr)
        rates = learning_rates(lambda opt, lr=lr, steps=steps, warmup=warmup: one_cycle(opt, lr, steps, warmup),
                               steps, lr)
        assert rates == torch_rates  # bit for bit
        assert max(rates) == pytest.approx(lr) and rates.index(max(rates)) == round(warmup * steps) - 1


@pytest.mark.parametrize("warmup", [0.1, 0.05])
def test_any_number_of_steps_trains(warmup: float) -> None:
    for steps in range(1, 121):
        rates = learning_rates(lambda opt, steps=steps: one_cycle(opt, 1e-3, steps, warmup), steps, 1e-3)
        assert all(math.isfinite(r) and 0 < r <= 1e-3 * (1 + 1e-9) for r in rates), (steps, rates)


def test_a_one_step_warm_up_is_none() -> None:
    """``--embedder-steps 10`` (a tenth: one warm-up step) and 20 reranker steps at 0.05: the schedule starts near
    its peak and only anneals."""
    for steps, warmup in ((10, 0.1), (20, 0.05)):
        rates = learning_rates(lambda opt, steps=steps, warmup=warmup: one_cycle(opt, 1e-3, steps, warmup), steps,
                               1e-3)
        assert rates == sorted(rates, reverse=True) and rates[0] > 0.9e-3 > 1e-4 > rates[-1], rates
