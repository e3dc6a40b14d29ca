"""A candidate whose bytes are a reference of the set is that reference: it is marked ``identical`` in every
search with a candidate, and a candidate-only search serves it first with score 1.0 whatever the models think,
even when recall missed it, unless the request's filter excludes it.

Real tiny random-weight checkpoints (they do not recognise the image: that is the point), a real FAISS index and
the real search service, under a policy that steps aside for candidate searches and under none (reranked).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rubricsearch.rerank.rubric import RerankPolicy, read_policy
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.index.filters import parse_filter
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search import SearchRequest
from rubricsearch.retrieval.search.service import IDENTICAL
from tests.search_world import policy_world

POLICY = {"measured_on": "a test", "kinds": {
    "candidate": {"recall_ndcg10": 0.76, "reranked_ndcg10": 0.63,
                  "recall_calibration": {"slope": 2.0, "intercept": -4.0}}}}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          make_png: Any) -> Any:
    with policy_world(tmp_path_factory.mktemp("identical"), tiny_embedding_dir, tiny_reranker_dir, make_png,
                      POLICY, 700) as w:
        yield ({"aside": w.service(read_policy(w.measured)), "reranked": w.service(RerankPolicy())}, w.emb, w.index,
               w.blobs)


def _reference(blobs: dict[str, bytes], i: int) -> Any:
    sha = sorted(blobs)[i]
    return decode_image(blobs[sha])


@pytest.mark.parametrize("policy", ["aside", "reranked"])
def test_the_candidate_itself_is_served_first_with_score_one(world: Any, policy: str) -> None:
    services, _, _, blobs = world
    for i in (0, 4, 9):
        candidate = _reference(blobs, i)
        res = services[policy].search(SearchRequest("refs", candidate=candidate, top_k=10, top_n=5))
        first, rest = res.hits[0], res.hits[1:]
        assert first.sha256 == candidate.sha256 and first.identical and first.score == 1.0
        assert not any(h.identical for h in rest) and all(h.score < 1.0 for h in rest)
        assert [h.rank for h in res.hits] == [1, 2, 3, 4, 5]
        prov = res.provenance.identical
        assert prov is not None and prov.sha256 == candidate.sha256 and prov.found == IDENTICAL
        assert prov.score == "1.0: it is the candidate" and prov.recall_rank is not None and prov.recall_rank >= 1
    # a candidate that is not in the set: no hit is marked
    other = decode_image(blobs[sorted(blobs)[0]] + b"\0")  # the same pixels, other bytes
    res = services[policy].search(SearchRequest("refs", candidate=other, top_k=10, top_n=5))
    assert not any(h.identical for h in res.hits) and res.provenance.identical is None


@pytest.fixture
def hidden(world: Any) -> Any:
    """A copy of the set in which one reference's vector points away from its own candidate query, so recall
    cannot find it (as a weak embedder would miss it)."""
    services, emb, index, blobs = world
    candidate = _reference(blobs, 3)
    query = services["aside"].search(SearchRequest("refs", candidate=candidate, top_k=1, top_n=0))
    vectors = index.vectors("refs", blobs)
    qvec = emb.embed_contents([Content(images=[candidate])], [query.provenance.instructions.query],
                              dimensions=96)[0]
    vectors[candidate.sha256] = -qvec / np.linalg.norm(qvec)
    index.create_set("hidden", 96)
    index.upsert("hidden", list(vectors), np.stack(list(vectors.values())))
    index.set_payloads("hidden", {sha: {"group": "a" if sha == candidate.sha256 else "b"} for sha in vectors})
    yield candidate
    index.drop_set("hidden")


@pytest.mark.parametrize("policy", ["aside", "reranked"])
def test_recall_missing_it_does_not_hide_it(world: Any, hidden: Any, policy: str) -> None:
    services, _, _, _ = world
    res = services[policy].search(SearchRequest("hidden", candidate=hidden, top_k=4, top_n=4))
    assert res.hits[0].sha256 == hidden.sha256 and res.hits[0].score == 1.0
    assert res.hits[0].ann_score == pytest.approx(-1.0, abs=1e-4)  # its true vector score, far below the others
    assert len(res.hits) == 4 and res.provenance.identical.recall_rank is None
    recall = services[policy].search(SearchRequest("hidden", candidate=hidden, top_k=4, top_n=4, rerank=False))
    assert recall.hits[0].sha256 == hidden.sha256 and recall.hits[0].identical
    # the filter decides: excluded, it is not served; kept, it is
    out = services[policy].search(SearchRequest("hidden", candidate=hidden, top_k=4, top_n=4,
                                                filter=parse_filter({"must": [{"key": "group",
                                                                               "match": {"value": "b"}}]})))
    assert hidden.sha256 not in {h.sha256 for h in out.hits} and out.provenance.identical is None
    kept = services[policy].search(SearchRequest("hidden", candidate=hidden, top_k=4, top_n=4,
                                                 filter=parse_filter({"must": [{"key": "group",
                                                                                "match": {"value": "a"}}]})))
    assert [h.sha256 for h in kept.hits] == [hidden.sha256] and kept.hits[0].identical
    # kept among many, recall still misses it: the filter's verdict on it alone serves it
    wide = services[policy].search(SearchRequest("hidden", candidate=hidden, top_k=4, top_n=4,
                                                 filter=parse_filter({"must_not": [{"key": "group",
                                                                                    "match": {"value": "c"}}]})))
    assert wide.hits[0].sha256 == hidden.sha256 and wide.hits[0].score == 1.0 and len(wide.hits) == 4
    assert wide.provenance.identical.recall_rank is None


def test_with_criteria_it_is_marked_and_the_criteria_decide(world: Any) -> None:
    services, _, _, blobs = world
    candidate = _reference(blobs, 6)
    res = services["reranked"].search(SearchRequest("refs", criteria=["ginger fur", "no stripes"],
                                                    candidate=candidate, top_k=10, top_n=10))
    marked = [h for h in res.hits if h.identical]
    assert [h.sha256 for h in marked] == [candidate.sha256]
    hit = marked[0]
    assert hit.score == hit.rerank_score and set(hit.criteria) == {"ginger fur", "no stripes"}
    assert [h.score for h in res.hits] == sorted((h.score for h in res.hits), reverse=True)
    assert res.provenance.identical.score == "the criteria's scores, as every hit"
