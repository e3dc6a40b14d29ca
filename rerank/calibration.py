"""A set's calibration of the reranker's judgements, fitted on the judgments its team recorded.

The input is one row per judged (reference, criterion) cell: the score search gives that cell (the reranker's
P(yes), or 1 − P(X) for a criterion written as "no X") and whether the criterion holds. Two calibrations are
fitted, Platt scaling on the logit of the score and isotonic regression (pool-adjacent-violators), and the one with
the lower cross-validated log-loss is kept; the folds split *by reference*, so no reference is judged on both sides
of a fold and a criterion learned on one image is never graded on it.

The calibrated probability is then cut by two thresholds chosen on the held-out (out-of-fold) probabilities:
``match`` from the lowest threshold whose results are right at least ``target`` of the time, ``no match`` from the
highest threshold below which they are, and everything between is ``uncertain``; "at least" is read on the lower
95 % confidence bound of that share, so the band widens where few judgments back it.

Two honest refusals keep the raw behaviour or the band wide open:

* too few judgments (``status == "too_few"``: fewer than :data:`MIN_JUDGMENTS`, fewer than :data:`MIN_PER_CLASS`
  of either answer, or fewer references than folds): nothing is fitted, and search gives no verdict at all (the
  raw scores stay what they were; a verdict would claim a precision nothing measured).
* no separation (``status == "no_separation"``: the held-out AUC is not above chance by two standard errors): the
  model cannot tell yes from no on these judgments, so every cell is ``uncertain``.

Everything here is numpy over plain arrays; fitting the scores and persisting the result live elsewhere.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any, Literal

import numpy as np
from numpy.typing import ArrayLike, NDArray

from rubricsearch.rerank.metrics import (
    FloatArray,
    auc,
    auc_standard_error,
    ece,
    fit_logistic,
    log_loss,
    logit,
    lower_bound,
    sigmoid,
)

Method = Literal["raw", "platt", "isotonic"]
Status = Literal["calibrated", "too_few", "no_separation"]
Verdict = Literal["match", "uncertain", "no_match"]
# the score a fit reads: a hit's or cell's score as search shows it, or (candidate-only searches) its recall score
# normalised over the candidate's cohort (app/calibration_pairs.py)
Reads = Literal["score", "cohort_z"]
# "raw" (the scores as they are) competes too: a fit that does not beat them on held-out judgments is not kept
METHODS: tuple[Method, ...] = ("raw", "platt", "isotonic")

MIN_JUDGMENTS = 30
MIN_PER_CLASS = 8
MIN_PER_CRITERION = 4  # of either answer, for a criterion's own measurement to be more than noise
FOLDS = 5
TARGET_PRECISION = 0.9
CONFIDENCE_Z = 1.645  # the thresholds' precision is read on its one-sided 95 % lower bound


# -- the fits ---------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ScoreMap:
    """A fitted map from a raw score to a probability: Platt (``slope``, ``intercept`` on the logit) or isotonic
    (the knots ``x`` → ``y`` of the pool-adjacent-violators fit, linear between them, flat beyond)."""

    method: Method
    slope: float = 1.0
    intercept: float = 0.0
    x: tuple[float, ...] = ()
    y: tuple[float, ...] = ()

    def apply(self, raw: ArrayLike) -> FloatArray:
        if self.method == "raw":
            return np.asarray(raw, dtype=np.float64)
        if self.method == "platt":
            return sigmoid(self.slope * logit(raw) + self.intercept)
        return np.interp(np.asarray(raw, dtype=np.float64), self.x, self.y)


def fit_raw(raw: ArrayLike, labels: ArrayLike) -> ScoreMap:
    return ScoreMap("raw")


def fit_platt(raw: ArrayLike, labels: ArrayLike) -> ScoreMap:
    slope, intercept = fit_logistic(logit(raw), labels)
    return ScoreMap("platt", slope=slope, intercept=intercept)


def fit_isotonic(raw: ArrayLike, labels: ArrayLike) -> ScoreMap:
    """The non-decreasing step fit of the labels on the scores (pool adjacent violators, ties pooled first);
    each block becomes two knots at its lowest and highest score, clipped away from 0 and 1 so a held-out cell
    never costs infinite log-loss."""
    s = np.asarray(raw, dtype=np.float64)
    y = np.asarray(labels, dtype=np.float64)
    values, inverse = np.unique(s, return_inverse=True)
    sums = np.bincount(inverse, weights=y)
    counts = np.bincount(inverse).astype(np.float64)
    # blocks: [mean, weight, lowest score, highest score]
    blocks: list[list[float]] = []
    for v, total, n in zip(values, sums, counts, strict=True):
        blocks.append([total / n, n, v, v])
        while len(blocks) > 1 and blocks[-2][0] >= blocks[-1][0]:
            m2, n2, lo2, _ = blocks.pop(-2)
            m1, n1, _, hi1 = blocks.pop()
            blocks.append([(m1 * n1 + m2 * n2) / (n1 + n2), n1 + n2, lo2, hi1])
    floor = 1.0 / (2.0 * len(s) + 2.0)
    xs: list[float] = []
    ys: list[float] = []
    for mean, _, lo, hi in blocks:
        p = float(min(max(mean, floor), 1.0 - floor))
        xs += [lo, hi] if hi > lo else [lo]
        ys += [p, p] if hi > lo else [p]
    return ScoreMap("isotonic", x=tuple(float(v) for v in xs), y=tuple(ys))


FITS = {"raw": fit_raw, "platt": fit_platt, "isotonic": fit_isotonic}


def thresholds(p: ArrayLike, labels: ArrayLike, target: float = TARGET_PRECISION, z: float = CONFIDENCE_Z
               ) -> tuple[float | None, float | None]:
    """``match_at``: the lowest probability t whose cells at or above t are yes at least ``target`` of the time;
    ``no_match_at``: the highest t whose cells at or below t are no as often. "At least" is read on the lower
    confidence bound of that share (``z``), so a band set on these cells keeps its precision on the next ones.
    None where no t reaches it."""
    q = np.asarray(p, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    order = np.argsort(-q, kind="stable")
    qs, ys = q[order], y[order]
    counts = np.arange(1, len(ys) + 1)
    # precision of "q >= qs[i]": computed at the last index of each tie group
    last = np.r_[qs[1:] != qs[:-1], True]
    ok = last & (lower_bound(np.cumsum(ys), counts, z) >= target)
    match_at = float(qs[ok].min()) if ok.any() else None
    rq, ry = qs[::-1], ys[::-1]
    rlast = np.r_[rq[1:] != rq[:-1], True]
    ok = rlast & (lower_bound(np.cumsum(~ry), counts, z) >= target)
    no_match_at = float(rq[ok].max()) if ok.any() else None
    if match_at is not None and no_match_at is not None and no_match_at >= match_at:
        no_match_at = float(rq[rq < match_at].max()) if (rq < match_at).any() else None
    return match_at, no_match_at


def verdicts(p: ArrayLike, match_at: float | None, no_match_at: float | None) -> list[Verdict]:
    q = np.asarray(p, dtype=np.float64)
    out: list[Verdict] = []
    for v in q:
        if match_at is not None and v >= match_at:
            out.append("match")
        elif no_match_at is not None and v <= no_match_at:
            out.append("no_match")
        else:
            out.append("uncertain")
    return out


@dataclass(frozen=True)
class BandMetrics:
    """How a band of verdicts did against the truth: precision of each verdict (None: it was never given)."""

    judgments: int
    yes: int
    no: int
    auc: float | None
    match_precision: float | None
    no_match_precision: float | None
    share_uncertain: float
    matches: int
    no_matches: int


def band_metrics(raw: ArrayLike, labels: ArrayLike, band: Sequence[Verdict]) -> BandMetrics:
    y = np.asarray(labels, dtype=bool)
    v = np.asarray(band)
    match, no_match = v == "match", v == "no_match"
    value = auc(raw, y)
    return BandMetrics(
        judgments=len(y), yes=int(y.sum()), no=int((~y).sum()), auc=None if math.isnan(value) else round(value, 4),
        match_precision=round(float(y[match].mean()), 4) if match.any() else None,
        no_match_precision=round(float((~y[no_match]).mean()), 4) if no_match.any() else None,
        share_uncertain=round(float((v == "uncertain").mean()), 4) if len(v) else 0.0,
        matches=int(match.sum()), no_matches=int(no_match.sum()))


@dataclass(frozen=True)
class CriterionQuality(BandMetrics):
    criterion: str = ""
    too_few: bool = False


@dataclass(frozen=True)
class HeldOut:
    """The cross-validated (out-of-fold) measurement of the fit: log-loss and ECE before and after, per method
    compared, and the band's precision on the same held-out probabilities (the thresholds were chosen on them)."""

    log_loss_raw: float
    log_loss_calibrated: float
    ece_raw: float
    ece_calibrated: float
    log_loss_by_method: dict[str, float]
    band: BandMetrics


