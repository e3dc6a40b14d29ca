"""Rubric search: scores equal direct model calls; references never re-encoded; provenance and breakdown."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rerank import load_reranker
from rerank.protocol import Pair
from retrieval import load_embedder
from retrieval.errors import BackendUnavailable, InvalidInput
from retrieval.images import StoredImage, decode_image
from retrieval.index.factory import make_index
from retrieval.packages import PackageStore
from retrieval.qwen.prompts import Content
from retrieval.search import Rubric, SearchRequest, SearchService, build
from retrieval.search.instructions import DOCUMENT_INSTRUCTION


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_embedding_dir: Path, tiny_reranker_dir: Path, make_png):
    root = tmp_path_factory.mktemp("search")
    store = PackageStore(root / "packages", storage_dtype="float32")
    emb = load_embedder(str(tiny_embedding_dir), store=store)
    rr = load_reranker(str(tiny_reranker_dir), store=store)
    index = make_index("faiss", path=root / "faiss")
    index.create_set("cats", 96)
    blobs = {}
    for i in range(12):
        data = make_png(64 + 8 * i, 96, 200 + i)
        sha = decode_image(data).sha256
        blobs[sha] = data
        vec = emb.embed([{"image": data}], dimensions=96)
        index.upsert("cats", [sha], vec)
    service = SearchService(emb, rr, index, lambda sha: StoredImage(sha, lambda: blobs[sha]))
    return service, emb, rr, blobs


def test_instruction_templates() -> None:
    r = Rubric.parse("short fur\ntriangular ears\n- dark forehead stripes", None)
    assert r.criteria == ("short fur", "triangular ears", "dark forehead stripes")
    ins = build(r, has_candidate=True)
    assert ins.query == ("Retrieve reference images that match the given image on these criteria: "
                         "short fur; triangular ears; dark forehead stripes")
    assert len(ins.per_criterion) == 3 and ins.document == DOCUMENT_INSTRUCTION
    with pytest.raises(InvalidInput):
        build(Rubric.parse(None, None), has_candidate=False)
    with pytest.raises(InvalidInput):
        Rubric.parse(None, [f"c{i}" for i in range(13)])


def test_search_equals_direct_calls_without_reencoding(world, make_png) -> None:
    service, emb, rr, blobs = world
    candidate = decode_image(make_png(80, 80, 999))
    criteria = ["short fur", "triangular ears"]
    before = (emb.stats["vision_encodes"], rr.stats["vision_encodes"])
    result = service.search(SearchRequest("cats", criteria=criteria, candidate=candidate, top_k=8, top_n=5))
    # only the candidate went through the tower; no reference did
    assert emb.stats["vision_encodes"] - before[0] == 1
    assert rr.stats["vision_encodes"] - before[1] == 0
    prov = result.provenance
    assert prov["reranked"] and prov["rerank_status"] == "ok" and prov["criteria"] == criteria
    assert len(result.hits) == 5
    assert [h.rank for h in result.hits] == [1, 2, 3, 4, 5]
    scores = [h.score for h in result.hits]
    assert scores == sorted(scores, reverse=True)
    # recall scores equal a direct embedder call + inner product
    qvec = emb.embed([{"image": candidate.data, "text": "short fur; triangular ears",
                       "instruction": prov["instructions"]["query"]}], dimensions=96)[0]
    for hit in result.hits:
        dvec = emb.embed([{"image": blobs[hit.sha256]}], dimensions=96)[0]
        assert abs(float(qvec @ dvec) - hit.ann_score) <= 1e-5
        direct = rr.score({"image": candidate.data, "text": "short fur; triangular ears"},
                          [{"image": blobs[hit.sha256]}], prov["instructions"]["rerank"])[0]
        assert abs(direct - hit.rerank_score) <= 1e-5
        for crit, instruction in zip(criteria, prov["instructions"]["per_criterion"], strict=True):
            one = rr.score_pairs([Pair(Content(texts=[crit], images=[candidate]),
                                       Content(images=[decode_image(blobs[hit.sha256])]), instruction)])[0]
            assert abs(one - hit.criteria[crit]) <= 1e-5


def test_text_only_and_no_rerank(world) -> None:
    service, *_ = world
    res = service.search(SearchRequest("cats", rubric="dark forehead stripes", top_k=5, top_n=3, rerank=False))
    assert not res.provenance["reranked"] and res.provenance["rerank_status"].startswith("skipped")
    assert len(res.hits) == 3 and all(h.rerank_score is None for h in res.hits)
    assert set(res.timings_ms) == {"query_embedding", "ann", "rerank"}


def test_reranker_outage_degrades_visibly(world) -> None:
    service, *_ = world

    class Down:
        model_id, revision = "down", "x"

        def score_pairs(self, pairs):
            raise BackendUnavailable("reranker server is down")

    degraded = SearchService(service.embedder, Down(), service.index, service.resolve_reference)  # type: ignore[arg-type]
    res = degraded.search(SearchRequest("cats", rubric="stripes", top_k=4, top_n=4))
    assert res.provenance["rerank_status"] == "failed: reranker server is down"
    assert [h.score for h in res.hits] == [h.ann_score for h in res.hits]


def test_bad_requests(world) -> None:
    service, *_ = world
    with pytest.raises(InvalidInput):
        service.search(SearchRequest("cats", rubric="x", top_k=0))
    with pytest.raises(InvalidInput):
        service.search(SearchRequest("cats"))
    from retrieval.errors import NotFound

    with pytest.raises(NotFound):
        service.search(SearchRequest("no-such-set", rubric="x"))
    assert np.isfinite(service.search(SearchRequest("cats", rubric="x", top_k=3, top_n=0)).hits[0].score)
