"""Retrieval quality through the product's own search path: recall, reranking and the per-criterion breakdown.

The held-out faces are ingested as ingestion ingests references (one package per image in a shared package
store, vectors embedded without an instruction, i.e. under the embedder's default, into a FAISS set), and
every query goes through :class:`retrieval.search.SearchService` with a :class:`rerank.rubric.RubricReranker`
(``rerank=False`` for the recall order, ``rerank=True`` for the reranked shortlist). So a bug anywhere on
that path (instructions, prompts, the breakdown's criteria) shows in these numbers; nothing here
re-implements it.

Per-criterion AUC: for rubrics of several criteria, the breakdown score ``hit.criteria[c]`` of each
reranked reference, against whether the reference meets ``c``; the AUC of one (query, criterion) over its
shortlist, averaged (pairs whose shortlist holds only one class are skipped).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rubricsearch.app.demo.evaluation import CANDIDATE_SEED, QUERY_SEED, Scores, score
from rubricsearch.app.demo.faces import ATTRIBUTES, DEFAULT_SIZE, VALUES, Criterion, Face, draw_face, png_bytes
from rubricsearch.app.demo.rubrics import Query, random_criteria
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search import SearchRequest, SearchService
from rubricsearch.retrieval.search.service import SearchHit

SET_ID = "eval-faces"


class SearchBench:
    """The held-out faces ingested into a real index, searched through the real service."""

    def __init__(self, embedding: str, reranker: str | None, docs: list[Face], images: list[ImageLike], *,
                 root: Path | None = None) -> None:
        from rubricsearch.retrieval import load_embedder
        from rubricsearch.retrieval.index.factory import make_index
        from rubricsearch.retrieval.packages import PackageStore, VisualPackages

        self.docs, self.images = docs, images
        self._tmp = tempfile.TemporaryDirectory(prefix="rubricsearch-eval-") if root is None else None
        self.root = Path(self._tmp.name) if self._tmp is not None else root
        assert self.root is not None
        self.packages = VisualPackages(PackageStore(storage_dtype="float32"))
        self.embedder: Any = load_embedder(embedding, device="cpu", packages=self.packages)
        self.reranker: Any = None
        self.index = make_index("faiss", path=self.root / "faiss")
        self.position = {img.sha256: i for i, img in enumerate(images)}
        self.use_reranker(reranker)
        self.packages.build(images)  # as ingestion does: one package per distinct tower
        self.ingest()

    def use_reranker(self, reranker: str | Path | None) -> None:
        """Search with another reranker checkpoint (a fine-tuned version of the same tower reads the packages
        already made): the product's service (the checkpoint's recorded policy), and one that reranks every
        kind (what the policy is measured from)."""
        from rubricsearch.rerank import load_reranker
        from rubricsearch.rerank.rubric import RubricReranker, read_policy

        if self.reranker is not None:
            self.reranker.close()
        rr = load_reranker(reranker, device="cpu", packages=self.packages) if reranker else None
        self.reranker = rr
        by_sha = {img.sha256: img for img in self.images}
        scorer = RubricReranker(rr, read_policy(reranker)) if rr is not None and reranker else None
        self.service = SearchService(self.embedder, scorer, self.index, by_sha.__getitem__)
        self.reranking = SearchService(self.embedder, RubricReranker(rr) if rr is not None else None,
                                       self.index, by_sha.__getitem__)

    def ingest(self, set_id: str = SET_ID) -> None:
        """(Re)embed the references as ingestion does (``indexer/jobs/pipeline.py``: no instruction)."""
        if self.index.has_set(set_id):
            self.index.drop_set(set_id)
        self.index.create_set(set_id, self.embedder.dimension)
        vectors = self.embedder.embed_contents([Content(images=[img]) for img in self.images],
                                               [None] * len(self.images))
        self.index.upsert(set_id, [img.sha256 for img in self.images], vectors)

    def search(self, query: Query, *, rerank: bool, shortlist: int, set_id: str = SET_ID,
               always: bool = False, candidate_seed: int = CANDIDATE_SEED) -> list[SearchHit]:
        """One search as the product runs it (``always``: reranked whatever the policy says)."""
        candidate = (decode_image(png_bytes(draw_face(query.candidate, size=DEFAULT_SIZE, seed=candidate_seed)))
                     if query.candidate is not None else None)
        request = SearchRequest(set_id=set_id, criteria=query.texts, candidate=candidate, top_k=shortlist,
                                top_n=shortlist, rerank=rerank)
        result = (self.reranking if always else self.service).search(request)
        policy = result.provenance.rerank_policy
        if rerank and self.reranker is not None and (always or (policy is not None and policy.rerank)):
            assert result.provenance.reranked, result.provenance.rerank_status
        return result.hits

    def ranking(self, query: Query, *, rerank: bool, shortlist: int) -> list[int]:
        return [self.position[h.sha256] for h in self.search(query, rerank=rerank, shortlist=shortlist)]

    def close(self) -> None:
        self.index.close()
        self.embedder.close()
        if self.reranker is not None:
            self.reranker.close()
        if self._tmp is not None:
            self._tmp.cleanup()


@dataclass(frozen=True)
class Quality:
    """Metrics per query kind before (recall order) and after reranking the shortlist."""

    before: dict[str, Scores]
    after: dict[str, Scores]


def quality(bench: SearchBench, queries: list[Query], *, shortlist: int = 20) -> Quality:
    before = score(queries, bench.docs, [bench.ranking(q, rerank=False, shortlist=shortlist) for q in queries])
    after = (score(queries, bench.docs, [bench.ranking(q, rerank=True, shortlist=shortlist) for q in queries])
             if bench.reranker is not None else [])
    return Quality({s.kind: s for s in before}, {s.kind: s for s in after})


def auc(scores: Sequence[float], labels: Sequence[bool]) -> float:
    """Probability that a positive outscores a negative (ties count half); NaN with one class only."""
    pos = [s for s, y in zip(scores, labels, strict=True) if y]
    neg = [s for s, y in zip(scores, labels, strict=True) if not y]
    if not pos or not neg:
        return float("nan")
    p, n = np.array(pos)[:, None], np.array(neg)[None, :]
    return float(((p > n).sum() + 0.5 * (p == n).sum()) / (len(pos) * len(neg)))


def rubric_queries(count: int, *, seed: int = QUERY_SEED + 1) -> list[Query]:
    """Rubrics of two or three criteria about distinct attributes (some absences), what a breakdown is for."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        n = rng.choice((2, 3))
        out.append(Query("criteria", random_criteria(rng, n, negatives=rng.choice((0, 0, 1)))))
    return out