@dataclass(frozen=True)
class Calibration:
    """One fit for one set and reranker (``model_key``), on the set's ``judgments`` with ids up to
    ``max_judgment_id`` (but the ``skipped``)."""

    status: Status
    reason: str
    model_key: str
    judgments: int
    max_judgment_id: int
    fitted_at: datetime
    version: int = 0  # given by the store when it is saved
    skipped: int = 0  # of ``judgments``, those left out of the fit (the caller's reason: nothing to score them by)
    indexed: int | None = None  # of ``judgments``, those of references indexed when fitted (None: not counted)
    target_precision: float = TARGET_PRECISION
    mapping: ScoreMap | None = None
    match_at: float | None = None
    no_match_at: float | None = None
    held_out: HeldOut | None = None
    per_criterion: tuple[CriterionQuality, ...] = field(default_factory=tuple)
    # criteria whose own judgments call for a narrower band: (match_at, no_match_at) on the same probabilities
    criterion_thresholds: dict[str, tuple[float | None, float | None]] = field(default_factory=dict)
    # candidate-only searches: the same kind of fit on "same subject" pairs of references
    candidate: Calibration | None = None
    reads: Reads = "score"  # a fit saved before this field was kept read the shown score

    @property
    def applies(self) -> bool:
        """Whether search gives verdicts from it (too few judgments: the raw behaviour, no verdict)."""
        return self.status != "too_few"

    def probability(self, raw: ArrayLike) -> FloatArray | None:
        return None if self.mapping is None else self.mapping.apply(raw)

    def verdicts(self, raw: ArrayLike) -> list[Verdict] | None:
        """Each raw cell score's verdict (None: too few judgments, no verdict)."""
        if not self.applies:
            return None
        p = self.probability(raw)
        if p is None:
            return ["uncertain"] * len(np.atleast_1d(np.asarray(raw)))
        return verdicts(p, self.match_at, self.no_match_at)

    def cells(self, raw: ArrayLike, criteria: Sequence[str], negated: Sequence[str | None]
              ) -> tuple[FloatArray, list[Verdict]] | None:
        """Each cell's calibrated probability and verdict (None: too few judgments), by its criterion's own band
        where it has one. ``negated[i]``: the positive statement of a criterion written as an absence ("no X":
        "X"; None otherwise): where X has a band of its own and "no X" does not, the cell is judged as X mirrored
        (match where X is no match, probability 1 − P(X)), so "no X" is never surer than X is."""
        if not self.applies or self.mapping is None:
            return None
        r = np.asarray(raw, dtype=np.float64)
        p = self.mapping.apply(r)
        band = verdicts(p, self.match_at, self.no_match_at)
        flip: dict[Verdict, Verdict] = {"match": "no_match", "no_match": "match", "uncertain": "uncertain"}
        for i, (criterion, statement) in enumerate(zip(criteria, negated, strict=True)):
            if criterion.strip() in self.criterion_thresholds:
                m, n = self.criterion_thresholds[criterion.strip()]
                band[i] = verdicts(p[i:i + 1], m, n)[0]
            elif statement is not None and statement in self.criterion_thresholds:
                m, n = self.criterion_thresholds[statement]
                q = self.mapping.apply(1.0 - r[i:i + 1])
                p[i] = 1.0 - q[0]
                band[i] = flip[verdicts(q, m, n)[0]]
        if self.status == "no_separation":
            band = ["uncertain"] * len(band)
        return p, band

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        data["fitted_at"] = self.fitted_at.isoformat()
        data["candidate"] = None if self.candidate is None else self.candidate.to_json()
        return data

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> Calibration:
        mapping = data.get("mapping")
        held = data.get("held_out")
        return cls(
            status=data["status"], reason=data["reason"], model_key=data["model_key"], judgments=data["judgments"],
            max_judgment_id=data["max_judgment_id"], fitted_at=datetime.fromisoformat(data["fitted_at"]),
            version=data.get("version", 0), skipped=data.get("skipped", 0), indexed=data.get("indexed"),
            target_precision=data["target_precision"],
            mapping=None if mapping is None else ScoreMap(mapping["method"], mapping["slope"], mapping["intercept"],
                                                         tuple(mapping["x"]), tuple(mapping["y"])),
            match_at=data["match_at"], no_match_at=data["no_match_at"],
            held_out=None if held is None else HeldOut(**(held | {"band": BandMetrics(**held["band"])})),
            per_criterion=tuple(CriterionQuality(**row) for row in data["per_criterion"]),
            criterion_thresholds={k: (m, n) for k, (m, n) in data.get("criterion_thresholds", {}).items()},
            candidate=None if data.get("candidate") is None else cls.from_json(data["candidate"]),
            reads=data.get("reads", "score"))


