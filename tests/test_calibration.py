"""The set calibration's numerics (``rerank/calibration.py``) on synthetic judged cells whose truth is known."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import numpy as np
import pytest

from rubricsearch.app.demo.search_eval import auc as pairwise_auc
from rubricsearch.rerank.calibration import (
    MIN_JUDGMENTS,
    Calibration,
    fit,
    fit_isotonic,
    fit_platt,
    reference_folds,
    thresholds,
)
from rubricsearch.rerank.metrics import auc, ece, log_loss, sigmoid

NOW = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)


def cells(n: int, *, seed: int, slope: float = 3.0, intercept: float = -0.5, per_reference: int = 4
          ) -> tuple[np.ndarray, np.ndarray, list[str], list[str]]:
    """Raw scores whose truth follows sigmoid(slope · logit(raw) + intercept): a miscalibrated but separating
    reranker, ``per_reference`` criteria judged on each reference."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.0, 1.2, n)
    raw = sigmoid(z)
    labels = rng.random(n) < sigmoid(slope * z + intercept)
    references = [f"ref{i // per_reference}" for i in range(n)]
    criteria = [f"criterion {i % per_reference}" for i in range(n)]
    return raw, labels, references, criteria


def test_platt_recovers_the_slope_and_intercept_it_was_drawn_with() -> None:
    raw, labels, _, _ = cells(20_000, seed=1)
    m = fit_platt(raw, labels)
    assert m.slope == pytest.approx(3.0, abs=0.15) and m.intercept == pytest.approx(-0.5, abs=0.1), m


def test_isotonic_is_the_pool_adjacent_violators_fit() -> None:
    m = fit_isotonic([0.1, 0.2, 0.3, 0.4, 0.5, 0.6], [0, 1, 0, 0, 1, 1])
    # (0.1) 0, then 0.2-0.4 pooled to 1/3, then 0.5-0.6 at 1 (clipped to 1 - 1/14 away from certainty)
    assert m.apply([0.1, 0.25, 0.4, 0.55]).tolist() == pytest.approx([1 / 14, 1 / 3, 1 / 3, 13 / 14])
    assert np.all(np.diff(m.apply(np.linspace(0, 1, 101))) >= 0)


def test_auc_counts_ties_as_half_like_the_pairwise_definition() -> None:
    rng = np.random.default_rng(3)
    s = rng.integers(0, 5, 200) / 4.0
    y = rng.random(200) < 0.4
    assert auc(s, y) == pytest.approx(pairwise_auc(list(s), list(y)))


def test_ece_is_small_for_calibrated_and_large_for_miscalibrated_probabilities() -> None:
    rng = np.random.default_rng(4)
    p = rng.random(50_000)
    y = rng.random(50_000) < p
    assert ece(p, y) < 0.01
    assert ece(np.sqrt(p), y) > 0.1


def test_folds_never_split_a_reference() -> None:
    references = [f"r{i % 37}" for i in range(500)]
    fold = reference_folds(references)
    for r in set(references):
        assert len({int(f) for f, x in zip(fold, references, strict=True) if x == r}) == 1
    assert len(set(fold.tolist())) == 5


def test_the_band_holds_its_precision_on_fresh_judgments() -> None:
    raw, labels, refs, crits = cells(2_000, seed=5)
    cal = fit(raw, labels, refs, crits, model_key="m", max_judgment_id=2_000, fitted_at=NOW)
    assert cal.status == "calibrated", cal.reason
    assert cal.held_out is not None and cal.held_out.log_loss_calibrated < cal.held_out.log_loss_raw
    assert cal.held_out.ece_calibrated < cal.held_out.ece_raw
    fresh_raw, fresh_labels, _, _ = cells(20_000, seed=6)
    band = np.asarray(cal.verdicts(fresh_raw))
    assert fresh_labels[band == "match"].mean() >= 0.88
    assert (~fresh_labels[band == "no_match"]).mean() >= 0.88
    assert 0.0 < (band == "uncertain").mean() < 0.6
    assert {row.criterion for row in cal.per_criterion} == {f"criterion {i}" for i in range(4)}


def test_shuffled_labels_separate_nothing_and_leave_every_cell_uncertain() -> None:
    raw, labels, refs, crits = cells(2_000, seed=7)
    shuffled = np.random.default_rng(8).permutation(labels)
    cal = fit(raw, shuffled, refs, crits, model_key="m", max_judgment_id=1, fitted_at=NOW)
    assert cal.status == "no_separation", cal.reason
    assert set(cal.verdicts(raw) or []) == {"uncertain"}


def test_too_few_judgments_keep_the_raw_behaviour() -> None:
    raw, labels, refs, crits = cells(MIN_JUDGMENTS - 1, seed=9)
    cal = fit(raw, labels, refs, crits, model_key="m", max_judgment_id=1, fitted_at=NOW)
    assert cal.status == "too_few" and cal.verdicts(raw) is None and cal.probability(raw) is None
    assert str(MIN_JUDGMENTS) in cal.reason
    one_class = fit(raw[:0].tolist() + [0.9] * 40, [True] * 40, [f"r{i}" for i in range(40)], ["c"] * 40,
                    model_key="m", max_judgment_id=1, fitted_at=NOW)
    assert one_class.status == "too_few" and "0 no" in one_class.reason


