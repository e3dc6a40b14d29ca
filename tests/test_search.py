"""Rubric search: scores equal direct model calls; references never re-encoded; provenance and breakdown.

Every module-level test runs twice: with a reranker whose vision tower equals the embedder's, and with one
whose tower differs (the promise must not depend on the towers being identical).
"""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import RubricReranker, aggregate, judged, rubric_instructions
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.images import ReferenceImage, decode_image
from rubricsearch.retrieval.index.factory import make_index
from rubricsearch.retrieval.packages import PackageStore, Purpose, VisualPackages
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search import Rubric, SearchRequest, SearchService, build
from rubricsearch.retrieval.search.instructions import DOCUMENT_INSTRUCTION
from tests.conftest import TOWERS
from tests.search_world import indexed_pngs


@pytest.fixture(scope="module", params=TOWERS)
def world(request, tmp_path_factory, tiny_embedding_dir: Path, reranker_dir_for, make_png):
    root = tmp_path_factory.mktemp("search")
    packages = VisualPackages(PackageStore(root / "packages", storage_dtype="float32"))
    emb = load_embedder(str(tiny_embedding_dir), packages=packages)
    rr = load_reranker(str(reranker_dir_for(request.param)), packages=packages)
    assert (emb.packages.fingerprint == rr.packages.fingerprint) == (request.param == "shared")
    index = make_index("faiss", path=root / "faiss")
    blobs = indexed_pngs(packages, emb, index, "cats", make_png, 12, 200)
    service = SearchService(emb, RubricReranker(rr), index, lambda sha: ReferenceImage(sha, lambda: blobs[sha]))
    return service, emb, rr, blobs, request.param


def test_instruction_templates() -> None:
    r = Rubric.parse("short fur\ntriangular ears\n- dark forehead stripes", None)
    assert r.criteria == ("short fur", "triangular ears", "dark forehead stripes")
    ins = build(r, has_candidate=True)
    assert ins.query == ("Retrieve reference images that match the given image on these criteria: "
                         "short fur; triangular ears; dark forehead stripes")
    assert ins.document == DOCUMENT_INSTRUCTION
    scoring = rubric_instructions(r, has_candidate=True)
    assert len(scoring.per_criterion) == 3 and scoring.overall is None  # the overall score is the aggregate
    assert scoring.per_criterion[0].startswith("Judge whether the Document image matches")
    with pytest.raises(InvalidInput):
        build(Rubric.parse(None, None), has_candidate=False)
    with pytest.raises(InvalidInput):
        Rubric.parse(None, [f"c{i}" for i in range(13)])


def test_search_equals_direct_calls_without_reencoding(world, make_png) -> None:
    service, emb, rr, blobs, towers = world
    candidate = decode_image(make_png(80, 80, 999))
    criteria = ["short fur", "triangular ears"]
    before = (emb.stats["vision_encodes"], rr.stats["vision_encodes"])
    encodes_before = emb.packages.service.encode_counts()
    result = service.search(SearchRequest("cats", criteria=criteria, candidate=candidate, top_k=8, top_n=5))
    # only the candidate went through a tower (once per distinct tower); no reference did
    assert emb.stats["vision_encodes"] - before[0] == 1
    assert rr.stats["vision_encodes"] - before[1] == (0 if towers == "shared" else 1)
    prov = result.provenance
    # the query is embedded under the rubric's instruction (the demo models cannot tell on every training)
    assert prov.instructions.query == ("Retrieve reference images that match the given image on these "
                                             "criteria: short fur; triangular ears")
    vision = prov.vision
    assert vision.reference == 0 and vision.query == (1 if towers == "shared" else 2)
    assert vision.by_model["embedding"] == {"query": 1}
    assert vision.towers_shared is (towers == "shared") and prov.vision_encodes == vision.total
    new = {k: n - encodes_before.get(k, 0) for k, n in emb.packages.service.encode_counts().items()}
    assert not any(n for (_, _, purpose), n in new.items() if purpose == Purpose.REFERENCE)
    assert prov.reranked and prov.rerank_status == "ok" and prov.criteria == criteria
    assert len(result.hits) == 5
    assert [h.rank for h in result.hits] == [1, 2, 3, 4, 5]
    scores = [h.score for h in result.hits]
    assert scores == sorted(scores, reverse=True)
    # recall scores equal a direct embedder call + inner product
    qvec = emb.embed([{"image": candidate.data, "text": "short fur; triangular ears",
                       "instruction": prov.instructions.query}], dimensions=96)[0]
    for hit in result.hits:
        dvec = emb.embed([{"image": blobs[hit.sha256]}], dimensions=96)[0]
        assert abs(float(qvec @ dvec) - hit.ann_score) <= 1e-5
        assert prov.instructions.rerank is None  # no joint pass: the score is formed from the criteria
        per = []
        for crit, instruction in zip(criteria, prov.instructions.per_criterion, strict=True):
            one = rr.score_pairs([Pair(Content(texts=[crit], images=[candidate]),
                                       Content(images=[decode_image(blobs[hit.sha256])]), instruction)])[0]
            assert abs(one - hit.criteria[crit]) <= 1e-5
            per.append(one)
        assert hit.rerank_score is not None and abs(hit.rerank_score - math.sqrt(per[0] * per[1])) <= 1e-5
    assert prov.score.formed == "geometric mean of the per-criterion scores"


