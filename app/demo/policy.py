"""The demo reranker's rerank policy, measured after training on faces neither model saw.

For each query kind (criteria, negative criteria, candidate, candidate + criteria) the trainer runs the same
queries through the product's search once reranked, and compares the nDCG@10 of the reranked order with the
recall order of the same shortlist. The result goes beside the reranker's config as
``rubricsearch-policy.json`` (:data:`rerank.rubric.POLICY_FILE`), which search reads: a kind whose reranking
lost keeps the recall order. With each kind it records a calibration of the vector score, a logistic fit of
"the reference is a match" (every criterion holds; for a candidate alone, the same subject) on the shortlists'
vector scores (for a candidate alone, also of searches whose candidate is one of the references: the identical
image is the same subject), so a search that keeps the recall order still shows a match probability that the
match threshold can be read against.

For each kind it also fits a Platt calibration of the reranker's judgements: a logistic fit, on the logit of
each per-criterion P(yes) (a candidate alone: of the overall judgement), of "the judged statement holds" (for
"no X", whether X holds). Besides the queries' own statements, its negatives include statements no face meets,
from an off-topic vocabulary (:data:`OFF_TOPIC`: objects, sharing no word with the demo's attributes, with the
statements the quality measurements ask, :data:`app.demo.trust.ABSENT`, with the reranker's training vocabulary,
:mod:`app.demo.absent`, or with the tests' phrases), so the
calibrated 0.5 sits above what the reranker gives a statement about nothing in the picture.

The faces are the ``tune`` split (never trained on, and not the ``eval`` split the quality floors and
``bench/quality.py`` measure on), with candidates drawn from it under another seed.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rubricsearch.app.demo.evaluation import ndcg_at
from rubricsearch.app.demo.faces import DEFAULT_SIZE, Face, draw_face, faces, png_bytes
from rubricsearch.app.demo.rubrics import KINDS, Query, sample_query
from rubricsearch.app.demo.search_eval import SET_ID, SearchBench
from rubricsearch.rerank.calibration import fit_logistic
from rubricsearch.rerank.rubric import POLICY_FILE, judged, logit
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.search import SearchRequest
from rubricsearch.retrieval.search.service import SearchHit

TUNE_SEED = 31
POLICY_VERSION = 2  # 2: with the judgement calibrations
TUNE_QUERY_SEED = 33
_MATERIALS = ("wooden", "metal", "glass", "paper", "rusty", "plastic", "woollen", "copper", "ceramic", "velvet",
              "marble")
_OBJECTS = ("chair", "saucepan", "lamp", "lantern", "teapot", "umbrella", "guitar", "ladder", "candle", "clock",
            "tractor", "trumpet", "hammer", "violin", "sailboat", "windmill")
OFF_TOPIC = tuple(f"a {m} {o}" for m, o in zip(_MATERIALS * 2, _OBJECTS, strict=False))


def measure_policy(embedding: Path, reranker: Path, *, docs: int = 120, per_kind: int = 25,
                   shortlist: int = 20) -> dict[str, Any]:
    """nDCG@10 of the recall and the reranked order per kind, and each kind's recall calibration."""
    faces_ = faces("tune", docs, seed=TUNE_SEED)
    images: list[ImageLike] = [decode_image(png_bytes(draw_face(f, size=DEFAULT_SIZE, seed=TUNE_SEED))) for f in faces_]
    candidates = faces("tune", docs, seed=TUNE_SEED + 1)
    rng = random.Random(TUNE_QUERY_SEED)
    bench = SearchBench(str(embedding), str(reranker), faces_, images)
    ndcg: dict[str, dict[str, list[float]]] = {}
    pairs: dict[str, tuple[list[float], list[bool]]] = {}
    judgements: dict[str, tuple[list[float], list[bool]]] = {}
    try:
        for kind in KINDS:
            done = 0
            while done < per_kind:
                q = sample_query(rng, kind, candidates)
                if not any(q.relevant(f) for f in faces_):
                    continue
                hits = bench.search(q, rerank=True, shortlist=shortlist, always=True, candidate_seed=TUNE_SEED + 1)
                gains = [q.gain(f) for f in faces_]
                recall = sorted(hits, key=lambda h: h.ann_score, reverse=True)
                for order, ranked in (("recall", recall), ("reranked", hits)):
                    positions = [bench.position[h.sha256] for h in ranked]
                    ndcg.setdefault(kind, {}).setdefault(order, []).append(ndcg_at(positions, gains, 10))
                scores, labels = pairs.setdefault(kind, ([], []))
                scores += [h.ann_score for h in hits]
                labels += [q.relevant(faces_[bench.position[h.sha256]]) for h in hits]
                _judged(judgements.setdefault(kind, ([], [])), q, hits, [faces_[bench.position[h.sha256]]
                                                                           for h in hits])
                done += 1
        _off_topic(bench, judgements, rng, candidates, shortlist)
        # a reference used as the candidate is the same subject: the calibration sees that case too
        scores, labels = pairs["candidate"]
        for i in range(0, docs, max(1, docs // 10)):
            request = SearchRequest(set_id=SET_ID, candidate=images[i], top_k=shortlist, top_n=shortlist,
                                    rerank=False)
            for h in bench.service.search(request).hits:
                scores.append(h.ann_score)
                labels.append(faces_[bench.position[h.sha256]].key == faces_[i].key)
    finally:
        bench.close()
    out: dict[str, Any] = {}
    for name, by in ndcg.items():
        slope, intercept = fit_logistic(*pairs[name])
        probabilities, truth = judgements[name]
        j_slope, j_intercept = fit_logistic([logit(p) for p in probabilities], truth)
        out[name] = {"queries": per_kind, "recall_ndcg10": round(float(np.mean(by["recall"])), 4),
                     "reranked_ndcg10": round(float(np.mean(by["reranked"])), 4),
                     "recall_calibration": {"slope": round(slope, 4), "intercept": round(intercept, 4)},
                     "judgement_calibration": {"slope": round(j_slope, 4), "intercept": round(j_intercept, 4),
                                               "judgements": len(truth)}}
    return {"measured_on": f"{docs} held-out generated faces (split 'tune'), {per_kind} queries per kind, "
                           f"the top {shortlist} of recall reranked; judgements calibrated with "
                           f"{len(OFF_TOPIC)} off-topic statements", "kinds": out}


def _judged(into: tuple[list[float], list[bool]], q: Query, hits: list[SearchHit], faces_: list[Face]) -> None:
    """The raw P(yes) of every judgement of a search reranked without calibration, and whether its statement
    holds ("no X" is judged as X: its score is 1 − P(X))."""
    scores, labels = into
    if not q.criteria:  # a candidate alone: one judgement, "the same subject"
        scores += [h.score for h in hits]
        labels += [q.relevant(f) for f in faces_]
        return
    for c in q.criteria:
        negated = judged(c.text).negated
        scores += [1.0 - h.criteria[c.text] if negated else h.criteria[c.text] for h in hits]
        labels += [c.holds(f) != negated for f in faces_]


def _off_topic(bench: SearchBench, judgements: dict[str, tuple[list[float], list[bool]]], rng: random.Random,
               candidates: list[Face], shortlist: int) -> None:
    """Statements no face meets as negatives of the judgement calibrations: alone (what the criteria and the
    negative kinds judge), and with a candidate."""
    for text in OFF_TOPIC:
        face = rng.choice(candidates)
        image = decode_image(png_bytes(draw_face(face, size=DEFAULT_SIZE, seed=TUNE_SEED + 1)))
        for kinds, candidate in ((("criteria", "negative"), None), (("candidate+criteria",), image)):
            request = SearchRequest(set_id=SET_ID, criteria=[text], candidate=candidate, top_k=shortlist,
                                    top_n=shortlist)
            hits = bench.reranking.search(request).hits  # reranked whatever the policy, uncalibrated
            for kind in kinds:
                judgements[kind][0].extend(h.criteria[text] for h in hits)
                judgements[kind][1].extend(False for _ in hits)


@dataclass(frozen=True)
class PolicySize:
    """What measures the rerank policy: held-out faces, queries per kind, and the shortlist reranked. Tests that
    check the machinery, not what it finds, measure on a few (the default size costs most of a quick build)."""

    docs: int = 120
    per_kind: int = 25
    shortlist: int = 20


def write_policy(embedding: Path, reranker: Path, size: PolicySize = PolicySize()) -> dict[str, Any]:
    """Measure the reranker at ``reranker`` (a finished checkpoint directory) and record its policy there."""
    policy = measure_policy(embedding, reranker, docs=size.docs, per_kind=size.per_kind,
                            shortlist=size.shortlist) | {"version": POLICY_VERSION}
    tmp = reranker / f".{POLICY_FILE}.tmp"
    tmp.write_text(json.dumps(policy, indent=2, sort_keys=True))
    tmp.replace(reranker / POLICY_FILE)
    return policy


def policy_current(reranker: Path) -> bool:
    """Whether the reranker's policy file was measured by this version of the measurement (an older one lacks
    the judgement calibrations: it is measured again, the weights are kept)."""
    try:
        return bool(json.loads((reranker / POLICY_FILE).read_text()).get("version") == POLICY_VERSION)
    except (OSError, ValueError, AttributeError):
        return False
