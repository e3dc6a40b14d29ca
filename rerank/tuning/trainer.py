"""Fine-tuning the reranker from a set's judgments and the references' cached packages.

Training runs the product's inference forward with gradients: token ids and shared-prefix groups from
:meth:`rerank.local.LocalScoringRuntime.plan`, states from :func:`rerank.prefix.shared_prefix_states`, and the
score search uses, ``h_last · (w_yes − w_no)``; the loss is the cross-entropy of the two-way softmax over the
``yes`` and ``no`` logits (binary cross-entropy on that score). Only LoRA adapters on the language model's
linear layers learn (peft); the vision tower and the LM head stay as they are, so every stored package stays
valid for the new version and training reads packages instead of running the tower. The tower's calls are
counted all the same, and reported.

One code path for every device: device and dtype are the loaded model's (float32 on a CPU, bfloat16 on a GPU).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.metrics import auc, log_loss
from rubricsearch.rerank.tuning.cells import Example, JudgedCell, Split, example, split_by_reference
from rubricsearch.rerank.tuning.forward import last_token_states
from rubricsearch.rerank.tuning.settings import LM_LINEAR, PATIENCE, TuningSettings
from rubricsearch.retrieval.errors import Conflict, InvalidInput
from rubricsearch.retrieval.packages import PackageStore, VisualPackage, VisualPackages
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.local import load_local

log = logging.getLogger("rubricsearch.tuning")



@dataclass(frozen=True)
class Metrics:
    """Held-out quality of the reranker's P(yes) on the validation references."""

    judgments: int
    auc: float | None
    log_loss: float
    precision_at_half: float | None  # share of yes among the cells scored >= 0.5 (None: no cell was)

    @classmethod
    def of(cls, scores: Sequence[float], labels: Sequence[bool]) -> Metrics:
        s, y = np.asarray(scores, dtype=np.float64), np.asarray(labels, dtype=bool)
        value = auc(s, y)
        matched = s >= 0.5
        return cls(len(y), None if np.isnan(value) else round(value, 4), round(log_loss(s, y), 4),
                   round(float(y[matched].mean()), 4) if matched.any() else None)

    def to_json(self) -> dict[str, Any]:
        return {"judgments": self.judgments, "auc": self.auc, "log_loss": self.log_loss,
                "precision_at_0.5": self.precision_at_half}


@dataclass(frozen=True)
class Progress:
    step: int
    steps: int
    loss: float
    validation_log_loss: float | None  # at the steps that validate


@dataclass
class Tuned:
    """A trained reranker, adapters not yet merged, and what the version card records."""

    loaded: LoadedQwen
    peft_model: Any
    base: Path
    settings: TuningSettings
    split: Split
    before: Metrics
    after: Metrics
    losses: list[float]
    steps_run: int
    best_step: int
    vision_encodes: int
    wall_s: float
    skipped_without_package: int
    fingerprint: str  # the digest packages are keyed by (tower weights and preprocessing)
    judgment_ids: list[int] = field(default_factory=list)  # the judgments trained and validated on
    max_judgment_id: int = 0  # the largest id given (the snapshot: later judgments are not in this version)


class TowerCalls:
    """Counts the vision tower's forward calls (every encode of any path goes through the module's call)."""

    def __init__(self, visual: torch.nn.Module) -> None:
        self.calls = 0
        self._handle = visual.register_forward_hook(self._count)

    def _count(self, *args: object) -> None:
        self.calls += 1

    def close(self) -> None:
        self._handle.remove()


def fine_tune_reranker(base: Path, cells: Sequence[JudgedCell], store: PackageStore, *,
                       settings: TuningSettings | None = None, vision: VisionConfig | None = None,
                       device: str | None = None, progress: Callable[[Progress], None] | None = None) -> Tuned:
    """Train LoRA adapters on the language model of the reranker checkpoint ``base`` from judged cells, reading
    each reference's package from ``store`` under the checkpoint's tower (and ``vision``'s preprocessing, which
    must be the serving one's to find them). Raises :class:`InvalidInput` for bad settings or judgments that
    cannot train, :class:`Conflict` when no judged reference has a package for this tower."""
    settings = settings or TuningSettings()
    vision = vision or VisionConfig()
    settings.check()
    if not cells:
        raise InvalidInput("no judgments to train on: record judgments of the set's references first")
    if len({c.holds for c in cells}) < 2:
        raise InvalidInput("every judgment answers the same: training needs yes and no judgments",
                           judgments=len(cells))
    started = time.monotonic()
    loaded = load_local(base, LocalConfig(device=device), lm_rows=("yes", "no"))
    runtime = LocalScoringRuntime(loaded, LocalConfig(device=device), vision, role="reranker",
                                  packages=VisualPackages(store))
    examples = [example(c) for c in cells]
    found = runtime.packages.find([e.pair.document.images[0] for e in examples])
    usable = [e for e in examples if e.cell.sha256 in found]
    if not usable:
        raise Conflict("no judged reference has a package for this reranker's vision tower: index the set (or run "
                       "the package backfill) with this model first", fingerprint=runtime.vision.fingerprint.short,
                       references=len({c.sha256 for c in cells}))
    split = split_by_reference(usable, settings.seed)
    torch.manual_seed(settings.seed)
    rng = random.Random(settings.seed)
    peft_model = _with_adapters(loaded, settings)
    counter = TowerCalls(loaded.model.visual)
    try:
        trainer = _Trainer(loaded, runtime, found, settings)
        before = trainer.evaluate(split.validation)
        losses, best_step, after = trainer.train(split, rng, before, progress)
    finally:
        counter.close()
    return Tuned(loaded=loaded, peft_model=peft_model, base=base, settings=settings, split=split, before=before,
                 after=after, losses=losses, steps_run=len(losses), best_step=best_step,
                 vision_encodes=counter.calls, wall_s=time.monotonic() - started,
                 skipped_without_package=len(examples) - len(usable),
                 fingerprint=runtime.vision.fingerprint.digest(),
                 judgment_ids=sorted(e.cell.judgment_id for e in usable),
                 max_judgment_id=max(c.judgment_id for c in cells))


