"""The training machinery: the one training loop (:func:`fit`), and what the set fine-tunes add to it: LoRA
adapters on the language model (peft), the counted vision tower, shuffled epochs over their judgments and the
early stopping that keeps the adapters of the best validation.

Every trainer runs :func:`fit`: the set fine-tunes of the reranker and the embedder, and the demo models' trainers
(app/demo), which step freshly sampled batches with their own optimiser and schedule and keep their final weights.
What differs between them comes in as arguments: the optimiser, the stream of batches, a batch's loss, the
validation if any, and what a step reports.
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

import torch
from torch.nn.utils import parametrize

from rubricsearch.retrieval.tuning.settings import LM_LINEAR, PATIENCE, TuningSettings

if TYPE_CHECKING:
    from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

log = logging.getLogger("rubricsearch.tuning")
Item = TypeVar("Item")
Batch = TypeVar("Batch")
Measured = TypeVar("Measured")


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int
    loss: float
    validation: float | None  # the held-out metric at the steps that validate
    metric: str  # its name ("log-loss", "ndcg@10"; "" when the loop does not validate)


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
    weight is frozen.

    peft keeps the adapters float32 over a bfloat16 base and casts each adapted layer's input up to them, so a GPU
    step would carry float32 copies of every such activation through the forward, the saved tensors and the
    backward. Here the adapters stay float32 for the optimiser (the trainable parameters) and the layer computes
    with them cast to the base's dtype: the input is not copied, the adapter's path runs in bfloat16 like the rest
    of the pass. Over a float32 base (the CPU) nothing changes. :func:`merged` undoes it before merging."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=LM_LINEAR, bias="none")
    peft_model = get_peft_model(model, config)
    for layer in peft_model.modules():
        if isinstance(layer, LoraLayer):
            base = layer.get_base_layer()
            assert isinstance(base, torch.nn.Linear)  # the targets are the LM's linear layers
            dtype = base.weight.dtype
            for adapter in (*layer.lora_A.values(), *layer.lora_B.values()):
                if adapter.weight.dtype != dtype:  # unsafe: this parametrization changes the dtype, on purpose
                    parametrize.register_parametrization(adapter, "weight", _Cast(dtype), unsafe=True)
    return peft_model


class _Cast(torch.nn.Module):
    """An adapter's weight as its layer computes with it: the float32 parameter cast to the base's dtype."""

    def __init__(self, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight.to(self.dtype)


def merged(peft_model: Any) -> Any:
    """The model with its adapters merged into the base weights (peft's ``merge_and_unload``), each delta computed
    from the float32 adapters."""
    for module in peft_model.modules():
        if parametrize.is_parametrized(module, "weight") and any(
                isinstance(p, _Cast) for p in module.parametrizations.weight):
            parametrize.remove_parametrizations(module, "weight", leave_parametrized=False)
    return peft_model.merge_and_unload()


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
    best_step: int  # the step whose weights are kept: 0 when no validation beat the start; without validation, the last
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


@dataclass(frozen=True)
class Optimizing:
    """The trainable parameters and how they step: their gradients clipped to norm 1 together, then the optimiser
    and its learning-rate schedule."""

    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    schedule: torch.optim.lr_scheduler.LRScheduler


def warm_adamw(model: torch.nn.Module, settings: TuningSettings) -> Optimizing:
    """The fine-tunes' optimiser: AdamW without weight decay on every trainable parameter (the adapters), the
    learning rate rising linearly over the first twentieth of the steps."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=0.0)
    return Optimizing(params, opt, torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / max(1, settings.steps // 20))))


def epochs(items: Sequence[Item], batch: int, rng: random.Random) -> Iterator[list[Item]]:
    """Batches of ``batch`` items over shuffled epochs of ``items``; an epoch is shuffled when the batch that
    needs it is drawn, so draws the loss makes from the same ``rng`` interleave as they are asked."""
    order: list[Item] = []
    while True:
        if len(order) < batch:
            epoch = list(items)
            rng.shuffle(epoch)
            order += epoch
        drawn, order = order[:batch], order[batch:]
        yield drawn


def fit(model: torch.nn.Module, steps: int, optimizing: Optimizing, batches: Iterator[Batch],
        loss_of: Callable[[Batch], torch.Tensor], *, validation: Validation[Measured] | None, before: Measured,
        progress: Callable[[Progress], None] | None = None) -> Fitted[Measured]:
    """``steps`` steps, each on the next of ``batches`` (drawn when its step starts, so any sampling interleaves
    with the step's own draws): the batch's loss, backward, gradients clipped, the optimiser and schedule
    stepped.

    With a ``validation``, measured every ``steps // 10`` steps (and at the last) against ``before`` (the start's
    measurement), the best trainable weights are kept and training stops after :data:`PATIENCE` validations
    without improvement. Without one, every step runs and the final weights are kept. The model ends in eval
    mode."""
    every = max(1, steps // 10)
    metric = validation.metric if validation is not None else ""
    best, best_step, waited = before, 0, 0
    best_state = _trainable(model) if validation is not None else {}
    losses: list[float] = []
    for step in range(1, steps + 1):
        batch = next(batches)
        model.train()
        with parametrize.cached():  # each cast adapter weight made once per step, however many passes read it
            loss = loss_of(batch)
        optimizing.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(optimizing.params, 1.0)
        optimizing.optimizer.step()
        optimizing.schedule.step()
        losses.append(float(loss.detach()))
        validated, stop = None, False
        if validation is not None and (step % every == 0 or step == steps):
            model.eval()
            with torch.no_grad():
                measured = validation.run()
            validated = validation.value(measured)
            if validation.better(measured, best):
                best, best_step, best_state, waited = measured, step, _trainable(model), 0
            else:
                waited += 1
            stop = waited >= PATIENCE
        if progress is not None:
            progress(Progress(step, steps, losses[-1], validated, metric))
        if stop:
            log.info("validation %s has not improved for %d validations: stopping at step %d", metric, PATIENCE,
                     step)
            break
    if validation is None:
        best_step = len(losses)
    else:
        _restore(model, best_state)
    model.eval()
    return Fitted(losses, best_step, best)


def fit_adapters(model: torch.nn.Module, settings: TuningSettings, items: Sequence[Item], rng: random.Random,
                 loss_of: Callable[[list[Item]], torch.Tensor], *, validation: Validation[Measured], before: Measured,
                 progress: Callable[[Progress], None] | None = None) -> Fitted[Measured]:
    """A set fine-tune's run of :func:`fit`: at most ``settings.steps`` steps of the adapters under
    :func:`warm_adamw`, on shuffled :func:`epochs` of ``settings.batch`` items, early-stopped by ``validation``."""
    return fit(model, settings.steps, warm_adamw(model, settings), epochs(items, settings.batch, rng), loss_of,
               validation=validation, before=before, progress=progress)


def _trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def _restore(model: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, value in state.items():
            params[name].copy_(value)
