"""Training jobs, model versions and their activation (``app/routers/training.py``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from rubricsearch.app.schemas.jobs import JobStateName
from rubricsearch.retrieval.tuning.settings import DEFAULTS, TuningSettings, asked

_DEFAULTS = DEFAULTS["reranker"]  # the values both trainers share


class TrainingBody(BaseModel):
    """The fine-tune's settings; each left out takes the trainer's default (out of range: 400, no job recorded)."""

    model_config = ConfigDict(extra="forbid")

    model: Literal["reranker", "embedder"] = Field("reranker", description="Which of the set's models to "
                                                   "fine-tune.")
    rank: int = Field(_DEFAULTS.rank, description="LoRA rank, 1..256.")
    alpha: int = Field(_DEFAULTS.alpha, description="LoRA alpha, 1..4096.")
    lr: float = Field(_DEFAULTS.lr, description="Learning rate, in (0, 0.1].")
    steps: int | None = Field(None, description="Training steps at most (early stopping may end sooner), "
                              "1..100000; by default the model's: reranker "
                              f"{DEFAULTS['reranker'].steps}, embedder {DEFAULTS['embedder'].steps}.")
    batch: int = Field(_DEFAULTS.batch, description="(statement, reference) pairs per step, 1..4096.")
    seed: int = Field(_DEFAULTS.seed, description="Seeds the train/validation split, the data order and the "
                      "adapters' initialisation.")

    def settings(self) -> TuningSettings:
        return asked(self.model, steps=self.steps, rank=self.rank, alpha=self.alpha, lr=self.lr, batch=self.batch,
                     seed=self.seed)


class TrainingProgressOut(BaseModel):
    loss: float | None = Field(None, description="The last step's training loss.")
    validation_log_loss: float | None = Field(None, description="The latest validation (held-out references) "
                                              "log-loss; validation runs every steps/10 steps.")
    best_validation_log_loss: float | None = None
    validation_ndcg: float | None = Field(None, description="An embedder job's: the latest validation nDCG@10 "
                                          "(each held-out criterion ranking its held-out references).")
    best_validation_ndcg: float | None = None
    steps_per_s: float | None = Field(None, description="The rate measured over the steps run so far.")
    eta_s: float | None = Field(None, description="Seconds to the last step at that rate (early stopping may end "
                                "sooner).")
    elapsed_s: float | None = None
    vision_encodes: int | None = Field(None, description="Vision-tower runs of the training, counted (0: it read "
                                       "cached packages); known when the job has finished.")
    version_id: str | None = Field(None, description="The version the job registered (succeeded jobs).")
    metrics: dict[str, Any] | None = Field(None, description="Held-out metrics before and after (the card's).")
    wall_s: float | None = None


class TrainingJobOut(BaseModel):
    id: str
    set_id: str
    model: Literal["reranker", "embedder"] = "reranker"
    state: JobStateName
    steps_done: int
    steps_total: int
    settings: dict[str, Any]
    max_judgment_id: int = Field(description="The data snapshot: the set's judgments with ids up to this one.")
    progress: TrainingProgressOut
    error: str | None = None
    cancel_requested: bool
    created_at: datetime
    started_at: datetime | None = None
    finished_at: datetime | None = None


class VersionOut(BaseModel):
    id: str
    set_id: str
    model: Literal["reranker", "embedder"]
    job_id: str | None
    active: bool
    created_at: datetime
    card: dict[str, Any] = Field(description="What made the version: base model, judgments (data snapshot and the "
                                 "held-out ones), settings, metrics before and after, wall time, vision encodes.")


class VersionList(BaseModel):
    data: list[VersionOut]
    active: str = Field(description="The active reranker version's id, or `base`.")
    active_embedder: str = Field("base", description="The active embedder version's id, or `base`.")


class MetricRow(BaseModel):
    metric: str
    better_when: Literal["higher", "lower"]
    active: float | None
    candidate: float | None
    candidate_is: Literal["better", "worse", "same", "not computable"]


class ComparisonOut(BaseModel):
    active: str = Field(description="The model of the candidate's kind active when compared: a version id or "
                        "`base`.")
    candidate: str
    held_out_judgments: int = Field(description="Judgments neither model trained on, both scored on.")
    metrics: list[MetricRow]
    passed: bool = Field(description="No metric worse (where both have it) and at least one better.")
    vision_encodes: int


class ActivationOut(BaseModel):
    active: str = Field(description="The set's active model of that kind now: a version id or `base`.")
    comparison: ComparisonOut | None = Field(None, description="The side-by-side table that allowed it (null for "
                                             "a rollback).")
    calibration: str = Field(description="What happened to the set's calibration.")
