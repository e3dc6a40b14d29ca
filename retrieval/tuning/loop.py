"""The training machinery both fine-tunes run: LoRA adapters on the language model (peft), the counted vision
tower, and the early-stopped loop over shuffled epochs that keeps the adapters of the best validation.

What differs between the reranker and the embedder is only what a batch's loss is and what validation
measures; both come in as functions.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch

from rubricsearch.retrieval.tuning.settings import LM_LINEAR, PATIENCE, TuningSettings

if TYPE_CHECKING:
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

log = logging.getLogger("rubricsearch.tuning")
Item = TypeVar("Item")
Measured = TypeVar("Measured")


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int
    loss: float
    validation: float | None  # the held-out metric at the steps that validate
    metric: str  # its name ("log-loss", "ndcg@10")


class TowerCalls:
    """Counts the vision tower's forward calls (every encode of any path goes through the module's call)."""

    def __init__(self, visual: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = visual.register_forward_hook(self._count)

    def _count(self, *args: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def with_adapters(model: torch.nn.Module, settings: TuningSettings) -> Any:
    """LoRA adapters injected into ``model`` in place (the product's forward runs through them); every other
    weight is frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=LM_LINEAR, bias="none")
    return get_peft_model(model, config)


@dataclass(kw_only=True)
class TrainingRecord:
    """What either fine-tune records of its run, and the card keys it is written under (:meth:`card`)."""

    losses: list[float]
    best_step: int  # 0: no validation beat the start, whose weights are kept
    vision_encodes: int
    wall_s: float
    skipped_without_package: int
    fingerprint: str  # the digest packages are keyed by (tower weights and preprocessing)
    judgment_ids: list[int]  # the judgments trained and validated on
    max_judgment_id: int  # the largest id given (the snapshot: later judgments are not in this version)

    @property
    def steps_run(self) -> int:
        return len(self.losses)

    def card(self, *, kind: str, base: Path, method: str, loaded: LoadedQwen, data: Mapping[str, Any],
             settings: Mapping[str, Any], held_out: str, before: Mapping[str, Any], after: Mapping[str, Any]
             ) -> dict[str, Any]:
        """The version card: this record's keys and the trainer's own (``data`` after ``about`` and the
        snapshot, ``settings``, the held-out metrics and what they are measured on)."""
        return {
            "kind": kind,
            "base_model": str(base.resolve()),
            "method": method,
            "data": {**data, "judgment_ids": self.judgment_ids, "max_judgment_id": self.max_judgment_id,
                     "judgments": len(self.judgment_ids), "skipped_without_package": self.skipped_without_package},
            "settings": dict(settings),
            "training": {"steps_run": self.steps_run, "best_step": self.best_step,
                         "first_loss": round(self.losses[0], 4) if self.losses else None,
                         "last_loss": round(self.losses[-1], 4) if self.losses else None,
                         "device": str(loaded.device), "dtype": str(loaded.dtype).removeprefix("torch.")},
            "metrics": {"held_out": held_out, "before": dict(before), "after": dict(after)},
            "wall_s": round(self.wall_s, 2),
            "vision_encodes": self.vision_encodes,
            "tower_hash": loaded.tower_hash,
            "package_fingerprint": self.fingerprint,
        }


@dataclass(frozen=True)
class Fitted(Generic[Measured]):
    losses: list[float]
    best_step: int  # 0: no validation beat the start, whose weights are kept
    best: Measured


@dataclass(frozen=True)
class Validation(Generic[Measured]):
    """How a fine-tune is measured: ``run`` measures the held-out side, ``value`` reads the early-stopping metric
    ``metric`` from a measurement, better when higher if ``higher``; equal values are told apart by ``tie``
    (lower is better), where a metric of ranks moves in steps."""

    run: Callable[[], Measured]
    value: Callable[[Measured], float]
    metric: str
    higher: bool
    tie: Callable[[Measured], float] | None = None

    def better(self, new: Measured, best: Measured) -> bool:
        a, b = self.value(new), self.value(best)
        if a != b:
            return a > b if self.higher else a < b
        return self.tie is not None and self.tie(new) < self.tie(best)


def fit(model: torch.nn.Module, settings: TuningSettings, train: Sequence[Item], rng: random.Random,
        loss_of: Callable[[list[Item]], torch.Tensor], validation: Validation[Measured], before: Measured,
        progress: Callable[[Progress], None] | None = None) -> Fitted[Measured]:
    """Steps of ``settings.batch`` items over shuffled epochs of ``train``; validation every ``steps // 10`` steps
    (and at the last) keeps the best adapters, and training stops after :data:`PATIENCE` validations without
    improvement. The model ends in eval mode with the best adapters."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, settings.steps // 20)))
    every = max(1, settings.steps // 10)
    best, best_step, best_state, waited = before, 0, _adapters(model), 0
    losses: list[float] = []
    order: list[Item] = []
    for step in range(1, settings.steps + 1):
        if len(order) < settings.batch:
            epoch = list(train)
            rng.shuffle(epoch)
            order += epoch
        batch, order = order[:settings.batch], order[settings.batch:]
        model.train()
        loss = loss_of(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        sched.step()
        losses.append(float(loss.detach()))
        validated = None
        if step % every == 0 or step == settings.steps:
            model.eval()
            with torch.no_grad():
                measured = validation.run()
            validated = validation.value(measured)
            if validation.better(measured, best):
                best, best_step, best_state, waited = measured, step, _adapters(model), 0
            else:
                waited += 1
        if progress is not None:
            progress(Progress(step, settings.steps, losses[-1], validated, validation.metric))
        if waited >= PATIENCE:
            log.info("validation %s has not improved for %d validations: stopping at step %d", validation.metric,
                     PATIENCE, step)
            break
    _restore(model, best_state)
    model.eval()
    return Fitted(losses, best_step, best)


def _adapters(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _restore(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
