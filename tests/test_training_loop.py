"""The one training loop (``retrieval.tuning.loop.fit``) that the set fine-tunes and the demo trainers run: without
a validation every step runs and the final weights stay; with one the best validated weights come back and
training stops after ``PATIENCE`` validations without improvement; batches are drawn as their steps start."""

from __future__ import annotations

import itertools
import random
from collections.abc import Iterator

import torch

from rubricsearch.retrieval.tuning.loop import Optimizing, Progress, Validation, epochs, fit
from rubricsearch.retrieval.tuning.settings import PATIENCE


def _model() -> tuple[torch.nn.Linear, Optimizing]:
    model = torch.nn.Linear(1, 1, bias=False)
    with torch.no_grad():
        model.weight.fill_(0.0)
    params = list(model.parameters())
    opt = torch.optim.SGD(params, lr=0.1)
    return model, Optimizing(params, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))


def _weight(model: torch.nn.Linear) -> float:
    return float(model.weight.detach())


def _toward(model: torch.nn.Linear, target: float) -> torch.Tensor:
    return (model.weight - target).pow(2).sum()


def test_without_validation_every_step_runs_and_the_final_weights_stay() -> None:
    model, optimizing = _model()
    seen: list[Progress] = []
    fitted = fit(model, 30, optimizing, itertools.repeat(1.0), lambda t: _toward(model, t), validation=None,
                 before=None, progress=seen.append)
    assert len(fitted.losses) == 30 and fitted.best_step == 30 and fitted.best is None
    assert [p.step for p in seen] == list(range(1, 31)) and all(p.validation is None for p in seen)
    assert fitted.losses == sorted(fitted.losses, reverse=True)
    assert abs(_weight(model) - 1.0) < 0.01  # the last step's weights, not the start's
    assert not model.training


def test_validation_keeps_the_best_weights_and_stops_without_improvement() -> None:
    """The weight walks to 1 and on to 3 while validation wants it at 1: the weights of the best validation come
    back, and training stops ``PATIENCE`` validations after it."""
    model, optimizing = _model()
    targets = itertools.chain(itertools.repeat(1.0, 20), itertools.repeat(3.0))
    check = Validation(lambda: abs(_weight(model) - 1.0), lambda m: m, "distance", higher=False)
    fitted = fit(model, 100, optimizing, targets, lambda t: _toward(model, t), validation=check,
                 before=abs(_weight(model) - 1.0))
    assert fitted.best_step == 20 and len(fitted.losses) == 20 + 10 * PATIENCE
    assert abs(_weight(model) - 1.0) == fitted.best < 0.05


def test_a_validation_that_never_improves_keeps_the_start() -> None:
    model, optimizing = _model()
    check = Validation(lambda: abs(_weight(model)), lambda m: m, "distance", higher=False)
    fitted = fit(model, 50, optimizing, itertools.repeat(1.0), lambda t: _toward(model, t), validation=check,
                 before=0.0)
    assert fitted.best_step == 0 and _weight(model) == 0.0 and len(fitted.losses) == 5 * PATIENCE


def test_each_batch_is_drawn_when_its_step_starts() -> None:
    """The stream is asked for one batch per step, when the step starts: draws a loss makes from the same random
    generator come after its batch's, and no batch is drawn past the last step."""
    model, optimizing = _model()
    rng = random.Random(0)
    log: list[str] = []

    def batches() -> Iterator[int]:
        for n in itertools.count():
            log.append(f"batch {n}")
            yield n

    def loss_of(n: int) -> torch.Tensor:
        log.append(f"loss {n}")
        return _toward(model, rng.random())

    fit(model, 3, optimizing, batches(), loss_of, validation=None, before=None)
    assert log == ["batch 0", "loss 0", "batch 1", "loss 1", "batch 2", "loss 2"]


def test_epochs_shuffle_each_pass_when_a_batch_needs_it() -> None:
    rng, same = random.Random(3), random.Random(3)
    stream = epochs(list(range(5)), 2, rng)
    drawn = [next(stream) for _ in range(5)]
    first, second = list(range(5)), list(range(5))
    same.shuffle(first)
    same.shuffle(second)
    assert [x for b in drawn for x in b] == first + second
    assert [len(b) for b in drawn] == [2, 2, 2, 2, 2]
