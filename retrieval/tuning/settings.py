"""A fine-tune's settings, the reranker's and the embedder's: plain values and their bounds, importable without torch
(the CLI's --help reads the defaults)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from rubricsearch.retrieval.errors import InvalidInput

# LoRA on every linear layer of the language model (attention and MLP), none in the vision tower
LM_LINEAR = r"language_model\.layers\.\d+\.(self_attn\.(q|k|v|o)_proj|mlp\.(gate|up|down)_proj)"
# validations without a better held-out metric before training stops: a new attribute is learned after a plateau
# of the validation log-loss that three validations could end (docs/fine-tuning.md, the learning test)
PATIENCE = 6
Trainer = Literal["reranker", "embedder"]


@dataclass(frozen=True)
class TuningSettings:
    """LoRA rank 8 and alpha 32 on all linear layers of the LM are the public recipes' (ms-swift); the
    learning rate was chosen by measurement on the demo models (docs/performance.md); the steps are each
    trainer's (:data:`DEFAULTS`)."""

    steps: int  # at most: early stopping may end sooner
    rank: int = 8
    alpha: int = 32
    lr: float = 3e-4
    batch: int = 16  # pairs per step
    seed: int = 0
    dropout: float = 0.05
    # the reranker's alone: weight of the base's own answers on the cells the set did not judge, so a new criterion
    # is not learned at the others' cost (0: the judged cells alone; chosen by measurement, docs/fine-tuning.md).
    # The embedder's counterpart is a constant of its own name (retrieval.tuning.embedder.PULL).
    preserve: float = 0.3

    def check(self) -> None:
        problems = [name for name, ok in (("rank", 1 <= self.rank <= 256), ("alpha", 1 <= self.alpha <= 4096),
                                          ("lr", 0 < self.lr <= 0.1), ("steps", 1 <= self.steps <= 100_000),
                                          ("batch", 1 <= self.batch <= 4096), ("dropout", 0 <= self.dropout < 1),
                                          ("seed", 0 <= self.seed < 2**32),
                                          ("preserve", 0 <= self.preserve <= 100))
                    if not ok]
        if problems:
            raise InvalidInput("training settings out of range: rank 1..256, alpha 1..4096, lr in (0, 0.1], "
                               "steps 1..100000, batch 1..4096, dropout in [0, 1), seed 0..2^32-1, "
                               "preserve 0..100",
                               settings=", ".join(f"{p}={getattr(self, p)}" for p in problems))

    def read_by(self, trainer: Trainer) -> dict[str, Any]:
        """The values ``trainer`` reads, which rebuild these settings (``TuningSettings(**values)``): the
        embedder's trainer does not read ``preserve``."""
        values = asdict(self)
        if trainer == "embedder":
            del values["preserve"]
        return values

    def to_json(self, trainer: Trainer) -> dict[str, Any]:
        """What a version's card records of the settings ``trainer`` trained with."""
        return {**self.read_by(trainer), "target_modules": LM_LINEAR, "patience": PATIENCE}


# Each trainer's step budget, chosen by measurement on the demo models: the reranker learns an attribute it never
# saw (the learning test's collar) within 600 steps, and only part of it within 200; the embedder learns its
# criterion fully within 200 (docs/fine-tuning.md).
DEFAULTS: dict[Trainer, TuningSettings] = {"reranker": TuningSettings(steps=600), "embedder": TuningSettings(steps=200)}


def asked(trainer: Trainer, *, steps: int | None, rank: int, alpha: int, lr: float, batch: int, seed: int
          ) -> TuningSettings:
    """The settings a training job or ``rubricsearch train`` asks for; ``steps`` left out (None) is ``trainer``'s
    budget (:data:`DEFAULTS`)."""
    return TuningSettings(steps=DEFAULTS[trainer].steps if steps is None else steps, rank=rank, alpha=alpha, lr=lr,
                          batch=batch, seed=seed)
