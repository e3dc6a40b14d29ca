"""A set's calibration of the reranker's judgements, its quality report, and what search says about both."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, Field

from rubricsearch.app.calibration_pairs import COHORT
from rubricsearch.rerank.calibration import Reads

VerdictOut = Literal["match", "uncertain", "no_match"]


class BandOut(BaseModel):
    """How the band did on held-out judgments: every judgment was scored by a fit that did not see its reference."""

    judgments: int
    yes: int
    no: int
    auc: float | None = Field(description="How well the reranker's raw scores separate yes from no (0.5: not at "
                              "all; null: one answer only).")
    match_precision: float | None = Field(description="Share of `match` verdicts whose criterion holds (null: "
                                          "none given).")
    no_match_precision: float | None = Field(description="Share of `no_match` verdicts whose criterion does not "
                                             "hold (null: none given).")
    share_uncertain: float
    matches: int
    no_matches: int


class CriterionOut(BandOut):
    criterion: str
    too_few: bool = Field(description="Fewer than 4 yes or 4 no judgments of this criterion: its own numbers say "
                          "little (the set's fit still uses them).")


class HeldOutOut(BaseModel):
    log_loss_raw: float = Field(description="Held-out log-loss of the raw scores as probabilities.")
    log_loss_calibrated: float
    ece_raw: float = Field(description="Expected calibration error (10 bins) of the raw scores.")
    ece_calibrated: float
    log_loss_by_method: dict[str, float] = Field(description="Held-out log-loss of each method compared.")
    band: BandOut


class ScoreMapOut(BaseModel):
    method: Literal["raw", "platt", "isotonic"]
    slope: float = Field(description="Platt: sigmoid(slope · logit(score) + intercept).")
    intercept: float
    x: list[float] = Field(description="Isotonic: the knots' scores (linear between them, flat beyond).")
    y: list[float]


class StaleOut(BaseModel):
    stale: bool = Field(description="Judgments changed since the fit (a refit follows them in the background; "
                        "`refit_pending` says whether one is scheduled).")
    new: int = Field(description="Judgments recorded since the fit.")
    gone: int = Field(description="Judgments it was fitted on that were deleted or replaced since.")
    refit_pending: bool = Field(description="A refit of the set is scheduled or under way in the background; "
                                "searches use this fit until the next one is saved.")


Status = Literal["calibrated", "too_few", "no_separation"]
STATUS_DESCRIPTION = ("`calibrated`; `too_few` (nothing fitted: searches give no verdict); `no_separation` (the "
                      "reranker does not tell yes from no here: every cell is `uncertain`).")


READS_DESCRIPTION = ("The score the fit reads. `score`: each hit's or criterion cell's score as shown. `cohort_z` "
                     f"(`same_subject`): the hit's recall score less the mean of the set's {COHORT} best recall scores "
                     "against the candidate (its identical image left out), over their standard deviation, through a "
                     "sigmoid; it keeps the order of one candidate's hits and puts every candidate on its own scale.")


class SameSubjectOut(BaseModel):
    """The fit for candidate-only searches: the score `reads` names on pairs of the set's judged references, "same
    subject" when the two agree on every criterion both are judged on (at least 2), each reference searched as the
    candidate the way such a search runs."""

    status: Status = Field(description=STATUS_DESCRIPTION)
    reason: str
    judgments: int = Field(description="Pairs fitted on.")
    reads: Reads = Field(description=READS_DESCRIPTION)
    mapping: ScoreMapOut | None
    match_at: float | None
    no_match_at: float | None
    held_out: HeldOutOut | None = Field(description="Cross-validated over folds of candidate references.")


class CalibrationOut(BaseModel):
    """One fit of a set's calibration; `GET /v1/sets/{set}/judgments?until_id=<max_judgment_id>` lists exactly the
    judgments it saw (while `stale.gone` is 0), the `skipped` among them."""

    version: int
    status: Status = Field(description=STATUS_DESCRIPTION)
    reason: str
    model_key: str = Field(description="The reranker it was fitted for (`id@revision`); another serving reranker "
                           "gets no verdicts from it.")
    fitted_at: datetime
    judgments: int = Field(description="The set's judgments when it was fitted (ids up to `max_judgment_id`).")
    skipped: int = Field(description="Of those, left out of the fit: of references not indexed yet, or of "
                         "criteria whose kind of search the reranker's measured policy serves in recall order.")
    max_judgment_id: int
    target_precision: float = Field(description="The precision the `match` and `no_match` thresholds were set for.")
    mapping: ScoreMapOut | None = Field(description="The fitted map from a cell's score to a probability.")
    match_at: float | None = Field(description="Calibrated probability at or above which a cell is `match` (null: "
                                   "none reaches the target).")
    no_match_at: float | None = Field(description="Calibrated probability at or below which a cell is `no_match`.")
    held_out: HeldOutOut | None = Field(description="Cross-validated over folds of references (null: not fitted).")
    per_criterion: list[CriterionOut]
    candidate: SameSubjectOut | None = Field(description="Candidate-only searches' fit (null: fitted before "
                                             "they were calibrated).")
    stale: StaleOut


class RefitOut(CalibrationOut):
    vision_encodes: int = Field(description="Vision-encoder runs the refit caused (0: every judged reference "
                                "was scored from its cached package).")


class SameSubjectQualityOut(BaseModel):
    """Candidate-only searches (a candidate image, no criteria) measured on the set's same-subject pairs."""

    status: Status = Field(description=STATUS_DESCRIPTION)
    reason: str = Field(description="Why it was or was not fitted (too few pairs: how many, and how many needed).")
    pairs: int = Field(description="Pairs of judged references scored as a candidate-only search scores them.")
    same: int = Field(description="Of them, pairs of the same subject (agreeing on every criterion both are "
                      "judged on, at least 2).")
    different: int = Field(description="Pairs that disagree on a criterion.")
    held_out: BandOut | None = Field(description="The band on held-out pairs (folds of candidate references): "
                                     "AUC, precision of `match` and `no_match`, share `uncertain` (null: too few "
                                     "pairs to fit).")


