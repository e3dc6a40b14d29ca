"""The demo reranker's rerank policy, measured after training on faces neither model saw.

For each query kind (criteria, negative criteria, candidate, candidate + criteria) the trainer runs the same
queries through the product's search once reranked, and compares the nDCG@10 of the reranked order with the
recall order of the same shortlist. The result goes beside the reranker's config as
``rubricsearch-policy.json`` (:data:`rerank.rubric.POLICY_FILE`), which search reads: a kind whose reranking
lost keeps the recall order. With each kind it records a calibration of the vector score, a logistic fit of
"the reference is a match" (every criterion holds; for a candidate alone, the same subject) on the shortlists'
vector scores (for a candidate alone, also of searches whose candidate is one of the references: the identical
image is the same subject), so a search that keeps the recall order still has a score on the reranker's scale.

What a judgement means for a set's criteria is not the checkpoint's business: the demo set gets its verdicts from
its own judgments and calibration, as any team's set does (:mod:`app.demo.judgments`).

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

from rubricsearch.app.demo.faces import DEFAULT_SIZE, draw_face, faces, png_bytes
from rubricsearch.app.demo.rubrics import KINDS, sample_query
from rubricsearch.app.demo.search_eval import SET_ID, SearchBench
from rubricsearch.rerank.metrics import fit_logistic
from rubricsearch.rerank.rubric import POLICY_FILE
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.metrics import ndcg_at
from rubricsearch.retrieval.search import SearchRequest

TUNE_SEED = 31
# A file of another version is measured again (the weights are kept); a version-2 file written with the
# judgement calibrations that set calibrations replaced is read without them.
POLICY_VERSION = 2
TUNE_QUERY_SEED = 33


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
                done += 1
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
        out[name] = {"queries": per_kind, "recall_ndcg10": round(float(np.mean(by["recall"])), 4),
                     "reranked_ndcg10": round(float(np.mean(by["reranked"])), 4),
                     "recall_calibration": {"slope": round(slope, 4), "intercept": round(intercept, 4)}}
    return {"measured_on": f"{docs} held-out generated faces (split 'tune'), {per_kind} queries per kind, "
                           f"the top {shortlist} of recall reranked", "kinds": out}


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
    """Whether the reranker's policy file was measured by this version of the measurement (another version is
    measured again, the weights are kept)."""
    try:
        return bool(json.loads((reranker / POLICY_FILE).read_text()).get("version") == POLICY_VERSION)
    except (OSError, ValueError, AttributeError):
        return False