# -- fitting ----------------------------------------------------------------------------------------------------
def reference_folds(references: Sequence[str], folds: int = FOLDS, seed: int = 0) -> NDArray[np.int64]:
    """Each cell's fold, every cell of one reference in the same fold (the references shuffled by ``seed``)."""
    unique = sorted(set(references))
    order = np.random.default_rng(seed).permutation(len(unique))
    fold_of = {unique[i]: k % folds for k, i in enumerate(order)}
    return np.array([fold_of[r] for r in references], dtype=np.int64)


def out_of_fold(method: Method, raw: FloatArray, labels: NDArray[np.bool_], fold: NDArray[np.int64]) -> FloatArray:
    """Each cell's probability from the fit on the other folds."""
    out = np.empty_like(raw)
    for k in np.unique(fold):
        test = fold == k
        out[test] = FITS[method](raw[~test], labels[~test]).apply(raw[test])
    return out


def too_few(n: int, yes: int, references: int, folds: int = FOLDS) -> str | None:
    """Why these judgments are too few to fit on (None: enough)."""
    if n < MIN_JUDGMENTS:
        return f"{n} judgments: at least {MIN_JUDGMENTS} are needed"
    if min(yes, n - yes) < MIN_PER_CLASS:
        return f"{yes} yes and {n - yes} no: at least {MIN_PER_CLASS} of each are needed"
    if references < folds:
        return f"{references} judged references: at least {folds} are needed to hold references out"
    return None


