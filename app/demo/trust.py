"""Can a user trust the rubric scores? The promises of issue 34, measured on the held-out faces.

Everything runs through :class:`~app.demo.search_eval.SearchBench` (the product's search service over the
demo models), with ``top_k = top_n = shortlist`` so the whole shortlist is ranked:

- two-criterion rubrics: the share of criteria met by the top 5, for the product's order and, from the same
  hits, for the recall order and for other ways of forming the overall score from the breakdown (the mean,
  the minimum), which is how the aggregate was chosen;
- single criteria: precision@5 (share of the top 5 that meet it) and the AUC of the breakdown score against
  the truth over the shortlist;
- negatives ("no X", "not a fox"): the share of the top 5 without X;
- the match threshold: the identical image as candidate ranks first above it; a statement no face meets
  has no hit above it; every single criterion that some reference meets has at least one.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np

from rubricsearch.app.demo.evaluation import QUERY_SEED
from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion
from rubricsearch.app.demo.rubrics import Query, random_criteria
from rubricsearch.app.demo.search_eval import SET_ID, SearchBench, auc, single_criterion_queries
from rubricsearch.rerank.rubric import FLOOR, aggregate
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.metrics import ndcg_at
from rubricsearch.retrieval.search import SearchRequest
from rubricsearch.retrieval.search.service import SearchHit

THRESHOLD = 0.5  # the compare page's default match threshold
ABSENT = ("a red sports car", "a helicopter", "striped socks", "a bowl of soup")  # never used in training
ORDERS: dict[str, Callable[[SearchHit], float]] = {
    "product": lambda h: h.score,
    "recall": lambda h: h.ann_score,
    "mean": lambda h: float(np.mean(list(h.criteria.values()))),
    "min": lambda h: min(h.criteria.values()),
    "geometric mean": lambda h: aggregate(list(h.criteria.values())),
}


def two_criterion_rubrics(count: int = 16, *, seed: int = QUERY_SEED + 2) -> list[Query]:
    """Rubrics of two presences about distinct attributes (what the issue's 0.43 / 0.62 came from)."""
    rng = random.Random(seed)
    return [Query("criteria", random_criteria(rng, 2)) for _ in range(count)]


def negative_criteria() -> list[Criterion]:
    """Every value's absence, as users write it ("no ginger fur", "not a fox", "no forehead stripes")."""
    seen: dict[str, Criterion] = {}
    for a in ATTRIBUTES:
        for v in VALUES[a]:
            c = Criterion(a, v, True)
            seen.setdefault(c.text, c)
    return [c for c in seen.values() if c.negative]


def judged_criteria() -> list[Criterion]:
    """Every statement of one attribute a face is judged on: each value's presence, then each value's absence."""
    return [q.criteria[0] for q in single_criterion_queries()] + negative_criteria()


@dataclass
class Trust:
    """The measured promises (see the module docstring); ``misses`` lists what failed the threshold."""

    criteria_met_top5: dict[str, float]  # by order: product, recall, mean, min, geometric mean
    single_precision5: float
    single_auc: float
    negative_without_top5: float
    identical_candidate_matches: float  # share of identical-image searches whose top hit is it, above threshold
    identical_others_above: float  # mean number of other references above the threshold in those searches
    absent_hits_above: int  # hits above the threshold over all statements no face meets
    criteria_without_match: list[str] = field(default_factory=list)
    rubrics: int = 0
    negative_by_criterion: dict[str, float] = field(default_factory=dict)  # "no X": share of the top 5 without X
    absent_best: dict[str, float] = field(default_factory=dict)  # each absent statement's best hit score
    best_match: dict[str, float] = field(default_factory=dict)  # each single criterion's best hit score


def served(bench: SearchBench, texts: Sequence[str], shortlist: int,
            candidate: ImageLike | None = None) -> list[SearchHit]:
    """One search as the product answers it (reranked unless the reranker's policy steps aside for its kind)."""
    req = SearchRequest(set_id=SET_ID, criteria=list(texts), candidate=candidate, top_k=shortlist,
                        top_n=shortlist, rerank=True)
    result = bench.service.search(req)
    policy = result.provenance.rerank_policy
    assert result.provenance.reranked or (policy is not None and not policy.rerank), result.provenance
    return result.hits


def _met(bench: SearchBench, q: Query, hits: list[SearchHit]) -> float:
    faces = [bench.docs[bench.position[h.sha256]] for h in hits[:5]]
    return sum(c.holds(f) for f in faces for c in q.criteria) / (len(q.criteria) * len(faces))


def single_criteria(bench: SearchBench, shortlist: int = 40, best: dict[str, float] | None = None
                    ) -> tuple[list[float], list[float], list[str]]:
    """Every attribute value as a criterion alone: precision@5, breakdown AUC, and the criteria that some
    reference meets but no hit scores at or above the threshold (``best``: each one's best hit score)."""
    precision, aucs, missing = [], [], []
    for c in (q.criteria[0] for q in single_criterion_queries()):
        hits = served(bench, [c.text], shortlist)
        labels = [c.holds(bench.docs[bench.position[h.sha256]]) for h in hits]
        precision.append(float(np.mean(labels[:5])))
        value = auc([h.criteria.get(c.text, h.score) for h in hits], labels)
        if not math.isnan(value):
            aucs.append(value)
        if any(c.holds(f) for f in bench.docs):
            top = max((h.score for h in hits), default=0.0)
            if best is not None:
                best[c.text] = top
            if not top >= THRESHOLD:
                missing.append(c.text)
    return precision, aucs, missing


def measure_trust(bench: SearchBench, *, rubrics: int = 16, shortlist: int = 40, identical: int = 6) -> Trust:
    met: dict[str, list[float]] = {name: [] for name in ORDERS}
    for q in two_criterion_rubrics(rubrics):
        hits = served(bench, q.texts, shortlist)
        for name, key in ORDERS.items():
            met[name].append(_met(bench, q, sorted(hits, key=key, reverse=True)))
    best: dict[str, float] = {}
    precision, aucs, missing = single_criteria(bench, shortlist, best)
    without: dict[str, float] = {}
    for c in negative_criteria():
        hits = served(bench, [c.text], shortlist)
        without[c.text] = float(np.mean([c.holds(bench.docs[bench.position[h.sha256]]) for h in hits[:5]]))
    found, others = 0, 0
    for i in range(0, len(bench.images), max(1, len(bench.images) // identical))[:identical]:
        hits = served(bench, [], shortlist, candidate=bench.images[i])
        found += bool(hits) and hits[0].sha256 == bench.images[i].sha256 and hits[0].score >= THRESHOLD
        others += sum(h.score >= THRESHOLD for h in hits if h.sha256 != bench.images[i].sha256)
    absent = {text: [h.score for h in served(bench, [text], shortlist)] for text in ABSENT}
    above = sum(s >= THRESHOLD for scores in absent.values() for s in scores)
    return Trust({k: float(np.mean(v)) for k, v in met.items()}, float(np.mean(precision)), float(np.mean(aucs)),
                 float(np.mean(list(without.values()))), found / identical, others / identical, above, missing,
                 rubrics, without, {t: max(s, default=0.0) for t, s in absent.items()}, best)


def fused(hits: list[SearchHit], weight: float) -> list[SearchHit]:
    """The hits ordered by score^(1-w) · recall^w, recall being the vector score rescaled to [0, 1] over the
    shortlist: how a fusion of recall and reranking would order them (measured, to decide whether one is due)."""
    lo, hi = min(h.ann_score for h in hits), max(h.ann_score for h in hits)

    def key(h: SearchHit) -> float:
        recall = (h.ann_score - lo) / (hi - lo) if hi > lo else 1.0
        return max(h.score, FLOOR) ** (1 - weight) * max(recall, FLOOR) ** weight

    return sorted(hits, key=key, reverse=True)


def ndcg_by_order(bench: SearchBench, queries: list[Query], *, shortlist: int = 20,
                  weights: Sequence[float] = (0.25, 0.5)) -> dict[str, dict[str, float]]:
    """Mean nDCG@10 per query kind of the recall order, the reranked order, fusions of the two (all from one
    reranked search per query, ``top_k = top_n = shortlist``) and the product's order (the reranker's policy)."""
    rows: dict[str, dict[str, list[float]]] = {}
    for q in queries:
        if not any(q.relevant(f) for f in bench.docs):
            continue
        hits = bench.search(q, rerank=True, shortlist=shortlist, always=True)
        gains = [q.gain(f) for f in bench.docs]
        orders = {"recall": sorted(hits, key=lambda h: h.ann_score, reverse=True), "reranked": hits}
        orders |= {f"fused w={w}": fused(hits, w) for w in weights}
        orders["product"] = bench.search(q, rerank=True, shortlist=shortlist)
        for name, ordered in orders.items():
            ranked = [bench.position[h.sha256] for h in ordered]
            rows.setdefault(q.kind, {}).setdefault(name, []).append(ndcg_at(ranked, gains, 10))
    return {kind: {name: float(np.mean(v)) for name, v in by.items()} for kind, by in rows.items()}


def trust_failures(t: Trust, floors: dict[str, float], *, unmatched: int = 0) -> list[str]:
    """The floors ``t`` misses (empty: all held); ``unmatched``: how many criteria some reference meets may go
    without a hit at the threshold."""
    out = []
    checks = {"criteria_met_top5": t.criteria_met_top5["product"], "single_precision5": t.single_precision5,
              "single_auc": t.single_auc, "negative_without_top5": t.negative_without_top5,
              "identical_candidate_matches": t.identical_candidate_matches}
    for name, floor in floors.items():
        if not checks[name] >= floor:
            out.append(f"{name} {checks[name]:.3f} < {floor}")
    if t.absent_hits_above:
        out.append(f"{t.absent_hits_above} hits above the threshold for statements no face meets")
    if len(t.criteria_without_match) > unmatched:
        out.append(f"no match above the threshold for {t.criteria_without_match}")
    return out