@pytest.mark.parametrize(("criterion", "statement"), [
    ("no forehead stripes", "forehead stripes"), ("No ginger fur", "ginger fur"), ("not a fox", "a fox"),
    ("without dark forehead stripes", "dark forehead stripes"), ("non-ginger fur", "ginger fur"),
    ("doesn't have round ears", "round ears"), ("does not show a fox", "a fox"), ("has no stripes", "stripes"),
    ("isn't a cat", "a cat"), ("lacks any stripes", "stripes"), ("free of spots", "spots"),
])
def test_negatives_are_judged_as_their_positive_statement(criterion: str, statement: str) -> None:
    assert judged(criterion).statement == statement and judged(criterion).negated


@pytest.mark.parametrize("criterion", ["notched ears", "nose ring", "no", "nothing on the forehead",
                                       "a non", "northern fox", "green eyes"])
def test_other_criteria_are_not_negated(criterion: str) -> None:
    assert judged(criterion) == judged(criterion.strip()) and not judged(criterion).negated


def test_aggregate_is_the_geometric_mean() -> None:
    assert abs(aggregate([0.9, 0.4]) - 0.6) <= 1e-9
    assert aggregate([0.9, 0.0]) < aggregate([0.3, 0.3])  # one failed criterion sinks a reference


def test_negation_scores_one_minus_the_positive(world, make_png) -> None:
    """"no X" and "X" in one rubric: the two breakdown cells of every hit add up to 1, and provenance shows
    the statement judged and how."""
    service, *_ = world
    for candidate in (None, decode_image(make_png(80, 80, 999))):
        res = service.search(SearchRequest("cats", criteria=["dark stripes", "no dark stripes", "short fur"],
                                           candidate=candidate, top_k=8, top_n=8))
        assert res.hits
        for hit in res.hits:
            assert abs(hit.criteria["dark stripes"] + hit.criteria["no dark stripes"] - 1.0) <= 1e-5
            assert hit.score == hit.rerank_score == pytest.approx(aggregate(list(hit.criteria.values())))
        judged_rows = res.provenance.score.judged
        assert judged_rows[1].model_dump() == {"criterion": "no dark stripes", "statement": "dark stripes",
                                               "score": "1 - P(statement)"}
        assert judged_rows[0].score == "P(statement)"
        per_criterion = res.provenance.instructions.per_criterion
        assert per_criterion[0] == per_criterion[1]  # the model is asked the same positive question
    one_line = service.search(SearchRequest("cats", rubric="no dark stripes", top_k=8, top_n=8))
    positive = service.search(SearchRequest("cats", rubric="dark stripes", top_k=8, top_n=8))
    pos = {h.sha256: h.score for h in positive.hits}
    assert all(abs(h.score + pos[h.sha256] - 1.0) <= 1e-5 for h in one_line.hits if h.sha256 in pos)
    assert one_line.provenance.score.formed.startswith("1 − ")


def test_repeated_search_encodes_nothing(world, make_png) -> None:
    service, *_ = world
    candidate = decode_image(make_png(80, 80, 999))
    req = SearchRequest("cats", criteria=["short fur"], candidate=candidate, top_k=6, top_n=6)
    service.search(req)
    again = service.search(req)
    assert again.provenance.vision.total == 0 and again.provenance.reranked


def test_missing_reference_package_is_counted_as_a_reference_encode(world, make_png) -> None:
    """Provenance tells the truth when a reference lacks its package (e.g. a new tower before backfill)."""
    service, _emb, rr, blobs, _towers = world
    sha = next(iter(blobs))
    store = rr.packages.service.store
    assert store.contains(sha, rr.packages.fingerprint)
    store.delete_image(sha)  # every package of that reference is gone
    result = service.search(SearchRequest("cats", rubric="stripes", top_k=12, top_n=12))
    vision = result.provenance.vision
    assert vision.reference == 1 and vision.by_model["reranker"] == {"reference": 1}
    assert service.search(SearchRequest("cats", rubric="stripes", top_k=12, top_n=12)).provenance.vision.total == 0


def test_text_only_and_no_rerank(world) -> None:
    service, *_ = world
    res = service.search(SearchRequest("cats", rubric="dark forehead stripes", top_k=5, top_n=3, rerank=False))
    assert not res.provenance.reranked and res.provenance.rerank_status.startswith("skipped")
    assert res.provenance.instructions.rerank is None and res.provenance.instructions.per_criterion == []
    assert res.provenance.score.formed.startswith("the vector score")
    assert len(res.hits) == 3 and all(h.rerank_score is None for h in res.hits)
    assert set(res.timings_ms) == {"query_embedding", "ann", "rerank"}


def test_reranker_outage_degrades_visibly(world) -> None:
    service, *_ = world

    class Down(RubricReranker):
        def score(self, query, rubric, documents, recall_scores, *, usage=None):
            raise BackendUnavailable("reranker server is down")

    degraded = SearchService(service.embedder, Down(service.scorer.reranker), service.index,
                             service.resolve_reference)
    res = degraded.search(SearchRequest("cats", rubric="stripes", top_k=4, top_n=4))
    assert res.provenance.rerank_status == "failed: reranker server is down"
    assert [h.score for h in res.hits] == [h.ann_score for h in res.hits]


def test_bad_requests(world) -> None:
    service, *_ = world
    with pytest.raises(InvalidInput):
        service.search(SearchRequest("cats", rubric="x", top_k=0))
    with pytest.raises(InvalidInput):
        service.search(SearchRequest("cats"))
    from rubricsearch.retrieval.errors import NotFound

    with pytest.raises(NotFound):
        service.search(SearchRequest("no-such-set", rubric="x"))
    assert np.isfinite(service.search(SearchRequest("cats", rubric="x", top_k=3, top_n=0)).hits[0].score)