def fit(raw: ArrayLike, labels: ArrayLike, references: Sequence[str], criteria: Sequence[str], *, model_key: str,
        max_judgment_id: int, fitted_at: datetime, target: float = TARGET_PRECISION, folds: int = FOLDS,
        seed: int = 0) -> Calibration:
    """The calibration of these judged cells (``raw``: the score search gives each; ``labels``: whether its
    criterion holds), chosen and measured by cross-validation over references."""
    s = np.asarray(raw, dtype=np.float64)
    y = np.asarray(labels, dtype=bool)
    common: dict[str, Any] = {"model_key": model_key, "judgments": len(y), "max_judgment_id": max_judgment_id,
                              "fitted_at": fitted_at, "target_precision": target}
    reason = too_few(len(y), int(y.sum()), len(set(references)), folds)
    if reason is not None:
        return Calibration(status="too_few", reason=reason, **common,
                           per_criterion=_per_criterion(s, y, ["uncertain"] * len(y), criteria))
    fold = reference_folds(references, folds, seed)
    held = {m: out_of_fold(m, s, y, fold) for m in METHODS}
    losses: dict[str, float] = {m: round(log_loss(held[m], y), 4) for m in METHODS}
    method = min(METHODS, key=lambda m: losses[m])
    p = held[method]
    value = auc(s, y)
    separates = value - 2 * auc_standard_error(value, int(y.sum()), int((~y).sum())) > 0.5
    match_at, no_match_at = thresholds(p, y, target) if separates else (None, None)
    own = _own_thresholds(p, y, criteria, match_at, no_match_at, target) if separates else {}
    names = np.asarray(criteria)
    band = list(verdicts(p, match_at, no_match_at))
    for name, (m, n) in own.items():
        at = np.flatnonzero(names == name)
        for i, v in zip(at, verdicts(p[at], m, n), strict=True):
            band[i] = v
    held_out = HeldOut(log_loss_raw=round(log_loss(s, y), 4), log_loss_calibrated=losses[method],
                       ece_raw=round(ece(s, y), 4), ece_calibrated=round(ece(p, y), 4), log_loss_by_method=losses,
                       band=band_metrics(s, y, band))
    status: Status = "calibrated" if separates else "no_separation"
    why = (f"{method} chosen by held-out log-loss over {folds} folds of references" if separates else
           f"the reranker does not separate yes from no on these judgments (AUC {value:.3f}, not above chance by "
           "two standard errors): every cell is uncertain")
    return Calibration(status=status, reason=why, **common, mapping=FITS[method](s, y), match_at=match_at,
                       no_match_at=no_match_at, held_out=held_out, per_criterion=_per_criterion(s, y, band, criteria),
                       criterion_thresholds=own)