def _with_adapters(loaded: LoadedQwen, settings: TuningSettings) -> Any:
    """LoRA adapters injected into ``loaded.model`` in place (the product's forward runs through them); every
    other weight is frozen."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=settings.rank, lora_alpha=settings.alpha, lora_dropout=settings.dropout,
                        target_modules=LM_LINEAR, bias="none")
    return get_peft_model(loaded.model, config)


class _Trainer:
    def __init__(self, loaded: LoadedQwen, runtime: LocalScoringRuntime, packages: dict[str, VisualPackage],
                 settings: TuningSettings) -> None:
        self.loaded, self.runtime, self.packages, self.settings = loaded, runtime, packages, settings
        self.weight = runtime.weight  # w_yes − w_no, float32
        self.params = [p for p in loaded.model.parameters() if p.requires_grad]
        self.every = max(1, settings.steps // 10)

    def logits(self, rows: Sequence[Example]) -> torch.Tensor:
        """``h_last · (w_yes − w_no)`` of the rows, in their order, through the shortlist's forward."""
        return last_token_states(self.runtime, [e.pair for e in rows], self.packages) @ self.weight

    def evaluate(self, rows: Sequence[Example]) -> Metrics:
        self.loaded.model.eval()
        scores: list[float] = []
        with torch.no_grad():
            for start in range(0, len(rows), 4 * self.settings.batch):
                scores += torch.sigmoid(self.logits(rows[start:start + 4 * self.settings.batch])).tolist()
        return Metrics.of(scores, [e.yes for e in rows])

    def train(self, split: Split, rng: random.Random, before: Metrics, progress: Callable[[Progress], None] | None
              ) -> tuple[list[float], int, Metrics]:
        """Steps over shuffled epochs of the training cells; validation log-loss every ``steps // 10`` steps keeps
        the best adapters and stops after :data:`PATIENCE` validations without improvement."""
        opt = torch.optim.AdamW(self.params, lr=self.settings.lr, weight_decay=0.0)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / max(1, self.settings.steps // 20)))
        best, best_step, best_state, waited = before, 0, self._adapters(), 0
        losses: list[float] = []
        order: list[Example] = []
        for step in range(1, self.settings.steps + 1):
            if len(order) < self.settings.batch:
                epoch = list(split.train)
                rng.shuffle(epoch)
                order += epoch
            batch, order = order[:self.settings.batch], order[self.settings.batch:]
            self.loaded.model.train()
            logits = self.logits(batch)
            target = torch.tensor([float(e.yes) for e in batch], device=logits.device)
            loss = F.binary_cross_entropy_with_logits(logits, target)
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.params, 1.0)
            opt.step()
            sched.step()
            losses.append(float(loss.detach()))
            validated = None
            if step % self.every == 0 or step == self.settings.steps:
                metrics = self.evaluate(split.validation)
                validated = metrics.log_loss
                if metrics.log_loss < best.log_loss:
                    best, best_step, best_state, waited = metrics, step, self._adapters(), 0
                else:
                    waited += 1
            if progress is not None:
                progress(Progress(step, self.settings.steps, losses[-1], validated))
            if waited >= PATIENCE:
                log.info("validation log-loss has not improved for %d validations: stopping at step %d",
                         PATIENCE, step)
                break
        self._restore(best_state)
        self.loaded.model.eval()
        return losses, best_step, best

    def _adapters(self) -> dict[str, torch.Tensor]:
        return {n: p.detach().clone() for n, p in self.loaded.model.named_parameters() if p.requires_grad}

    def _restore(self, state: dict[str, torch.Tensor]) -> None:
        params = dict(self.loaded.model.named_parameters())
        with torch.no_grad():
            for name, value in state.items():
                params[name].copy_(value)