@dataclass(frozen=True)
class CriterionAUC:
    """Mean AUC of the breakdown over (query, criterion) pairs, and of presences and absences apart."""

    mean: float
    present: float
    absent: float
    pairs: int


def criterion_auc(bench: SearchBench, queries: list[Query], *, shortlist: int = 40) -> CriterionAUC:
    rows: list[tuple[bool, float]] = []
    for q in queries:
        hits = bench.search(q, rerank=True, shortlist=shortlist)
        for c in q.criteria:
            labels = [c.holds(bench.docs[bench.position[h.sha256]]) for h in hits]
            value = auc([h.criteria[c.text] for h in hits], labels)
            if not np.isnan(value):
                rows.append((c.negative, value))

    def mean(values: list[float]) -> float:
        return float(np.mean(values)) if values else float("nan")

    return CriterionAUC(mean([v for _, v in rows]), mean([v for neg, v in rows if not neg]),
                        mean([v for neg, v in rows if neg]), len(rows))



def single_criterion_queries() -> list[Query]:
    """Every attribute value as a criterion alone ("green eyes", "a fox", "no forehead stripes", …)."""
    return [Query("criteria", (Criterion(a, v),)) for a in ATTRIBUTES for v in VALUES[a]]


@dataclass(frozen=True)
class Measurement:
    """What the quality floors read: all four kinds, single criteria, and the breakdown's AUC."""

    kinds: Quality
    single: Quality
    breakdown: CriterionAUC


def measure(bench: SearchBench, *, per_kind: int = 25, rubrics: int = 12, shortlist: int = 20,
            kinds: bool = True) -> Measurement:
    from rubricsearch.app.demo.evaluation import eval_queries

    empty = Quality({}, {})
    return Measurement(quality(bench, eval_queries(per_kind), shortlist=shortlist) if kinds else empty,
                       quality(bench, single_criterion_queries(), shortlist=shortlist),
                       criterion_auc(bench, rubric_queries(rubrics)) if bench.reranker is not None
                       else CriterionAUC(float("nan"), float("nan"), float("nan"), 0))
