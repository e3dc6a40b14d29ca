"""A set's calibration through the API on tiny random-weight checkpoints: refit from cached packages (no vision
encode), cells scored exactly as search scores them, versions and staleness, the quality report, and the verdicts
every search hit and criterion cell carries (or, where the calibration does not apply, why not)."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.calibration import model_key, needs_refit, score_cells, set_lock
from rubricsearch.app.calibration_pairs import COHORT, same_subject_scores
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import ImageSource, JudgmentSpec, add_image, record_judgments, resolve_set
from rubricsearch.indexer.catalog.calibrations import latest_calibration, save_calibration
from rubricsearch.indexer.catalog.tables import JudgmentSource
from rubricsearch.rerank.calibration import MIN_JUDGMENTS
from rubricsearch.rerank.rubric import KindPolicy, RerankPolicy, RubricReranker
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.search import SearchRequest, SearchResult
from tests.api_helpers import ADMIN_KEY, bearer, data_url, one_state, wait_job
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(300)
CRITERIA = ["short fur", "triangular ears", "no forehead stripes", "green eyes"]
ADMIN = bearer(ADMIN_KEY)

state, client = one_state("api-calibration")


@pytest.fixture(scope="module")
def refs(client: TestClient) -> dict[str, int]:
    """16 references ingested through the API: catalog image id by sha256."""
    assert client.post("/v1/sets", json={"name": "judged"}, headers=ADMIN).status_code == 201
    images = [noise_png(40 + 4 * i, 56, 700 + i) for i in range(16)]
    job = client.post("/v1/sets/judged/images", headers=ADMIN,
                      files=[("files", (f"j{i}.png", d, "image/png")) for i, d in enumerate(images)]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    listed = client.get("/v1/sets/judged/images", params={"limit": 100}, headers=ADMIN).json()
    return {row["sha256"]: row["id"] for row in listed["data"]}


def judge(state: AppState, cells: list[tuple[int, str, bool]]) -> None:
    with state.catalog.write() as session:
        set_id = resolve_set(session, "judged").id
        record_judgments(session, set_id, [JudgmentSpec(i, c, h, JudgmentSource.API) for i, c, h in cells])


def refit(client: TestClient) -> dict[str, Any]:
    r = client.post("/v1/sets/judged/calibration", headers=ADMIN)
    assert r.status_code == 200, r.text
    return r.json()


def search(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/search", json={"set_id": "judged", "top_k": 16, "top_n": 16, **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_before_any_fit_there_is_no_calibration_and_no_verdict(client: TestClient, refs: dict[str, int]) -> None:
    assert client.get("/v1/sets/judged/calibration").status_code == 404
    quality = client.get("/v1/sets/judged/quality").json()
    assert quality["status"] == "not_fitted" and quality["calibration_version"] is None
    body = search(client, criteria=CRITERIA[:2])
    assert body["provenance"]["calibration"] is None
    assert all(h["verdict"] is None and h["criteria_verdicts"] == {} for h in body["hits"])


def test_too_few_judgments_are_said_and_keep_the_raw_behaviour(client: TestClient, state: AppState,
                                                             refs: dict[str, int]) -> None:
    ids = sorted(refs.values())
    judge(state, [(i, CRITERIA[0], k % 2 == 0) for k, i in enumerate(ids[:MIN_JUDGMENTS // 3])])
    fitted = refit(client)
    assert fitted["status"] == "too_few" and fitted["mapping"] is None and fitted["vision_encodes"] == 0
    assert str(MIN_JUDGMENTS) in fitted["reason"]
    body = search(client, criteria=CRITERIA[:1])
    use = body["provenance"]["calibration"]
    assert use["version"] == fitted["version"] and not use["applied"] and "too few" in use["reason"]
    assert all(h["verdict"] is None and h["probability"] is None for h in body["hits"])


def test_a_refit_scores_every_judged_cell_from_cached_packages(client: TestClient, state: AppState,
                                                             refs: dict[str, int]) -> None:
    ids = sorted(refs.values())
    rng = np.random.default_rng(5)
    judge(state, [(i, c, bool(rng.random() < 0.5)) for i in ids for c in CRITERIA])
    encodes = state.reranker.stats["vision_encodes"], state.embedder.stats["vision_encodes"]
    fitted = refit(client)
    assert (state.reranker.stats["vision_encodes"], state.embedder.stats["vision_encodes"]) == encodes
    assert fitted["vision_encodes"] == 0 and fitted["skipped"] == 0
    assert fitted["judgments"] == len(ids) * len(CRITERIA)  # the earlier cells were judged again, not added
    assert fitted["model_key"] == model_key(state.search.scorer)
    assert fitted["status"] in ("calibrated", "no_separation") and fitted["held_out"] is not None
    assert {row["criterion"] for row in fitted["per_criterion"]} == set(CRITERIA)
    assert sum(row["judgments"] for row in fitted["per_criterion"]) == fitted["judgments"]
    got = client.get("/v1/sets/judged/calibration").json()
    assert got["version"] == fitted["version"] and not got["stale"]["stale"]
    # the audit trail: the judgments it was fitted on, listed again
    listed = client.get("/v1/sets/judged/judgments", params={"until_id": got["max_judgment_id"], "limit": 1}).json()
    assert listed["total"] == got["judgments"]
    quality = client.get("/v1/sets/judged/quality").json()
    assert quality["calibration_version"] == fitted["version"] and quality["serving_model_key"] == fitted["model_key"]
    assert quality["overall"] == fitted["held_out"]["band"]
    assert_same_subject_reported(quality["same_subject"], state)


def assert_same_subject_reported(reported: dict[str, Any], state: AppState) -> None:
    """The quality report's candidate-only part says what the same-subject fit measured: its pairs (same and not),
    status and reason, and the held-out band, or that the pairs are too few, and how many are needed."""
    with state.catalog.read() as session:
        saved = latest_calibration(session, resolve_set(session, "judged").id)
    assert saved is not None and saved.candidate is not None
    pairs = saved.candidate
    assert (reported["status"], reported["reason"], reported["pairs"]) == (pairs.status, pairs.reason, pairs.judgments)
    counted = pairs.per_criterion[0] if pairs.per_criterion else None
    assert (reported["same"], reported["different"]) == ((counted.yes, counted.no) if counted else (0, 0))
    assert reported["same"] + reported["different"] == reported["pairs"]
    if pairs.held_out is None:
        assert reported["status"] == "too_few" and reported["held_out"] is None and "needed" in reported["reason"]
    else:
        assert reported["held_out"] == pairs.to_json()["held_out"]["band"]


def test_a_judged_cell_scores_what_search_gives_that_cell(client: TestClient, state: AppState,
                                                         refs: dict[str, int]) -> None:
    body = search(client, criteria=[CRITERIA[2]])
    shas = [h["image"]["sha256"] for h in body["hits"]]
    usage = Usage()
    scored = score_cells(state.search.scorer, state.search.resolve_reference, [(s, CRITERIA[2]) for s in shas],
                         usage=usage, batch=5)
    assert scored == pytest.approx([h["criteria"][CRITERIA[2]] for h in body["hits"]], abs=1e-5)
    assert usage.total() == 0


def test_every_hit_and_cell_of_a_criteria_search_carries_its_verdict(client: TestClient, state: AppState,
                                                                    refs: dict[str, int]) -> None:
    with state.catalog.read() as session:
        calibration = latest_calibration(session, resolve_set(session, "judged").id)
    assert calibration is not None and calibration.applies
    body = search(client, criteria=CRITERIA[:2])
    use = body["provenance"]["calibration"]
    assert use["applied"] and use["version"] == calibration.version and use["method"] == calibration.mapping.method
    for hit in body["hits"]:
        cells = hit["criteria_verdicts"]
        assert set(cells) == set(CRITERIA[:2])
        raw = [hit["criteria"][c] for c in CRITERIA[:2]]
        assert [cells[c]["probability"] for c in CRITERIA[:2]] == pytest.approx(calibration.probability(raw).tolist())
        assert [cells[c]["verdict"] for c in CRITERIA[:2]] == calibration.verdicts(raw)
        verdicts = {cells[c]["verdict"] for c in CRITERIA[:2]}
        want = "match" if verdicts == {"match"} else "no_match" if "no_match" in verdicts else "uncertain"
        assert hit["verdict"] == want
        assert hit["probability"] == pytest.approx(math.prod(cells[c]["probability"] for c in CRITERIA[:2]))
    with_candidate = search(client, criteria=CRITERIA[:2], image=data_url(noise_png(64, 64, 1)))
    assert not with_candidate["provenance"]["calibration"]["applied"]
    assert all(h["verdict"] is None for h in with_candidate["hits"])


def test_a_calibration_of_another_reranker_gives_no_verdict(client: TestClient, state: AppState,
                                                            refs: dict[str, int]) -> None:
    with state.catalog.write() as session:
        set_id = resolve_set(session, "judged").id
        mine = latest_calibration(session, set_id)
        assert mine is not None
        other = save_calibration(session, set_id, replace(mine, model_key="someone/else@main"))
    body = search(client, criteria=CRITERIA[:1])
    use = body["provenance"]["calibration"]
    assert use["version"] == other.version and not use["applied"] and "another reranker" in use["reason"]
    assert all(h["verdict"] is None for h in body["hits"])
    quality = client.get("/v1/sets/judged/quality").json()
    assert "another reranker" in quality["reason"]
    assert refit(client)["version"] == other.version + 1  # and a refit serves again


def test_judgments_recorded_or_replaced_since_the_fit_make_it_stale(client: TestClient, state: AppState,
                                                                   refs: dict[str, int]) -> None:
    fitted = client.get("/v1/sets/judged/calibration").json()
    ids = sorted(refs.values())
    judge(state, [(ids[0], "a new criterion", True)])
    judge(state, [(ids[1], CRITERIA[0], not _holds(state, ids[1], CRITERIA[0]))])
    stale = client.get("/v1/sets/judged/calibration").json()["stale"]
    # recorded through the catalog, where no refitter hears of it: nothing is scheduled (tests/test_refits.py)
    assert stale == {"stale": True, "new": 2, "gone": 1, "refit_pending": False}
    assert client.get("/v1/sets/judged/quality").json()["stale"] == stale
    assert refit(client)["judgments"] == fitted["judgments"] + 1


def _holds(state: AppState, image_id: int, criterion: str) -> bool:
    from rubricsearch.indexer.catalog import JudgmentFilter, list_judgments

    with state.catalog.read() as session:
        set_id = resolve_set(session, "judged").id
        return list_judgments(session, set_id, JudgmentFilter(image_id=image_id, criterion=criterion))[0].holds


def test_unknown_sets_and_readers_without_admin_rights_are_refused(client: TestClient, refs: dict[str, int]
                                                                   ) -> None:
    assert client.post("/v1/sets/nope/calibration", headers=ADMIN).status_code == 404
    assert client.get("/v1/sets/nope/quality").status_code == 404
    assert client.post("/v1/sets/judged/calibration").status_code == 401


def test_criteria_the_policy_serves_in_recall_order_have_no_cell_to_score(state: AppState, refs: dict[str, int]
                                                                          ) -> None:
    """A measured policy that keeps the recall order for plain criteria: search gives them no cell, so neither
    does the refit (their judgments are skipped); absences ("no X", another kind) are still judged."""
    stepped = KindPolicy("criteria", rerank=False, measured={"recall": 0.9, "reranked": 0.5}, calibration=(1.0, 0.0))
    scorer = RubricReranker(state.reranker, RerankPolicy({"criteria": stepped}))
    shas = sorted(refs)[:3]
    usage = Usage()
    scored = score_cells(scorer, state.search.resolve_reference, [(s, c) for s in shas for c in CRITERIA[1:3]],
                         usage=usage)
    assert [x is None for x in scored] == [True, False] * 3 and usage.total() == 0


def test_judgments_of_references_not_indexed_yet_are_skipped_not_lost(client: TestClient, state: AppState,
                                                                      refs: dict[str, int]) -> None:
    with state.catalog.write() as session:
        set_id = resolve_set(session, "judged").id
        pending = add_image(session, set_id, sha256="ab" * 32, byte_size=1, source=ImageSource.UPLOAD)[0]
    judge(state, [(pending.id, CRITERIA[0], True)])
    fitted = refit(client)
    assert fitted["skipped"] == 1 and fitted["held_out"]["band"]["judgments"] == fitted["judgments"] - 1
    assert client.get("/v1/sets/judged/calibration").json()["stale"] == {"stale": False, "new": 0, "gone": 0,
                                                                         "refit_pending": False}


@pytest.mark.parametrize("cohort", [5, COHORT])
def test_a_candidate_alone_is_normalised_over_its_cohort_whatever_top_k(state: AppState, refs: dict[str, int],
                                                                        cohort: int) -> None:
    """The score a candidate-only verdict reads is sigmoid((s − mean) / std) over the set's best ``cohort`` recall
    scores against the candidate, its own image left out: the same z for the same hit at top_k 3 (the cohort read
    from the index) and 30 (from the shortlist, here the whole set)."""
    with state.catalog.read() as session:
        set_id = resolve_set(session, "judged").id
    itself = sorted(refs)[0]

    def searched(top_k: int) -> SearchResult:
        return state.search.search(SearchRequest(set_id=set_id, candidate=state.search.resolve_reference(itself),
                                                 top_k=top_k, top_n=top_k, rerank=False, known_set=True,
                                                 cohort=cohort))

    few, many = searched(3), searched(30)
    assert len(many.hits) == len(refs) and many.hits[0].sha256 == itself and many.hits[0].identical
    others = sorted((h.ann_score for h in many.hits if h.sha256 != itself), reverse=True)[:cohort]
    assert few.cohort == pytest.approx(others) and many.cohort == pytest.approx(others)
    mean, std = float(np.mean(others)), float(np.std(others))
    by_sha = dict(zip((h.sha256 for h in many.hits), same_subject_scores(many), strict=True))
    for hit, z in zip(few.hits, same_subject_scores(few), strict=True):
        assert z == pytest.approx(by_sha[hit.sha256])
        assert z == pytest.approx(1 / (1 + math.exp(-(hit.ann_score - mean) / std)))


def test_a_candidate_fit_of_the_shown_score_is_refitted_before_it_gives_verdicts(client: TestClient, state: AppState,
                                                                                refs: dict[str, int]) -> None:
    with state.catalog.read() as session:
        set_id = resolve_set(session, "judged").id
    with set_lock(set_id):  # the refitter's look would refit it meanwhile
        with state.catalog.write() as session:
            mine = latest_calibration(session, set_id)
            assert mine is not None and mine.candidate is not None and mine.candidate.reads == "cohort_z"
            old = save_calibration(session, set_id, replace(mine, candidate=replace(mine.candidate, reads="score")))
        assert needs_refit(state.catalog, state.search, set_id)
        body = search(client, image={"image_id": sorted(refs)[0]})
    use = body["provenance"]["calibration"]
    assert use["version"] == old.version and use["fitted_to"] == "same_subject" and use["reads"] == "score"
    assert not use["applied"] and "refit" in use["reason"] and all(h["verdict"] is None for h in body["hits"])
    again = refit(client)
    assert again["candidate"]["reads"] == "cohort_z" and not needs_refit(state.catalog, state.search, set_id)
    use = search(client, image={"image_id": sorted(refs)[0]})["provenance"]["calibration"]
    assert use["version"] == again["version"] and use["reads"] == "cohort_z"
    assert use["applied"] == (again["candidate"]["status"] != "too_few"), use
