"""Fine-tuning the reranker from a set's judgments and the references' cached packages.

Training runs the product's inference forward with gradients: token ids and shared-prefix groups from
:meth:`rerank.local.LocalScoringRuntime.plan`, states from :func:`rerank.prefix.shared_prefix_states`, and the
score search uses, ``h_last · (w_yes − w_no)``; the loss is the cross-entropy of the two-way softmax over the
``yes`` and ``no`` logits (binary cross-entropy on that score), plus, weighted by the settings' ``preserve``, the
same cross-entropy against the base model's own answers on cells the set did not judge, one for each judged row,
on that row's own reference (asked another of the set's criteria): learning a new criterion does not unlearn the
ones the team relies on, on the very images it is learned from (learning without forgetting). The base's answers
are scored once, before the first step, from packages. Only LoRA adapters on the language model's linear layers
learn (peft); the vision tower and the LM head stay as they are, so every stored package stays valid for the new
version and training reads packages instead of running the tower. The tower's calls are counted all the same, and
reported.

One code path for every device: device and dtype are the loaded model's (float32 on a CPU, bfloat16 on a GPU).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.metrics import auc, log_loss
from rubricsearch.rerank.tuning.cells import Example, Split, example, split_by_reference
from rubricsearch.rerank.tuning.forward import last_token_states
from rubricsearch.retrieval.errors import Conflict
from rubricsearch.retrieval.packages import PackageStore, VisualPackage, VisualPackages
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.runtime.config import LocalConfig, ModelConfig, VisionConfig
from rubricsearch.retrieval.runtime.local import load_local
from rubricsearch.retrieval.runtime.registry import build_runtime
from rubricsearch.retrieval.tuning.judgments import JudgedCell, check_cells
from rubricsearch.retrieval.tuning.loop import (
    Progress,
    TowerCalls,
    TrainingRecord,
    Validation,
    fit_adapters,
    with_adapters,
)
from rubricsearch.retrieval.tuning.settings import DEFAULTS, TuningSettings


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


@dataclass(kw_only=True)
class Tuned(TrainingRecord):
    """A trained reranker, adapters not yet merged, and what the version card records."""

    loaded: LoadedQwen
    peft_model: Any
    base: Path
    settings: TuningSettings
    split: Split
    before: Metrics
    after: Metrics


def fine_tune_reranker(base: Path, cells: Sequence[JudgedCell], store: PackageStore, *,
                       settings: TuningSettings | None = None, vision: VisionConfig | None = None,
                       local: LocalConfig | None = None, progress: Callable[[Progress], None] | None = None) -> Tuned:
    """Train LoRA adapters on the language model of the reranker checkpoint ``base`` from judged cells, reading
    each reference's package from ``store`` under the checkpoint's tower (and ``vision``'s preprocessing, which
    must be the serving one's to find them) and under ``local``, the serving model's local runtime configuration
    (device, dtype, engine: a model trains through the passes it serves with). Raises :class:`InvalidInput` for bad
    settings or judgments that cannot train, :class:`Conflict` when no judged reference has a package for this
    tower."""
    settings = settings or DEFAULTS["reranker"]
    vision = vision or VisionConfig()
    settings.check()
    check_cells(cells)
    started = time.monotonic()
    local = local or LocalConfig()
    loaded = load_local(base, local, lm_rows=("yes", "no"))
    # the engine the model serves with: on a GPU the accelerated one, whose fused kernels have backward passes
    runtime: LocalScoringRuntime = build_runtime("reranker", loaded, ModelConfig(vision=vision, local=local),
                                                 packages=VisualPackages(store), vision=None)
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
    peft_model = with_adapters(loaded.model, settings)
    counter = TowerCalls(loaded.model.visual)
    try:
        trainer = _Trainer(loaded, runtime, found, settings, split.train, rng)
        before = trainer.evaluate(split.validation)
        validation = Validation(lambda: trainer.evaluate(split.validation), lambda m: m.log_loss, "log-loss",
                                higher=False)
        fitted = fit_adapters(loaded.model, settings, split.train, rng, trainer.loss, validation=validation,
                              before=before, progress=progress)
    finally:
        counter.close()
    return Tuned(loaded=loaded, peft_model=peft_model, base=base, settings=settings, split=split, before=before,
                 after=fitted.best, losses=fitted.losses, best_step=fitted.best_step,
                 vision_encodes=counter.calls, wall_s=time.monotonic() - started,
                 skipped_without_package=len(examples) - len(usable),
                 fingerprint=runtime.vision.fingerprint.digest(),
                 judgment_ids=sorted(e.cell.judgment_id for e in usable),
                 max_judgment_id=max(c.judgment_id for c in cells))


class _Trainer:
    def __init__(self, loaded: LoadedQwen, runtime: LocalScoringRuntime, packages: dict[str, VisualPackage],
                 settings: TuningSettings, train: Sequence[Example], rng: random.Random) -> None:
        self.loaded, self.runtime, self.packages, self.settings = loaded, runtime, packages, settings
        self.weight = runtime.weight  # w_yes − w_no, float32
        self.rng = rng
        self.kept = unjudged(train) if settings.preserve > 0 else []
        self.kept_logits = self.scores(self.kept)  # the base's: the adapters start at zero
        self.kept_of: dict[str, list[int]] = {}
        for i, e in enumerate(self.kept):
            self.kept_of.setdefault(e.cell.sha256, []).append(i)

    def logits(self, rows: Sequence[Example]) -> torch.Tensor:
        """``h_last · (w_yes − w_no)`` of the rows, in their order, through the shortlist's forward."""
        return last_token_states(self.runtime, [e.pair for e in rows], self.packages) @ self.weight

    def scores(self, rows: Sequence[Example]) -> torch.Tensor:
        """The rows' logits in eval mode, without gradients."""
        self.loaded.model.eval()
        out: list[torch.Tensor] = [torch.zeros(0)]
        with torch.no_grad():
            for start in range(0, len(rows), 4 * self.settings.batch):
                out.append(self.logits(rows[start:start + 4 * self.settings.batch]).float().cpu())
        return torch.cat(out)

    def evaluate(self, rows: Sequence[Example]) -> Metrics:
        return Metrics.of(torch.sigmoid(self.scores(rows)).tolist(), [e.yes for e in rows])

    def loss(self, batch: list[Example]) -> torch.Tensor:
        """Binary cross-entropy of the yes/no score against the judged answers, plus ``preserve`` times the
        cross-entropy against the base's P(yes) on an unjudged cell of each judged row's reference, drawn at random:
        what a taught criterion can leak into is the other statements on the very images that carry it."""
        kept = [self.rng.choice(self.kept_of[e.cell.sha256]) for e in batch if e.cell.sha256 in self.kept_of]
        logits = self.logits(batch + [self.kept[i] for i in kept])
        target = torch.tensor([float(e.yes) for e in batch], device=logits.device)
        loss = F.binary_cross_entropy_with_logits(logits[:len(batch)], target)
        if kept:
            base = torch.sigmoid(self.kept_logits[kept]).to(logits.device)
            loss = loss + self.settings.preserve * F.binary_cross_entropy_with_logits(logits[len(batch):], base)
        return loss


def unjudged(train: Sequence[Example]) -> list[Example]:
    """Every training reference asked each criterion the set judges on other references but not on it (by
    statement: "no stripes" is "stripes" asked); the label is unused, the base's answer is the target."""
    criteria = {e.pair.query.texts[0]: e.cell.criterion for e in train}
    judged = {(e.cell.sha256, e.pair.query.texts[0]) for e in train}
    return [example(JudgedCell(0, sha, criterion, False))
            for sha in sorted({e.cell.sha256 for e in train})
            for statement, criterion in sorted(criteria.items()) if (sha, statement) not in judged]
