"""``POST /v1/sets/{set}/evidence`` and ``explain`` on ``POST /v1/search`` on tiny real checkpoints: the maps' shape,
no vision-tower run for references, the same judgement as the search's, the bound on hits, and the errors."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.schemas.evidence import EXPLAIN_MAX_HITS
from rubricsearch.app.state import AppState
from rubricsearch.rerank.evidence import DEFAULT_METHOD
from rubricsearch.retrieval.images import decode_image
from tests.api_helpers import ADMIN_KEY, bearer, client_for, data_url, one_state, wait_job
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(180)
state, client = one_state("api-evidence")
CRITERIA = ["dark forehead stripes", "no round ears"]


@pytest.fixture(scope="module")
def refs(client: TestClient) -> list[str]:
    """7 references of different sizes ingested through the API; their sha256s."""
    admin = bearer(ADMIN_KEY)
    assert client.post("/v1/sets", json={"name": "refs"}, headers=admin).status_code == 201
    images = [noise_png(64 + 16 * i, 48 + 8 * (i % 3), 500 + i) for i in range(7)]
    job = client.post("/v1/sets/refs/images", headers=admin,
                      files=[("files", (f"r{i}.png", d, "image/png")) for i, d in enumerate(images)]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    return [decode_image(d).sha256 for d in images]


def test_evidence_route_maps_a_reference_from_its_package(
        client: TestClient, state: AppState, refs: list[str], count_tower: Callable[[Any], Any]) -> None:
    counter = count_tower(state.reranker.runtime.loaded.model.visual)  # type: ignore[attr-defined]
    (image,) = [i for i in client.get("/v1/sets/refs/images").json()["data"] if i["sha256"] == refs[3]]
    assert (image["width"], image["height"]) == (112, 48)
    r = client.post("/v1/sets/refs/evidence", json={"image_id": refs[3], "criterion": "no round ears"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert counter.calls == 0 and body["vision_encodes"] == 0
    assert body["available"] and body["reason"] is None and body["method"] == DEFAULT_METHOD
    assert (body["statement"], body["of"]) == ("round ears", "positive statement")
    (ref,) = body["images"]
    assert (ref["role"], ref["sha256"], ref["width"], ref["height"]) == ("document", refs[3], image["width"],
                                                                         image["height"])
    assert len(ref["values"]) == ref["rows"] and {len(row) for row in ref["values"]} == {ref["cols"]}
    assert ref["boxes"][-1][-1][2:] == pytest.approx([image["width"], image["height"]])
    by_id = client.post("/v1/sets/refs/evidence", json={"image_id": str(image["id"]), "criterion": "no round ears",
                                                        "method": "occlusion"}).json()
    assert by_id["method"] == "occlusion" and by_id["p_yes"] == pytest.approx(body["p_yes"], abs=1e-5)


def test_explain_on_search_gives_the_top_hits_the_searched_judgement(
        client: TestClient, state: AppState, refs: list[str], count_tower: Callable[[Any], Any]) -> None:
    candidate = noise_png(72, 72, 999)
    search = {"set_id": "refs", "criteria": CRITERIA, "image": data_url(candidate), "top_k": 7, "top_n": 7}
    client.post("/v1/search", json=search)  # the candidate's package is cached by the first search
    counter = count_tower(state.reranker.runtime.loaded.model.visual)  # type: ignore[attr-defined]
    r = client.post("/v1/search", json={**search, "explain": True, "explain_candidate": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert counter.calls == 0 and "evidence" in body["timings_ms"]
    hits = body["hits"]
    assert len(hits) == 7 and all(h["evidence"] == [] for h in hits[EXPLAIN_MAX_HITS:])
    for hit in hits[:EXPLAIN_MAX_HITS]:
        assert [e["criterion"] for e in hit["evidence"]] == CRITERIA
        for e in hit["evidence"]:
            score = hit["criteria"][e["criterion"]]  # the raw judgement: the tiny checkpoint has no calibration
            assert (1 - e["p_yes"] if e["of"] == "positive statement" else e["p_yes"]) == pytest.approx(score, abs=1e-4)
            assert [m["role"] for m in e["images"]] == ["query", "document"] and e["vision_encodes"] == 0
            assert e["images"][1]["sha256"] == hit["image"]["sha256"]
    one = client.post("/v1/search", json={**search, "explain": ["no round ears"]}).json()
    assert [[e["criterion"] for e in h["evidence"]] for h in one["hits"][:EXPLAIN_MAX_HITS]] == [["no round ears"]] * 5
    for hit, explained in zip(one["hits"][:EXPLAIN_MAX_HITS], hits[:EXPLAIN_MAX_HITS], strict=True):
        # the candidate's maps come only when asked for
        (e,) = hit["evidence"]
        assert [(m["role"], m["sha256"]) for m in e["images"]] == [("document", hit["image"]["sha256"])]
        (same,) = [x for x in explained["evidence"] if x["criterion"] == "no round ears"]
        if explained["image"]["sha256"] == hit["image"]["sha256"]:
            flat = [v for row in e["images"][0]["values"] for v in row]
            assert flat == pytest.approx([v for row in same["images"][1]["values"] for v in row], rel=1e-3, abs=1e-5)
    assert "evidence" not in client.post("/v1/search", json=search).json()["timings_ms"]


def test_bad_evidence_requests_are_refused(client: TestClient, refs: list[str]) -> None:
    def error(r: Any) -> tuple[int, str]:
        return r.status_code, r.json()["error"]["type"]

    assert error(client.post("/v1/sets/refs/evidence", json={"image_id": "f" * 64, "criterion": "x"})) == (
        404, "not_found")
    assert error(client.post("/v1/sets/nope/evidence", json={"image_id": refs[0], "criterion": "x"})) == (
        404, "not_found")
    assert error(client.post("/v1/sets/refs/evidence", json={"image_id": refs[0], "criterion": "x",
                                                            "method": "saliency"}))[0] == 422
    assert error(client.post("/v1/sets/refs/evidence", json={"image_id": refs[0], "criterion": ""}))[0] == 422
    assert error(client.post("/v1/search", json={"set_id": "refs", "criteria": CRITERIA,
                                                 "explain": ["blue eyes"]})) == (400, "invalid_input")
    assert error(client.post("/v1/search", json={"set_id": "refs", "rubric": "a cat", "explain": True})) == (
        400, "invalid_input")


@pytest.mark.parametrize("method", ["integrated_gradients", "attention"])
def test_the_method_asked_for_is_the_one_named(client: TestClient, refs: list[str], method: str) -> None:
    r = client.post("/v1/sets/refs/evidence", json={"image_id": refs[0], "criterion": "round ears", "method": method})
    assert r.status_code == 200, r.text
    assert r.json()["method"] == method and r.json()["vision_encodes"] == 0 and r.json()["images"][0]["values"]


def test_without_a_local_reranker_evidence_says_it_is_unavailable(state: AppState, refs: list[str]) -> None:
    bare = client_for(dataclasses.replace(state, reranker_=None))
    body = bare.post("/v1/sets/refs/evidence", json={"image_id": refs[0], "criterion": "round ears"}).json()
    assert body["available"] is False and "no reranker" in body["reason"] and body["images"] == []
