"""Quality floors of the trained demo models on the held-out faces, through the product's search path, and
proof that they catch real bugs (``bench/quality.py`` measures the same; docs/demo.md).

Both demo models are trained once per session with the default plan (a few CPU-minutes) and loaded through
the real loaders into one :class:`~app.demo.search_eval.SearchBench` that every test shares. The floors sit
below what the models reached when they were set and above what each injected bug leaves: the breakdown
zipped to the wrong criteria (``SearchService._take_judgements``), the query embedded without its instruction, and
the query and document instructions swapped (``retrieval.search.service.build``, and the instruction the
references are embedded under), the overall score or negation formed wrongly (``rerank.rubric``), and the
reranker's measured policy ignored or looked up for the wrong query kind. Each bug is patched into the real
function and must fail the floors.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

import rubricsearch.rerank.rubric as rerank_rubric
import rubricsearch.retrieval.search.service as search_service
from rubricsearch.app.demo.checkpoints import DEMO_LABEL, DemoPlan
from rubricsearch.app.demo.evaluation import eval_queries, eval_set
from rubricsearch.app.demo.search_eval import SET_ID, Measurement, SearchBench, measure, quality
from rubricsearch.app.demo.training import Arch, base_checkpoint
from rubricsearch.app.demo.trust import Trust, measure_trust, single_criteria, trust_failures
from rubricsearch.rerank.rubric import QUERY_KINDS, KindPolicy, RubricReranker, read_policy
from rubricsearch.retrieval.search.instructions import QUERY_CANDIDATE_ONLY, QueryInstructions, Rubric
from rubricsearch.retrieval.search.protocol import Judged, ShortlistScores
from rubricsearch.retrieval.search.service import SearchHit, SearchService

pytestmark = pytest.mark.slow

# Every floor and margin sits below the spread of fresh trainings, so a fresh clone passes whatever processor
# trains its models: the same plan trains bit-identical models on one processor, but another processor's
# floating-point order is another run (docs/demo.md, "Reproducibility"). bench/demo_spread.py measured every
# number these tests guard over six seeds (0-5; 2026-12-06, docs/demo.md has the table): the least of each is in
# the comments, and each injected bug is detected on every seed, mostly relative to the same models unbugged.
# Breakdown AUC 0.867-0.966 (zipped to the wrong criteria 0.468-0.533); recall nDCG@10 candidate 0.742-0.800,
# candidate + criteria 0.699-0.742 (untrained 0.518, 0.521); reranking over recall order criteria +0.137,
# negative +0.244, candidate + criteria +0.054 at the least. Single-criterion recall (R@5 0.400-0.743, untrained
# 0.386) and criteria-only recall nDCG@10 (0.405-0.646, untrained 0.378) are not floored: one embedder in six
# does not learn them, and the reranker serves those searches (criteria met by the top 5 0.875 on that seed).
BREAKDOWN_AUC = 0.80
RERANK_GAIN = {"criteria": 0.10, "negative": 0.15, "candidate+criteria": 0.03}
NDCG_FLOORS = {"candidate": 0.70, "candidate+criteria": 0.65}
NDCG_MARGIN = 0.10
# What a user relies on (app/demo/trust.py): criteria met by the top 5 of two-criterion rubrics 0.856-0.975 (the
# overall score from the first or the best criterion alone: 0.119-0.300 less on each seed), single-criterion
# precision@5 0.886-1.0 and breakdown AUC 0.880-0.982, "no X" top 5 without X 0.923-0.985 (negation left to the
# model: 0.062-0.400), the identical image first and a match on every seed. Two seeds in six leave one of the 22
# criteria some reference meets without a hit at the threshold (best hit 0.090, 0.459).
TRUST_FLOORS = {"criteria_met_top5": 0.8, "single_precision5": 0.8, "single_auc": 0.8,
                "negative_without_top5": 0.8, "identical_candidate_matches": 1.0}
UNMATCHED = 1  # criteria some reference meets that may go without a hit at the threshold
AGGREGATE_MARGIN = 0.06  # criteria met by the top 5: how much less an overall score from one criterion must leave
SWAP_MARGIN = 0.02  # single-criterion R@5: how much less the instructions swapped must leave (0.043-0.314 measured)


def failures(m: Measurement) -> list[str]:
    """The floors this measurement misses (empty: all held)."""
    out = []
    if not m.breakdown.mean >= BREAKDOWN_AUC:
        out.append(f"breakdown AUC {m.breakdown.mean:.3f} < {BREAKDOWN_AUC}")
    for kind, floor in NDCG_FLOORS.items():
        if kind in m.kinds.before and not m.kinds.before[kind].ndcg10 >= floor:
            out.append(f"{kind} nDCG@10 {m.kinds.before[kind].ndcg10:.3f} < {floor}")
    return out


@pytest.fixture(scope="session")
def measured(bench: SearchBench) -> Measurement:
    return measure(bench)


@pytest.fixture(scope="session")
def trusted(bench: SearchBench) -> Trust:
    return measure_trust(bench)


def test_scores_a_user_can_trust(trusted: Trust, guarded: Any) -> None:
    guarded(criteria_met_top5=trusted.criteria_met_top5["product"], single_precision5=trusted.single_precision5,
            single_auc=trusted.single_auc, negative_without_top5=trusted.negative_without_top5,
            identical_candidate_matches=trusted.identical_candidate_matches,
            product_over_recall=trusted.criteria_met_top5["product"] - trusted.criteria_met_top5["recall"])
    assert trust_failures(trusted, TRUST_FLOORS, unmatched=UNMATCHED) == []
    # the overall score formed from the breakdown beats the recall order on the criteria it is asked (0.213-0.444)
    assert trusted.criteria_met_top5["product"] >= trusted.criteria_met_top5["recall"] + 0.1, trusted


def test_the_match_threshold_tells_the_truth(trusted: Trust, guarded: Any) -> None:
    """Issue 34 Deliver 4: the identical image as candidate is the first hit and a match (content identity), no
    statement that no face meets has a hit at or above the threshold (the reranker's P(yes)), and every
    single criterion that some reference meets has one, but for at most ``UNMATCHED``."""
    guarded(absent_hits_above=trusted.absent_hits_above, absent_best=max(trusted.absent_best.values()),
            criteria_without_match=len(trusted.criteria_without_match),
            weakest_best_match=min(trusted.best_match.values()))
    assert trusted.identical_candidate_matches == 1.0, trusted
    assert trusted.absent_hits_above == 0 and len(trusted.criteria_without_match) <= UNMATCHED, trusted


def test_criteria_served_as_another_kind_lose_their_matches(bench: SearchBench, monkeypatch: pytest.MonkeyPatch,
                                                            guarded: Any) -> None:
    """Every search classified as a candidate search (the policy looked up for the wrong kind): criteria are then
    served in recall order with the candidate kind's calibration, so they lose their precision or their matches."""
    monkeypatch.setattr(rerank_rubric, "query_kind", lambda rubric, has_candidate: "candidate")
    precision, _, missing = single_criteria(bench)
    guarded(bug_criteria_without_match=len(missing), bug_single_precision5=float(np.mean(precision)))
    assert len(missing) > UNMATCHED or float(np.mean(precision)) < TRUST_FLOORS["single_precision5"], (
        missing, precision)


def test_identity_rule_dropped_fails_the_floors(bench: SearchBench, monkeypatch: pytest.MonkeyPatch,
                                               guarded: Any) -> None:
    """Without the content-identity rule the models must recognise the candidate themselves: they do not."""
    monkeypatch.setattr(SearchService, "_identical", lambda self, req, rubric, qvec, results: None)
    t = measure_trust(bench)
    guarded(bug_identical_candidate_matches=t.identical_candidate_matches)
    broken = trust_failures(t, TRUST_FLOORS)
    assert any("identical_candidate_matches 0.000" in f for f in broken), broken


def test_rerank_policy_ignored_fails_the_floors(bench: SearchBench, monkeypatch: pytest.MonkeyPatch,
                                               guarded: Any) -> None:
    """Every kind reranked whatever the measurement said: the candidate kind then loses to recall order."""
    monkeypatch.setattr(RubricReranker, "kind_policy", lambda self, rubric, has_candidate: KindPolicy("criteria"))
    kinds = quality(bench, eval_queries(25, kinds=("candidate",)))
    guarded(bug_candidate_reranked_gain=kinds.after["candidate"].ndcg10 - kinds.before["candidate"].ndcg10)
    assert kinds.after["candidate"].ndcg10 < kinds.before["candidate"].ndcg10, kinds


def test_no_query_kind_loses_to_recall_order(measured: Measurement, demo_models: dict[str, Path],
                                             guarded: Any) -> None:
    """Issue 34 Deliver 3: as served (the reranker's measured policy), every kind at least matches recall
    order; the policy was measured by the trainer on faces the quality floors do not use."""
    policy = read_policy(demo_models["reranker"])
    assert set(policy.kinds) == set(QUERY_KINDS)
    guarded(**{f"served_gain_{kind}": measured.kinds.after[kind].ndcg10 - measured.kinds.before[kind].ndcg10
               for kind in QUERY_KINDS})
    for kind in QUERY_KINDS:
        before, after = measured.kinds.before[kind], measured.kinds.after[kind]
        assert after.ndcg10 >= before.ndcg10 - 1e-9, (kind, before, after, policy.for_kind(kind))


@pytest.mark.parametrize("wrong", [lambda scores: scores[0], max], ids=["first criterion", "best criterion"])
def test_overall_score_not_from_all_criteria_loses_criteria(bench: SearchBench, trusted: Trust,
                                                            monkeypatch: pytest.MonkeyPatch, wrong: Any,
                                                            guarded: Any) -> None:
    """Against the same models' measurement: a floor cannot tell, as the best seeds' bug leaves as much as the
    weakest seed's right aggregate."""
    monkeypatch.setattr(rerank_rubric, "aggregate", wrong)
    t = measure_trust(bench)
    guarded(bug_criteria_met_top5=t.criteria_met_top5["product"])
    right = trusted.criteria_met_top5["product"]
    assert t.criteria_met_top5["product"] <= right - AGGREGATE_MARGIN, (t.criteria_met_top5, right)


def test_negation_left_to_the_model_fails_the_floors(bench: SearchBench, monkeypatch: pytest.MonkeyPatch,
                                                      guarded: Any) -> None:
    monkeypatch.setattr(rerank_rubric, "judged", lambda c: Judged(c, c.strip(), False))
    t = measure_trust(bench)
    guarded(bug_negative_without_top5=t.negative_without_top5)
    broken = trust_failures(t, TRUST_FLOORS)
    assert any("negative_without_top5" in f for f in broken), broken


def test_trained_models_clear_the_floors(measured: Measurement, tmp_path: Path, guarded: Any) -> None:
    """The floors hold, and the same-size embedder with random weights stays under them: they measure learning."""
    guarded(single_r5=measured.single.before["criteria"].r5, breakdown_auc=measured.breakdown.mean,
            **{f"recall_ndcg10_{kind}": measured.kinds.before[kind].ndcg10 for kind in NDCG_FLOORS})
    assert failures(measured) == []
    untrained = base_checkpoint(tmp_path / "untrained", "embedding", arch=Arch(), seed=DemoPlan().seed)
    docs, images = eval_set(120)
    chance = SearchBench(str(untrained), None, docs, images)
    try:
        base = measure(chance)
    finally:
        chance.close()
    guarded(untrained_single_r5=base.single.before["criteria"].r5,
            **{f"untrained_ndcg10_{kind}": base.kinds.before[kind].ndcg10 for kind in NDCG_FLOORS})
    for kind in NDCG_FLOORS:
        assert measured.kinds.before[kind].ndcg10 >= base.kinds.before[kind].ndcg10 + NDCG_MARGIN, kind
    assert all(kind in " ".join(failures(base)) for kind in NDCG_FLOORS), failures(base)


def test_reranking_improves_ndcg(measured: Measurement, guarded: Any) -> None:
    """Reranking the shortlist beats recall order on every query kind with criteria."""
    for kind, gain in RERANK_GAIN.items():
        before, after = measured.kinds.before[kind], measured.kinds.after[kind]
        guarded(**{f"rerank_gain_{kind}": after.ndcg10 - before.ndcg10})
        assert after.ndcg10 >= before.ndcg10 + gain, (kind, before, after)


def _zipped_to_wrong_criteria(results: list[SearchHit], rubric: Rubric, scored: ShortlistScores) -> None:
    """``SearchService._take_judgements`` with the breakdown zipped to the criteria shifted by one."""
    shifted = rubric.criteria[1:] + rubric.criteria[:1]
    for hit, overall, per in zip(results, scored.overall, scored.per_criterion, strict=True):
        hit.rerank_score = overall
        hit.score = overall
        hit.criteria = dict(zip(shifted, per, strict=True))


def test_breakdown_zipped_to_the_wrong_criteria_fails_the_floors(bench: SearchBench, monkeypatch: pytest.MonkeyPatch,
                                                                  guarded: Any) -> None:
    monkeypatch.setattr(SearchService, "_take_judgements", staticmethod(_zipped_to_wrong_criteria))
    m = measure(bench, kinds=False)
    guarded(bug_breakdown_auc=m.breakdown.mean)
    broken = failures(m)
    assert any("breakdown AUC" in f for f in broken), broken


@pytest.fixture
def swapped(bench: SearchBench, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Queries embedded under the document instruction, references under a query instruction."""
    real = search_service.build

    def swap(rubric: Rubric, has_candidate: bool) -> QueryInstructions:
        instr = real(rubric, has_candidate)
        return QueryInstructions(query=instr.document, document=instr.query)

    monkeypatch.setattr(search_service, "build", swap)
    default = bench.embedder.default_instruction
    bench.embedder.default_instruction = QUERY_CANDIDATE_ONLY  # what ingestion's "no instruction" becomes
    try:
        bench.ingest(SET_ID)
        yield
    finally:
        bench.embedder.default_instruction = default
        bench.ingest(SET_ID)


@pytest.mark.usefixtures("swapped")
def test_query_and_document_instructions_swapped_lose_recall(bench: SearchBench, measured: Measurement,
                                                             guarded: Any) -> None:
    """Against the same models' recall (single-criterion R@5 spans the swapped bug's values over seeds). A query
    embedded without its instruction is not caught this way on every seed (one of six recalls as well without
    it): tests/test_search.py checks the instruction the query is embedded under."""
    m = measure(bench, kinds=False)
    guarded(bug_single_r5=m.single.before["criteria"].r5)
    right = measured.single.before["criteria"].r5
    assert m.single.before["criteria"].r5 <= right - SWAP_MARGIN, (m.single.before["criteria"], right)


def test_demo_fallback_serves_both_trained_models(demo_models: dict[str, Path], tmp_path: Path) -> None:
    """Models that are neither local nor cached are not fetched (that would retry for minutes): the demo
    embedder and reranker in the data dir serve, and the banner says so."""
    from rubricsearch.app.main import create_app
    from rubricsearch.app.settings import Settings

    data = tmp_path / "data"
    (data / "demo-models").mkdir(parents=True)
    for path in demo_models.values():
        (data / "demo-models" / path.name).symlink_to(path)
    settings = Settings(_env_file=None, data_dir=data, models={"embedding_model": "Qwen/Not-Downloaded-Embedding",
                                                               "reranker_model": "Qwen/Not-Downloaded-Reranker",
                                                               "fallback_to_test_models": True, "dtype": "float32"})
    with TestClient(create_app(settings)) as c:
        ready = c.get("/readyz").json()
        assert ready["test_models"] is True and ready["models_label"] == DEMO_LABEL
        r = c.post("/v1/embeddings", json={"input": "a"})
        assert r.status_code == 200 and r.json()["model"] == "demo-embedding"  # its id, never a path
        cards = c.get("/v1/models").json()["data"]
        assert {"demo-embedding", "demo-reranker"} <= {m["id"] for m in cards}, cards
        assert all(m["label"] == DEMO_LABEL for m in cards)  # one wording everywhere
        page = c.get("/").text
        assert "Demo models trained on generated faces" in page and "Offline test models" not in page
        assert "random-weight test reranker" not in page


def test_commands_after_the_demo_serve_its_models_without_waiting_for_a_hub(
        demo_models: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """After ``make demo`` the data dir holds the demo models: ``serve`` / ``search`` (no fallback setting) serve
    them when the hub does not answer, instead of retrying it for minutes and failing."""
    from rubricsearch.app.main import create_app
    from rubricsearch.app.settings import Settings

    data = tmp_path / "data"
    (data / "demo-models").mkdir(parents=True)
    for path in demo_models.values():
        (data / "demo-models" / path.name).symlink_to(path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    settings = Settings(_env_file=None, data_dir=data, models={"embedding_model": "Qwen/Not-Downloaded-Embedding",
                                                               "reranker_model": "Qwen/Not-Downloaded-Reranker",
                                                               "fallback_to_test_models": False, "dtype": "float32"})
    with TestClient(create_app(settings)) as c:
        assert c.get("/readyz").json()["models_label"] == DEMO_LABEL
        assert {m["id"] for m in c.get("/v1/models").json()["data"]} == {"demo-embedding", "demo-reranker"}
