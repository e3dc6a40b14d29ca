"""Candidate-only searches calibrated the way criteria are: on "same subject" pairs of the set's references,
derived from its criterion judgments.

Two judged references are the same subject when they agree on every criterion both are judged on, and share at
least :data:`MIN_SHARED` of them; they are not when they disagree on any. Each judged reference (at most
:data:`MAX_CANDIDATES`, a seeded sample beyond) is searched as the candidate, exactly as a candidate-only search
runs (the same service, the reference's cached package as the image, so no vision encoder runs for it), and every
other judged reference in its results gives one pair: the hit's score (below) and whether the two are the same
subject. The identical hit is left out: it is the candidate itself, a match by rule, not by score. The pairs go
through the same fit as the criterion cells (:func:`rerank.calibration.fit`, folds by the candidate reference).

The score fitted, and read by a served candidate-only search, is not the shown one: it is the hit's recall score
Z-normalised over the candidate's cohort, z = (s − mean) / std of the set's :data:`COHORT` best recall scores
against that candidate (its identical image left out), put through a sigmoid so the fit reads it as it reads a
probability (Platt on its logit is then logistic regression on z). An upload that is near everything (pixel noise,
for the demo embedder) scores high against every reference, but not high against its own cohort. Within one
candidate z is monotone in s, so the order of its hits is unchanged; across candidates it puts each on its own
scale, which is what one threshold over all of them needs. Both the fit and a served search compute it by
:func:`same_subject_scores` from :attr:`SearchResult.cohort`, which the search service reads the same way for any
top_k and filter.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import datetime

import numpy as np

from rubricsearch.rerank.calibration import Calibration, Reads, fit
from rubricsearch.rerank.metrics import FloatArray, sigmoid
from rubricsearch.retrieval.packages import Purpose, Usage
from rubricsearch.retrieval.search import SearchRequest
from rubricsearch.retrieval.search.service import SearchResult, SearchService

SAME_SUBJECT = "the same subject"
MIN_SHARED = 2  # criteria two references must both be judged on before agreeing on all of them says anything
MAX_CANDIDATES = 200
# The cohort: enough scores for a stable mean and spread, few enough to stay the candidate's neighbourhood rather
# than the whole set. On the demo set (bench/same_subject_scores.py, docs/demo.md) 10 let a blue square's best hit
# stand out of its own cohort above most twin pairs, the whole set (39) put no twin pair first, 20 did neither.
COHORT = 20
# Recall scores closer than this are ties for an embedder; a tighter cohort would blow float noise up into z.
STD_FLOOR = 1e-3
READS: Reads = "cohort_z"


def same_subject(a: Mapping[str, bool], b: Mapping[str, bool]) -> bool | None:
    """Whether two references judged ``a`` and ``b`` (criterion → holds) show the same subject (None: too few
    criteria judged on both to tell)."""
    shared = a.keys() & b.keys()
    if any(a[c] != b[c] for c in shared):
        return False
    return True if len(shared) >= MIN_SHARED else None


def cohort_z(scores: Sequence[float], cohort: Sequence[float]) -> FloatArray:
    """Each recall score less the cohort's mean, over its standard deviation (at least :data:`STD_FLOOR`)."""
    s = np.asarray(scores, dtype=np.float64)
    if not len(cohort):  # no other reference: nothing to normalise against (no hit but the identical one either)
        return np.zeros_like(s)
    c = np.asarray(cohort, dtype=np.float64)
    return (s - c.mean()) / max(float(c.std()), STD_FLOOR)


def same_subject_scores(result: SearchResult) -> list[float]:
    """Each hit's score as the same-subject fit reads it: sigmoid of its recall score's z over the search's cohort
    (a search of a candidate alone that asked for :data:`COHORT`)."""
    assert result.cohort is not None, "a candidate-only search that asked for its cohort"
    return [float(x) for x in sigmoid(cohort_z([h.ann_score for h in result.hits], result.cohort))]


@dataclass(frozen=True)
class Pairs:
    scores: list[float]
    same: list[bool]
    candidates: list[str]  # each pair's candidate reference (the folds' unit)


def score_pairs(search: SearchService, set_id: str, judged: Mapping[str, Mapping[str, bool]], *, usage: Usage,
                seed: int = 0) -> Pairs:
    """Every scorable pair of judged references (sha256 → criterion → holds), scored as a candidate-only search's
    verdicts read its hits (:func:`same_subject_scores`)."""
    shas = sorted(judged)
    if len(shas) > MAX_CANDIDATES:
        shas = sorted(random.Random(seed).sample(shas, MAX_CANDIDATES))
    top = min(search.max_top_k, len(judged))
    out = Pairs([], [], [])
    for sha in shas:
        # the recall scores are what is fitted: the reranker's pass would change nothing here
        result = search.search(SearchRequest(set_id=set_id, candidate=search.resolve_reference(sha), top_k=top,
                                             top_n=top, rerank=False, known_set=True, cohort=COHORT))
        usage.add("search", Purpose.QUERY, result.provenance.vision_encodes)
        for hit, score in zip(result.hits, same_subject_scores(result), strict=True):
            if hit.identical or hit.sha256 not in judged:
                continue
            label = same_subject(judged[sha], judged[hit.sha256])
            if label is not None:
                out.scores.append(score)
                out.same.append(label)
                out.candidates.append(sha)
    return out


def fit_pairs(pairs: Pairs, *, model_key: str, max_judgment_id: int, fitted_at: datetime) -> Calibration:
    return replace(fit(pairs.scores, pairs.same, pairs.candidates, [SAME_SUBJECT] * len(pairs.same),
                       model_key=model_key, max_judgment_id=max_judgment_id, fitted_at=fitted_at), reads=READS)


def judged_by_reference(cells: Sequence[tuple[str, str, bool]]) -> dict[str, dict[str, bool]]:
    """(sha256, criterion, holds) cells as sha256 → criterion → holds."""
    out: dict[str, dict[str, bool]] = {}
    for sha, criterion, holds in cells:
        out.setdefault(sha, {})[criterion] = holds
    return out