def _own_thresholds(p: FloatArray, labels: NDArray[np.bool_], criteria: Sequence[str], match_at: float | None,
                    no_match_at: float | None, target: float) -> dict[str, tuple[float | None, float | None]]:
    """A criterion judged often enough (:data:`MIN_PER_CRITERION` of each answer) whose own held-out cells miss the
    target precision at the pooled thresholds gets a narrower band of its own: its thresholds read on its own
    held-out probabilities (the point precision: too few cells for a confidence bound), never wider than the
    pooled ones. One weak criterion among good ones is otherwise judged at the good ones' precision."""
    names = np.asarray(criteria)
    out: dict[str, tuple[float | None, float | None]] = {}
    for name in sorted(set(criteria)):
        at = names == name
        q, y = p[at], labels[at]
        if min(int(y.sum()), int((~y).sum())) < MIN_PER_CRITERION:
            continue
        m = band_metrics(q, y, verdicts(q, match_at, no_match_at))
        if (m.match_precision or 1.0) >= target and (m.no_match_precision or 1.0) >= target:
            continue
        own_match, own_no = thresholds(q, y, target, z=0.0)
        out[name] = (None if match_at is None or own_match is None else max(match_at, own_match),
                     None if no_match_at is None or own_no is None else min(no_match_at, own_no))
    return out


def _per_criterion(raw: FloatArray, labels: NDArray[np.bool_], band: Sequence[Verdict], criteria: Sequence[str]
                   ) -> tuple[CriterionQuality, ...]:
    names = np.asarray(criteria)
    v = np.asarray(band)
    out = []
    for name in sorted(set(criteria)):
        at = names == name
        m = band_metrics(raw[at], labels[at], list(v[at]))
        out.append(CriterionQuality(**asdict(m), criterion=name, too_few=min(m.yes, m.no) < MIN_PER_CRITERION))
    return tuple(out)
