"""POST /v1/search on tiny real checkpoints: scores equal direct embedder/reranker calls, references are never
re-encoded (vision counters), JSON and multipart forms agree, provenance and the error paths.

The module runs twice: with a reranker whose vision tower equals the embedder's and with one whose tower
differs, references ingested through the API both times (ingestion builds a package per distinct tower)."""

from __future__ import annotations

import math
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from rubricsearch.rerank.protocol import Pair
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content
from tests.api_helpers import ADMIN_KEY, bearer, client_for, data_url, tower_states, wait_job
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(180)
DIMS = 96
CRITERIA = ["short fur", "triangular ears"]


state = tower_states("api-search")


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


@pytest.fixture(scope="module")
def refs(client: TestClient) -> dict[str, bytes]:
    """12 references ingested through the API (a set with Matryoshka dimensions), by sha256."""
    admin = bearer(ADMIN_KEY)
    assert client.post("/v1/sets", json={"name": "refs", "dimensions": DIMS}, headers=admin).status_code == 201
    images = [noise_png(48 + 8 * i, 72, 300 + i) for i in range(12)]
    job = client.post("/v1/sets/refs/images", headers=admin,
                      files=[("files", (f"r{i}.png", d, "image/png")) for i, d in enumerate(images)]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    return {decode_image(d).sha256: d for d in images}


def counters(state: AppState) -> tuple[int, int]:
    return state.embedder.stats["vision_encodes"], state.reranker.stats["vision_encodes"]


def search(client: TestClient, **body: Any) -> dict[str, Any]:
    r = client.post("/v1/search", json={"set_id": "refs", **body})
    assert r.status_code == 200, r.text
    return r.json()


def test_scores_equal_direct_calls_and_references_are_not_reencoded(
        client: TestClient, state: AppState, refs: dict[str, bytes]) -> None:
    candidate = noise_png(80, 80, 999)
    before = counters(state)
    body = search(client, criteria=CRITERIA, image=data_url(candidate), top_k=8, top_n=5)
    after = counters(state)
    shared = state.packages.describe()["shared"]
    # only the new candidate was encoded, once per distinct tower; no reference
    assert after[0] - before[0] == 1 and after[1] - before[1] == (0 if shared else 1)
    prov = body["provenance"]
    assert prov["vision_encodes"] == (1 if shared else 2) and prov["reranked"] and prov["rerank_status"] == "ok"
    assert prov["vision"]["reference"] == 0 and prov["vision"]["towers_shared"] is shared
    assert state.packages.encode_counts().keys() >= {("embedding", state.embedder.packages.fingerprint.short,
                                                      "ingest")}
    assert prov["criteria"] == CRITERIA and prov["dimensions"] == DIMS and prov["set"]["name"] == "refs"
    assert prov["embedding_model"]["id"] == state.embedder.model_id
    assert body["test_models"] is True and body["candidate"] == {"sha256": decode_image(candidate).sha256}
    assert set(body["timings_ms"]) == {"query_embedding", "ann", "rerank"}
    hits = body["hits"]
    assert [h["rank"] for h in hits] == [1, 2, 3, 4, 5]
    assert [h["score"] for h in hits] == sorted((h["score"] for h in hits), reverse=True)

    emb, rr = state.embedder, state.reranker
    qvec = emb.embed([{"image": candidate, "text": "; ".join(CRITERIA),
                       "instruction": prov["instructions"]["query"]}], dimensions=DIMS)[0]
    for hit in hits:
        ref = refs[hit["image"]["sha256"]]
        assert hit["image"]["url"] == f"/v1/images/{hit['image']['sha256']}"
        dvec = emb.embed([{"image": ref}], dimensions=DIMS)[0]
        assert abs(float(qvec @ dvec) - hit["ann_score"]) <= 1e-5
        logs = []
        for crit, instruction in zip(CRITERIA, prov["instructions"]["per_criterion"], strict=True):
            one = rr.score_pairs([Pair(Content(texts=[crit], images=[decode_image(candidate)]),
                                       Content(images=[decode_image(ref)]), instruction)])[0]
            assert abs(one - hit["criteria"][crit]) <= 1e-5
            logs.append(math.log(one))
        # the overall score is the geometric mean of the breakdown beside it
        assert abs(math.exp(sum(logs) / len(logs)) - hit["rerank_score"]) <= 1e-5
        assert hit["score"] == hit["rerank_score"]


def test_ingested_candidate_costs_no_vision_run(client: TestClient, state: AppState, refs: dict[str, bytes]) -> None:
    sha = next(iter(refs))
    before = counters(state)
    body = search(client, rubric="same coat", image={"image_id": sha.upper()}, top_k=12, top_n=12)
    assert counters(state) == before and body["provenance"]["vision_encodes"] == 0
    assert body["candidate"] == {"sha256": sha} and len(body["hits"]) == 12
    # it is a reference of the set: marked, and with a criterion the criterion still decides its score
    assert [h["image"]["sha256"] for h in body["hits"] if h["identical"]] == [sha]
    assert body["provenance"]["identical"]["found"] == "same bytes (sha256) as the candidate"
    marked = next(h for h in body["hits"] if h["identical"])
    assert marked["score"] == marked["rerank_score"]


@pytest.mark.parametrize("how", ["image_id", "bytes"])
def test_a_reference_as_the_candidate_is_the_first_match(client: TestClient, refs: dict[str, bytes],
                                                         how: str) -> None:
    """The identical image is a match by content identity (same sha256), whatever the (random) models think."""
    for sha in list(refs)[:3]:
        image = {"image_id": sha} if how == "image_id" else data_url(refs[sha])
        hits = search(client, image=image, top_k=12, top_n=5)["hits"]
        assert hits[0]["image"]["sha256"] == sha and hits[0]["identical"] and hits[0]["score"] == 1.0
        assert not any(h["identical"] for h in hits[1:]) and all(h["score"] < 1.0 for h in hits[1:])


def test_multipart_form_equals_json(client: TestClient, refs: dict[str, bytes]) -> None:
    candidate = noise_png(64, 40, 1234)
    as_json = search(client, criteria=CRITERIA, image=data_url(candidate), top_k=6, top_n=4)
    r = client.post("/v1/search", data={"set_id": "refs", "criteria": "\n".join(CRITERIA), "top_k": "6",
                                        "top_n": "4"}, files={"image": ("c.png", candidate, "image/png")})
    assert r.status_code == 200, r.text
    form = r.json()
    assert [h["image"]["sha256"] for h in form["hits"]] == [h["image"]["sha256"] for h in as_json["hits"]]
    for a, b in zip(form["hits"], as_json["hits"], strict=True):
        assert abs(a["score"] - b["score"]) <= 1e-6 and a["criteria"].keys() == b["criteria"].keys()
    sha = next(iter(refs))
    by_sha = client.post("/v1/search", data={"set_id": "refs", "rubric": "x", "image": sha, "rerank": "false"})
    assert by_sha.status_code == 200 and by_sha.json()["candidate"] == {"sha256": sha}


def test_text_only_recall_only_and_top_n_zero(client: TestClient, refs: dict[str, bytes]) -> None:
    text = search(client, rubric="dark forehead stripes", top_k=5, top_n=3)
    assert len(text["hits"]) == 3 and text["candidate"] is None
    assert text["provenance"]["instructions"]["query"].startswith("Retrieve reference images that show")
    recall = search(client, rubric="dark forehead stripes", top_k=5, top_n=3, rerank=False)
    assert not recall["provenance"]["reranked"] and all(h["rerank_score"] is None for h in recall["hits"])
    assert [h["score"] for h in recall["hits"]] == [h["ann_score"] for h in recall["hits"]]
    everything = search(client, rubric="stripes", top_k=7, top_n=0)
    assert len(everything["hits"]) == 7 and everything["provenance"]["rerank_status"] == "skipped: top_n=0"


def test_search_errors(client: TestClient, state: AppState, refs: dict[str, bytes],
                       monkeypatch: pytest.MonkeyPatch) -> None:
    def err(r: Any, status: int, kind: str) -> None:
        assert r.status_code == status, r.text
        assert r.json()["error"]["type"] == kind

    err(client.post("/v1/search", json={"set_id": "nope", "rubric": "x"}), 404, "not_found")
    err(client.post("/v1/search", json={"set_id": "refs", "image": {"image_id": "ab" * 32}}), 404, "not_found")
    err(client.post("/v1/search", json={"set_id": "refs"}), 400, "invalid_input")
    err(client.post("/v1/search", json={"set_id": "refs", "criteria": [f"c{i}" for i in range(20)]}), 400,
        "invalid_input")
    err(client.post("/v1/search", json={"set_id": "refs", "image": "http://example.org/a.png"}), 400,
        "invalid_image")
    err(client.post("/v1/search", json={"set_id": "refs", "image": data_url(b"not an image")}), 400,
        "invalid_image")
    err(client.post("/v1/search", json={"set_id": "refs", "rubric": "x", "top_k": 0}), 422, "validation_error")
    err(client.post("/v1/search", json={"rubric": "x"}), 422, "validation_error")
    err(client.post("/v1/search", json={"set_id": "refs", "rubric": "x", "extra": 1}), 422, "validation_error")
    err(client.post("/v1/search", content=b"{not json", headers={"Content-Type": "application/json"}), 422,
        "validation_error")
    err(client.post("/v1/search", content=b"rubric", headers={"Content-Type": "text/plain"}), 415,
        "unsupported_media_type")
    err(client.post("/v1/search", data={"set_id": "refs", "rubric": "x", "rerank": "maybe"}), 422,
        "validation_error")
    monkeypatch.setattr("rubricsearch.app.settings.MAX_IMAGE_BYTES", 1024)
    small = TestClient(create_app(state.settings, state=state), raise_server_exceptions=False)
    big = noise_png(300, 300, 5)
    err(small.post("/v1/search", json={"set_id": "refs", "image": data_url(big)}), 413, "payload_too_large")
    err(small.post("/v1/search", data={"set_id": "refs"}, files={"image": ("b.png", big, "image/png")}), 413,
        "payload_too_large")
    closed = client_for(state, auth={"search_requires_key": True})
    err(closed.post("/v1/search", json={"set_id": "refs", "rubric": "x"}), 401, "unauthorized")


def test_openapi_documents_the_multimodal_search(client: TestClient) -> None:
    doc = client.app.openapi()  # type: ignore[attr-defined]
    body = doc["paths"]["/v1/search"]["post"]["requestBody"]["content"]
    assert {"rubric_and_image", "ingested_candidate", "text_only"} <= set(body["application/json"]["examples"])
    form = body["multipart/form-data"]["schema"]  # the form model's own schema: FastAPI validates against it
    assert {"type": "string", "contentMediaType": "application/octet-stream"} in form["properties"]["image"]["anyOf"]
    assert form["required"] == ["set_id"] and {"criteria", "top_k", "top_n", "rerank", "filter"} <= set(
        form["properties"])
    assert body["application/json"]["schema"] == {"$ref": "#/components/schemas/SearchBody"}
    assert "ImageId" in doc["components"]["schemas"]
    for name in ("SearchResponse", "SetCreate", "SetOut", "ImageOut", "JobOut", "ImportRequest"):
        assert doc["components"]["schemas"][name]["examples"], name
    events = doc["paths"]["/v1/jobs/{job_id}/events"]["get"]["responses"]["200"]["content"]
    assert "text/event-stream" in events
