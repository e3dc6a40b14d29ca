"""The set calibration measured on the demo truth: judgments derived from the faces' true attributes, half the
faces (by reference) fitted on, the other half judged by the fit.

Every attribute value is a statement ("green eyes", "a fox", "no forehead stripes", …) judged on every face: "yes"
where the face has that value, "no" where it has another, as a derivation from a facet schema gives them. Each
(face, statement) cell is scored by :func:`app.calibration.score_cells`, the path the product's refit takes, from
the faces' cached packages: the reranker's raw P(yes) (1 − P(X) for "no X"), as search gives it. The fit
(:func:`rerank.calibration.fit`) sees only the fitting half; the held-out half gets its verdicts and probabilities
from it, and those are graded against the truth: precision of ``match`` and of ``no match``, the share
``uncertain``, and log-loss and ECE of the calibrated against the raw scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import UTC, datetime

import numpy as np

from rubricsearch.app.calibration import model_key, score_cells
from rubricsearch.app.demo.search_eval import SearchBench, single_criterion_queries
from rubricsearch.rerank.calibration import BandMetrics, band_metrics, fit
from rubricsearch.rerank.metrics import ece, log_loss
from rubricsearch.rerank.rubric import RubricReranker
from rubricsearch.retrieval.packages import Usage

SPLIT_SEED = 47


@dataclass(frozen=True)
class JudgedCells:
    """Every (face, statement) cell of a bench: its reference, statement, raw score and truth."""

    model_key: str
    references: list[str]
    criteria: list[str]
    raw: np.ndarray
    truth: np.ndarray
    vision_encodes: int
    skipped: int  # cells search gives no score (a kind of query the reranker's measured policy keeps in recall order)


@dataclass(frozen=True)
class HeldOutResult:
    """The fit on one half of the faces, graded on the other half."""

    model_key: str
    status: str
    reason: str
    method: str | None
    fitted_on: int
    held_out: int
    band: BandMetrics  # the held-out half's verdicts against the truth
    log_loss_raw: float
    log_loss_calibrated: float | None
    ece_raw: float
    ece_calibrated: float | None
    vision_encodes: int
    skipped: int


def judged_cells(bench: SearchBench) -> JudgedCells:
    """Score every statement on every face of the bench as the product's refit does."""
    scorer = bench.service.scorer
    assert isinstance(scorer, RubricReranker), "the bench has no reranker"
    statements = [q.criteria[0] for q in single_criterion_queries()]
    cells = [(img.sha256, c.text) for img in bench.images for c in statements]
    truth = np.array([c.holds(face) for face in bench.docs for c in statements], dtype=bool)
    usage = Usage()
    scores = score_cells(scorer, bench.service.resolve_reference, cells, usage=usage)
    kept = np.array([s is not None for s in scores])
    raw = np.array([s for s in scores if s is not None], dtype=np.float64)
    return JudgedCells(model_key(scorer), [sha for (sha, _), k in zip(cells, kept, strict=True) if k],
                       [c for (_, c), k in zip(cells, kept, strict=True) if k], raw, truth[kept], usage.total(),
                       int((~kept).sum()))


def held_out(cells: JudgedCells, *, seed: int = SPLIT_SEED, shuffle_fit_labels: bool = False) -> HeldOutResult:
    """Fit on a random half of the references, grade the other half (``shuffle_fit_labels``: a broken fit that
    learns from the fitting half's answers shuffled, what the test's floors must catch)."""
    unique = sorted(set(cells.references))
    rng = np.random.default_rng(seed)
    fitting = set(rng.permutation(unique)[: len(unique) // 2].tolist())
    on = np.array([r in fitting for r in cells.references])
    labels = cells.truth[on]
    if shuffle_fit_labels:
        labels = rng.permutation(labels)
    refs = [r for r, f in zip(cells.references, on, strict=True) if f]
    crits = [c for c, f in zip(cells.criteria, on, strict=True) if f]
    calibration = fit(cells.raw[on], labels, refs, crits, model_key=cells.model_key, max_judgment_id=int(on.sum()),
                      fitted_at=datetime.now(UTC))
    raw, truth = cells.raw[~on], cells.truth[~on]
    band = calibration.verdicts(raw) or ["uncertain"] * len(raw)
    p = calibration.probability(raw)
    return HeldOutResult(
        model_key=cells.model_key, status=calibration.status, reason=calibration.reason,
        method=None if calibration.mapping is None else calibration.mapping.method, fitted_on=int(on.sum()),
        held_out=int((~on).sum()), band=band_metrics(raw, truth, band), log_loss_raw=round(log_loss(raw, truth), 4),
        log_loss_calibrated=None if p is None else round(log_loss(p, truth), 4), ece_raw=round(ece(raw, truth), 4),
        ece_calibrated=None if p is None else round(ece(p, truth), 4), vision_encodes=cells.vision_encodes,
        skipped=cells.skipped)


SPLITS = tuple(range(SPLIT_SEED - 7, SPLIT_SEED + 3))  # ten halvings of the faces


@dataclass(frozen=True)
class OverSplits:
    """The held-out grading over several halvings of the faces: a single halving of 120 faces is noisy."""

    splits: int
    match_precision: float  # mean (a halving without any match counts 0)
    no_match_precision: float
    worst_match_precision: float
    worst_no_match_precision: float
    worst_share_uncertain: float
    log_loss_raw: float  # mean
    log_loss_calibrated: float  # mean (a halving too few to fit counts its raw log-loss)


def over_splits(cells: JudgedCells, *, seeds: tuple[int, ...] = SPLITS, shuffle_fit_labels: bool = False
                ) -> OverSplits:
    runs = [held_out(cells, seed=s, shuffle_fit_labels=shuffle_fit_labels) for s in seeds]
    match = [r.band.match_precision or 0.0 for r in runs]
    no_match = [r.band.no_match_precision or 0.0 for r in runs]
    return OverSplits(
        splits=len(runs), match_precision=round(float(np.mean(match)), 4),
        no_match_precision=round(float(np.mean(no_match)), 4), worst_match_precision=min(match),
        worst_no_match_precision=min(no_match), worst_share_uncertain=max(r.band.share_uncertain for r in runs),
        log_loss_raw=round(float(np.mean([r.log_loss_raw for r in runs])), 4),
        log_loss_calibrated=round(float(np.mean([r.log_loss_calibrated if r.log_loss_calibrated is not None
                                                 else r.log_loss_raw for r in runs])), 4))
