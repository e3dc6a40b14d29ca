"""Candidate-only searches calibrated the way criteria are: on "same subject" pairs of the set's references,
derived from its criterion judgments.

Two judged references are the same subject when they agree on every criterion both are judged on, and share at
least :data:`MIN_SHARED` of them; they are not when they disagree on any. Each judged reference (at most
:data:`MAX_CANDIDATES`, a seeded sample beyond) is searched as the candidate, exactly as a candidate-only search
runs (the same service, the reference's cached package as the image, so no vision encoder runs for it), and every
other judged reference in its results gives one pair: the hit's score and whether the two are the same subject.
The identical hit is left out: it is the candidate itself, a match by rule, not by score. The pairs go through the
same fit as the criterion cells (:func:`rerank.calibration.fit`, folds by the candidate reference).
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime

from rubricsearch.rerank.calibration import Calibration, fit
from rubricsearch.retrieval.packages import Purpose, Usage
from rubricsearch.retrieval.search import SearchRequest
from rubricsearch.retrieval.search.provenance import SearchProvenance
from rubricsearch.retrieval.search.service import SearchService

SAME_SUBJECT = "the same subject"
MIN_SHARED = 2  # criteria two references must both be judged on before agreeing on all of them says anything
MAX_CANDIDATES = 200


def same_subject(a: Mapping[str, bool], b: Mapping[str, bool]) -> bool | None:
    """Whether two references judged ``a`` and ``b`` (criterion → holds) show the same subject (None: too few
    criteria judged on both to tell)."""
    shared = a.keys() & b.keys()
    if any(a[c] != b[c] for c in shared):
        return False
    return True if len(shared) >= MIN_SHARED else None


def scored_as_fitted(provenance: SearchProvenance) -> bool:
    """Whether a search's scores were formed the way the pairs' were: the scorer's own answer (reranked, or the
    recall order its measured policy keeps), not a search that skipped or lost the reranker."""
    return not provenance.rerank_status.startswith(("skipped", "failed"))


@dataclass(frozen=True)
class Pairs:
    scores: list[float]
    same: list[bool]
    candidates: list[str]  # each pair's candidate reference (the folds' unit)


def score_pairs(search: SearchService, set_id: str, judged: Mapping[str, Mapping[str, bool]], *, usage: Usage,
                seed: int = 0) -> Pairs:
    """Every scorable pair of judged references (sha256 → criterion → holds), as candidate-only searches score it."""
    shas = sorted(judged)
    if len(shas) > MAX_CANDIDATES:
        shas = sorted(random.Random(seed).sample(shas, MAX_CANDIDATES))
    top = min(search.max_top_k, len(judged))
    out = Pairs([], [], [])
    for sha in shas:
        result = search.search(SearchRequest(set_id=set_id, candidate=search.resolve_reference(sha), top_k=top,
                                             top_n=top, known_set=True))
        usage.add("search", Purpose.QUERY, result.provenance.vision_encodes)
        if not scored_as_fitted(result.provenance):
            continue
        for hit in result.hits:
            if hit.identical or hit.sha256 not in judged:
                continue
            label = same_subject(judged[sha], judged[hit.sha256])
            if label is not None:
                out.scores.append(hit.score)
                out.same.append(label)
                out.candidates.append(sha)
    return out


def fit_pairs(pairs: Pairs, *, model_key: str, max_judgment_id: int, fitted_at: datetime) -> Calibration:
    return fit(pairs.scores, pairs.same, pairs.candidates, [SAME_SUBJECT] * len(pairs.same), model_key=model_key,
               max_judgment_id=max_judgment_id, fitted_at=fitted_at)


def judged_by_reference(cells: Sequence[tuple[str, str, bool]]) -> dict[str, dict[str, bool]]:
    """(sha256, criterion, holds) cells as sha256 → criterion → holds."""
    out: dict[str, dict[str, bool]] = {}
    for sha, criterion, holds in cells:
        out.setdefault(sha, {})[criterion] = holds
    return out
