"""The measured rerank policy: a query kind whose reranking lost keeps the recall order with a calibrated score,
says so in provenance, and a checkpoint without a policy (the real Qwen3-VL-Reranker) reranks every kind.

Real tiny random-weight checkpoints, a real FAISS index and the real search service; only the policy file is
written by the test (the demo trainer measures it on trained models: tests/test_demo_quality.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from rubricsearch.rerank.rubric import POLICY_FILE, RerankPolicy, query_kind, read_policy
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.search import Rubric, SearchRequest
from tests.search_world import policy_world

# reranking lost for a candidate alone, won for criteria: the shape of the demo reranker's measurement
POLICY = {"measured_on": "a test", "kinds": {
    "criteria": {"recall_ndcg10": 0.58, "reranked_ndcg10": 0.75,
                 "recall_calibration": {"slope": 4.0, "intercept": -1.0}},
    "candidate": {"recall_ndcg10": 0.76, "reranked_ndcg10": 0.63,
                  "recall_calibration": {"slope": 12.0, "intercept": -3.0}}}}


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          make_png: Any) -> Any:
    with policy_world(tmp_path_factory.mktemp("policy"), tiny_embedding_dir, tiny_reranker_dir, make_png,
                      POLICY, 300) as w:
        yield w.service, w.rr, w.measured, tiny_reranker_dir


def test_query_kinds() -> None:
    assert query_kind(Rubric.parse(None, ["ginger fur", "round ears"]), False) == "criteria"
    assert query_kind(Rubric.parse(None, ["ginger fur", "no forehead stripes"]), False) == "negative"
    assert query_kind(Rubric.parse("without a collar", None), False) == "negative"  # one free-text line
    assert query_kind(Rubric.parse(None, None), True) == "candidate"
    assert query_kind(Rubric.parse(None, ["no round ears"]), True) == "candidate+criteria"


def test_policy_file_is_read_and_validated(world: Any, tmp_path: Path) -> None:
    _, _, measured, plain = world
    policy = read_policy(measured)
    assert not policy.for_kind("candidate").rerank and policy.for_kind("criteria").rerank
    assert policy.for_kind("negative").rerank and policy.for_kind("negative").measured is None  # not measured
    assert policy.for_kind("candidate").measured == {"recall": 0.76, "reranked": 0.63}
    assert read_policy(plain).kinds == {} and read_policy("Qwen/Not-In-The-Cache").kinds == {}
    # a kind that steps aside needs the calibration that keeps its score a match probability
    bad = {"kinds": {"candidate": {"recall_ndcg10": 0.7, "reranked_ndcg10": 0.6}}}
    (tmp_path / POLICY_FILE).write_text(json.dumps(bad))
    with pytest.raises(InvalidInput, match="without a recall calibration"):
        read_policy(tmp_path)
    (tmp_path / POLICY_FILE).write_text("{not json")
    with pytest.raises(InvalidInput, match="cannot read"):
        read_policy(tmp_path)


def test_a_kind_whose_reranking_lost_keeps_the_recall_order(world: Any, make_png: Any) -> None:
    service, rr, measured, _ = world
    search = service(read_policy(measured))
    candidate = decode_image(make_png(72, 72, 999))
    pairs = rr.stats["scored_pairs"]
    res = search.search(SearchRequest("refs", candidate=candidate, top_k=8, top_n=5))
    assert rr.stats["scored_pairs"] == pairs  # the reranker did not run
    ann = [h.ann_score for h in res.hits]
    assert ann == sorted(ann, reverse=True) and len(res.hits) == 5
    for h in res.hits:  # the calibrated match probability of the vector score
        assert h.score == pytest.approx(1 / (1 + math.exp(-(12.0 * h.ann_score - 3.0))))
        assert h.rerank_score is None and h.criteria == {}
    prov = res.provenance
    assert not prov.reranked and prov.rerank_status.startswith("stepped aside: for candidate searches")
    assert "0.630 reranked, 0.760 recall order" in prov.rerank_status
    assert prov.rerank_policy is not None
    assert prov.rerank_policy.kind == "candidate" and prov.rerank_policy.rerank is False
    assert prov.model_dump()["rerank_policy"]["measured_ndcg10"] == {"recall": 0.76, "reranked": 0.63}
    assert prov.score.formed.startswith("the match probability of the vector score")

    # a kind the measurement kept reranked, and a kind it did not measure, are reranked
    for criteria in (["ginger fur"], ["no forehead stripes"]):
        res = search.search(SearchRequest("refs", criteria=criteria, top_k=8, top_n=5))
        assert res.provenance.reranked and res.provenance.rerank_status == "ok"
        assert all(h.rerank_score is not None for h in res.hits)
    assert rr.stats["scored_pairs"] == pairs + 16


def test_without_a_policy_every_kind_is_reranked(world: Any, make_png: Any) -> None:
    """The official behaviour for a checkpoint that records no policy (Qwen3-VL-Reranker)."""
    service, _, _, plain = world
    res = service(read_policy(plain)).search(SearchRequest("refs", candidate=decode_image(make_png(72, 72, 999)),
                                                           top_k=8, top_n=5))
    assert res.provenance.reranked and res.provenance.model_dump()["rerank_policy"] == {
        "kind": "candidate", "rerank": True, "measured_ndcg10": None, "calibration": None, "source": None}
    assert all(h.score == h.rerank_score for h in res.hits)


def test_the_app_serves_the_policy_of_the_checkpoint_it_loads(world: Any, tmp_path: Path) -> None:
    from rubricsearch.app.model_loading import load_reranker as app_load_reranker
    from rubricsearch.app.settings import Settings

    _, _, measured, _ = world
    settings = Settings(_env_file=None, data_dir=tmp_path, models={"reranker_model": str(measured), "dtype": "float32"})
    reranker, _, policy = app_load_reranker(settings, VisualPackages(PackageStore(tmp_path / "p")))
    try:
        assert not policy.for_kind("candidate").rerank and policy.for_kind("candidate").source == str(
            measured / POLICY_FILE)
    finally:
        reranker.close()


WRITTEN_BEFORE = {"kinds": {kind: {"recall_ndcg10": 0.5, "reranked_ndcg10": 0.7,
                                   "judgement_calibration": {"slope": 2.0, "intercept": -3.0}}
                            for kind in ("criteria", "negative")}}


def test_judgements_are_the_rerankers_p_yes_whatever_the_policy_file_says(world: Any) -> None:
    """A judgement means what the set's calibration says it means, never what a checkpoint's file does: a policy
    file that still carries a Platt fit of the judgements (as the demo trainer once wrote) leaves every
    per-criterion score the raw P(yes) (1 − P(X) for "no X"), and provenance names no such fit."""
    service, _, _, _ = world
    older = service(RerankPolicy.from_json(WRITTEN_BEFORE, "test"))
    raw = service(RerankPolicy())
    for criteria in (["ginger fur", "round ears"], ["ginger fur", "no round ears"]):
        request = SearchRequest("refs", criteria=criteria, top_k=10, top_n=10)
        got, plain = older.search(request), raw.search(request)
        by_sha = {h.sha256: h for h in plain.hits}
        assert got.hits and {h.sha256 for h in got.hits} == set(by_sha)
        for hit in got.hits:
            assert hit.criteria == pytest.approx(by_sha[hit.sha256].criteria, abs=1e-9)
        assert got.provenance.score.formed == plain.provenance.score.formed
        assert "judgement_calibration" not in got.provenance.model_dump()["rerank_policy"]
