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

The faces are the ``tune`` split (never trained on, and not the ``eval`` split the quality floors and
``bench/quality.py`` measure on), with candidates drawn from it under another seed.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import numpy as np

from app.demo.evaluation import ndcg_at
from app.demo.faces import DEFAULT_SIZE, draw_face, faces, png_bytes
from app.demo.rubrics import KINDS, sample_query
from rerank.rubric import POLICY_FILE
from retrieval.images import ImageLike, decode_image

TUNE_SEED = 31
TUNE_QUERY_SEED = 33


def fit_logistic(scores: list[float], labels: list[bool], *, ridge: float = 1e-3, steps: int = 50
                 ) -> tuple[float, float]:
    """Slope and intercept of P(label | score) = sigmoid(slope · score + intercept), by Newton's method
    (a small ridge keeps it finite when the classes separate)."""
    x = np.stack([np.asarray(scores, dtype=np.float64), np.ones(len(scores))], axis=1)
    y = np.asarray(labels, dtype=np.float64)
    w = np.zeros(2)
    for _ in range(steps):
        p = 1.0 / (1.0 + np.exp(-(x @ w)))
        grad = x.T @ (p - y) + ridge * w
        hess = (x * (p * (1 - p))[:, None]).T @ x + ridge * np.eye(2)
        step = np.linalg.solve(hess, grad)
        w -= step
        if np.abs(step).max() < 1e-9:
            break
    return float(w[0]), float(w[1])


def measure_policy(embedding: Path, reranker: Path, *, docs: int = 120, per_kind: int = 25,
                   shortlist: int = 20) -> dict[str, Any]:
    """nDCG@10 of the recall and the reranked order per kind, and each kind's recall calibration."""
    from app.demo.search_eval import SET_ID, SearchBench
    from retrieval.search import SearchRequest

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


def write_policy(embedding: Path, reranker: Path) -> dict[str, Any]:
    """Measure the reranker at ``reranker`` (a finished checkpoint directory) and record its policy there."""
    policy = measure_policy(embedding, reranker)
    (reranker / POLICY_FILE).write_text(json.dumps(policy, indent=2, sort_keys=True))
    return policy