def test_thresholds_are_the_lowest_and_highest_that_reach_the_target() -> None:
    p = np.array([0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95])
    y = np.array([0, 0, 0, 1, 0, 1, 0, 1, 1, 1], dtype=bool)
    match_at, no_match_at = thresholds(p, y, 0.9, z=0.0)
    assert match_at == 0.8 and no_match_at == 0.3
    assert thresholds(p, y, 0.9) == (None, None)  # 3 of 3 is not enough evidence of 90 %
    # at 0.7: 5 of 7 at or above 0.4 are yes; 5 of 7 at or below 0.7 are no, which overlaps the match band,
    # so no match ends below it
    assert thresholds(p, y, 0.7, z=0.0) == (0.4, 0.3)


def test_a_calibration_survives_its_json() -> None:
    raw, labels, refs, crits = cells(600, seed=10)
    for data in (raw, sigmoid(np.random.default_rng(11).normal(0, 3, 600))):
        cal = fit(data, labels, refs, crits, model_key="m@1", max_judgment_id=600, fitted_at=NOW)
        back = Calibration.from_json(json.loads(json.dumps(cal.to_json())))
        assert back == cal
        assert back.verdicts(raw) == cal.verdicts(raw)


def test_log_loss_is_finite_at_certainty() -> None:
    assert np.isfinite(log_loss([0.0, 1.0], [True, False]))


def test_a_criterion_with_few_judgments_of_its_own_is_flagged() -> None:
    raw, labels, refs, crits = cells(400, seed=12)
    crits = [*crits[:-3], "rare", "rare", "rare"]
    cal = fit(raw, labels, refs, crits, model_key="m", max_judgment_id=400, fitted_at=NOW)
    flagged = {row.criterion: row.too_few for row in cal.per_criterion}
    assert flagged["rare"] and not any(v for k, v in flagged.items() if k != "rare")


@pytest.mark.parametrize("seed", [3, 4, 5])
def test_a_fit_that_does_not_beat_the_raw_scores_is_not_kept(seed: int) -> None:
    """Scores that are already calibrated (each truth drawn with the score's own probability), on few references:
    no fit beats them out of fold, so the raw scores are kept and the held-out log-loss is never worse than raw;
    on miscalibrated scores a fit wins."""
    rng = np.random.default_rng(seed)
    raw = rng.uniform(0.02, 0.98, 60)
    labels = rng.random(60) < raw
    references = [f"ref{i // 4}" for i in range(60)]
    criteria = [f"criterion {i % 4}" for i in range(60)]
    c = fit(raw, labels, references, criteria, model_key="m", max_judgment_id=60, fitted_at=NOW)
    assert c.held_out is not None and c.mapping is not None
    assert c.held_out.log_loss_calibrated <= c.held_out.log_loss_raw, c.held_out
    assert c.held_out.log_loss_calibrated == min(c.held_out.log_loss_by_method.values())
    if c.mapping.method == "raw":
        assert np.array_equal(c.mapping.apply(raw), raw)
    skewed = fit(*cells(400, seed=seed), model_key="m", max_judgment_id=400, fitted_at=NOW)
    assert skewed.mapping is not None and skewed.mapping.method != "raw", skewed.held_out


def test_a_weak_criterion_gets_a_narrower_band_and_its_absence_mirrors_it() -> None:
    """Three criteria the scores separate well and one they barely do ("weak"): the pooled band is set by the
    good ones, so the weak one gets its own (never wider), and "no weak" is judged as "weak" mirrored; a
    calibration without the weak criterion's band (the pooled one) lets far more of its cells through."""
    rng = np.random.default_rng(11)
    raw, labels, references, criteria = [], [], [], []
    for ref in range(150):
        for c, noise in (("good 1", 0.05), ("good 2", 0.05), ("good 3", 0.05), ("weak", 0.45)):
            holds = bool(rng.random() < 0.5)
            raw.append(float(np.clip((0.85 if holds else 0.15) + rng.normal(0, noise), 0.01, 0.99)))
            labels.append(holds)
            references.append(f"ref{ref}")
            criteria.append(c)
    fitted = fit(raw, labels, references, criteria, model_key="m", max_judgment_id=1, fitted_at=NOW)
    assert set(fitted.criterion_thresholds) == {"weak"}, fitted.criterion_thresholds
    m, n = fitted.criterion_thresholds["weak"]
    assert fitted.match_at is not None and fitted.no_match_at is not None
    assert (m is None or m >= fitted.match_at) and (n is None or n <= fitted.no_match_at)
    weak = [i for i, c in enumerate(criteria) if c == "weak"]
    r = np.asarray(raw)[weak]
    own = fitted.cells(r, ["weak"] * len(weak), [None] * len(weak))
    pooled = fitted.verdicts(r)
    assert own is not None and pooled is not None
    assert own[1].count("uncertain") > pooled.count("uncertain")
    mirrored = fitted.cells(1.0 - r, ["no weak"] * len(weak), ["weak"] * len(weak))
    assert mirrored is not None
    flip = {"match": "no_match", "no_match": "match", "uncertain": "uncertain"}
    assert mirrored[1] == [flip[v] for v in own[1]]
    assert mirrored[0] == pytest.approx(1.0 - own[0])
    assert Calibration.from_json(json.loads(json.dumps(fitted.to_json()))) == fitted