class QualityOut(BaseModel):
    """"Does it work on my images?": how well the serving reranker separates the set's yes from no judgments."""

    set_id: str
    status: Status | Literal["not_fitted"] = Field(description=f"{STATUS_DESCRIPTION} `not_fitted`: no "
                                                   "calibration yet (POST .../calibration).")
    reason: str
    calibration_version: int | None
    model_key: str | None
    serving_model_key: str | None = Field(description="The reranker serving now (null: none loaded).")
    judgments: int
    overall: BandOut | None
    per_criterion: list[CriterionOut]
    same_subject: SameSubjectQualityOut | None = Field(description="Candidate-only searches' measurement (null: "
                                                       "not fitted, or fitted before they were calibrated).")
    stale: StaleOut | None


class CellOut(BaseModel):
    probability: float = Field(description="The calibrated probability that the criterion holds.")
    verdict: VerdictOut


class CalibrationUse(BaseModel):
    """The set's calibration as this search used it (provenance)."""

    version: int
    status: Status
    applied: bool = Field(description="Whether this search's hits carry verdicts from it.")
    reason: str | None = Field(description="Why not, when it was not applied.")
    fitted_to: Literal["criteria", "same_subject"] = Field(
        description="`criteria`: the fit on the judged (reference, criterion) cells; `same_subject` (a search with "
        "a candidate and no criteria): the fit on pairs of references derived from those judgments (same subject: "
        "they agree on every criterion both are judged on), of the score `reads` names. Status, method, thresholds "
        "and held-out numbers are that fit's.")
    model_key: str
    method: str | None
    fitted_at: datetime
    judgments: int
    max_judgment_id: int
    reads: Reads = Field(description=READS_DESCRIPTION)
    match_at: float | None
    no_match_at: float | None
    held_out: HeldOutOut | None
    stale: StaleOut
