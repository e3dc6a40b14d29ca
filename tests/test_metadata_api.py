"""Reference metadata and filtered search through the REST API, on tiny real checkpoints and the real FAISS
index and SQLite catalog: PATCH, manifest upload (all or nothing), JSONL export, hits carrying metadata, the
filter applied inside the vector search, and 422s that name what is wrong."""

from __future__ import annotations

import io
import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.state import AppState
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.index.filters import parse_filter
from tests.api_helpers import ADMIN_KEY, bearer, built_state, client_for, wait_job
from tests.conftest import TOWERS, noise_png

pytestmark = pytest.mark.timeout(300)
ADMIN = bearer(ADMIN_KEY)
N = 8


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, reranker_dir_for: Any
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "api-meta", tiny_embedding_dir, reranker_dir_for(TOWERS[0]),
                           ingest={"workers": 1}, packages={"storage_dtype": "float32"})


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


@pytest.fixture(scope="module")
def shas(client: TestClient) -> list[str]:
    """N references from a zip whose manifest.csv gives the even ones metadata."""
    assert client.post("/v1/sets", json={"name": "shoes"}, headers=ADMIN).status_code == 201
    images = [noise_png(40 + 4 * i, 56, 900 + i) for i in range(N)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i, data in enumerate(images):
            zf.writestr(f"img/{i}.png", data)
        rows = ["file,label,category,price,tags"] + [
            f"img/{i}.png,Shoe {i},{'boots' if i % 4 == 0 else 'sneakers'},{10 * i},a;b{i}" for i in range(0, N, 2)]
        zf.writestr("manifest.csv", "\n".join(rows) + "\n")
    job = client.post("/v1/sets/shoes/images", headers=ADMIN,
                      files=[("files", ("shoes.zip", buf.getvalue(), "application/zip"))]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded", job
    return [decode_image(d).sha256 for d in images]


def metadata_of(client: TestClient) -> dict[str, dict[str, Any]]:
    page = client.get("/v1/sets/shoes/images?limit=100", headers=ADMIN).json()
    return {img["sha256"]: img["metadata"] for img in page["data"]}


def search(client: TestClient, flt: Any, **extra: Any) -> Any:
    return client.post("/v1/search", headers=ADMIN, json={"set_id": "shoes", "rubric": "a shoe", "rerank": False,
                                                           "top_k": 50, "top_n": 0, "filter": flt, **extra})


def test_manifest_in_a_zip_lands_in_catalog_and_hits(client: TestClient, shas: list[str]) -> None:
    meta = metadata_of(client)
    assert meta[shas[0]] == {"label": "Shoe 0", "category": "boots", "price": 0, "tags": ["a", "b0"]}
    assert meta[shas[6]]["price"] == 60 and meta[shas[1]] == {}
    hits = search(client, None).json()["hits"]
    assert {h["image"]["sha256"]: h["image"]["metadata"] for h in hits} == meta


def test_value_counts(client: TestClient, shas: list[str]) -> None:
    got = client.get("/v1/sets/shoes/metadata/counts", headers=ADMIN).json()
    assert got["images"] == N
    assert got["fields"]["category"] == [{"value": "boots", "count": 2}, {"value": "sneakers", "count": 2}]
    assert got["fields"]["tags"][0] == {"value": "a", "count": 4} and len(got["fields"]["tags"]) == 5
    assert len(client.get("/v1/sets/shoes/metadata/counts?per_key=1", headers=ADMIN).json()["fields"]["tags"]) == 1


def test_filter_is_applied_inside_the_search(client: TestClient, shas: list[str], state: AppState) -> None:
    boots = {"must": [{"key": "category", "match": {"value": "boots"}}]}
    body = search(client, boots, top_k=2).json()
    # top_k=2 with 2 boots among 8: a search that trimmed an unfiltered top-2 would mostly miss them
    assert {h["image"]["sha256"] for h in body["hits"]} == {shas[0], shas[4]}
    assert body["provenance"]["filter"] == {"applied": boots, "matched": 2, "reason": None}
    ranged = search(client, {"must": [{"key": "price", "range": {"gte": 20, "lt": 60}}],
                             "must_not": [{"key": "tags", "match": {"any": ["b4"]}}]}).json()
    assert {h["image"]["sha256"] for h in ranged["hits"]} == {shas[2]}
    none = search(client, {"must": [{"key": "category", "match": {"value": "sandals"}}]})
    assert none.status_code == 200
    assert none.json()["hits"] == [] and "matches no reference" in none.json()["provenance"]["filter"]["reason"]
    f = parse_filter(boots)
    assert f is not None and state.index.count(body["provenance"]["set"]["id"], f) == 2


@pytest.mark.parametrize(("flt", "names"), [
    ({"must": [{"key": "category", "match": {"regex": "bo.*"}}]}, "'regex'"),
    ({"must": [{"key": "price", "range": {"between": [1, 2]}}]}, "'between'"),
    ({"must": [{"key": "price"}]}, "filter.must[0]"),
    ({"nope": []}, "'nope'"),
])
def test_malformed_filters_are_422_naming_the_part(client: TestClient, shas: list[str], flt: Any,
                                                   names: str) -> None:
    response = search(client, flt)
    assert response.status_code == 422, response.text
    assert names in response.text


def test_multipart_search_takes_a_filter(client: TestClient, shas: list[str]) -> None:
    form = {"set_id": "shoes", "rubric": "a shoe", "rerank": "false", "top_n": "0",
            "filter": json.dumps({"must": [{"key": "category", "match": {"value": "sneakers"}}]})}
    hits = client.post("/v1/search", headers=ADMIN, data=form).json()["hits"]
    assert {h["image"]["sha256"] for h in hits} == {shas[2], shas[6]}
    bad = client.post("/v1/search", headers=ADMIN, data={**form, "filter": "{not json"})
    assert bad.status_code == 422 and "not JSON" in bad.text


def test_patch_merges_removes_and_is_bounded(client: TestClient, shas: list[str]) -> None:
    url = f"/v1/sets/shoes/images/{shas[1]}"
    got = client.patch(url, headers=ADMIN, json={"metadata": {"label": "Odd one", "category": "boots", "x": 1}})
    assert got.status_code == 200 and got.json()["metadata"] == {"label": "Odd one", "category": "boots", "x": 1}
    got = client.patch(url, headers=ADMIN, json={"metadata": {"x": None}})
    assert got.json()["metadata"] == {"label": "Odd one", "category": "boots"}
    boots = search(client, {"must": [{"key": "category", "match": {"value": "boots"}}]}).json()["hits"]
    assert shas[1] in {h["image"]["sha256"] for h in boots}  # the index payload followed the catalog
    for bad, says in [({"k" + str(i): i for i in range(65)}, "at most 64 keys"),
                      ({"blob": "x" * 17_000}, "16384-byte"), ({"a": {"nested": 1}}, "not dict"),
                      ({"label": 3}, "label is a string"), ({"bad key": 1}, "invalid key")]:
        response = client.patch(url, headers=ADMIN, json={"metadata": bad})
        assert response.status_code == 422 and says in response.text, (bad, response.text)
    assert metadata_of(client)[shas[1]] == {"label": "Odd one", "category": "boots"}
    client.patch(url, headers=ADMIN, json={"metadata": {}, "replace": True})
    assert metadata_of(client)[shas[1]] == {}


def test_manifest_upload_is_all_or_nothing(client: TestClient, shas: list[str]) -> None:
    before = metadata_of(client)
    bad = "\n".join([json.dumps({"sha256": shas[3], "supplier": "B"}), json.dumps({"file": "img/99.png", "x": 1}),
                     "{broken", json.dumps({"file": "img/5.png", "deep": {"no": 1}})])
    response = client.post("/v1/sets/shoes/manifest", headers=ADMIN,
                           files={"file": ("manifest.jsonl", bad.encode(), "application/x-ndjson")})
    assert response.status_code == 422, response.text
    lines = sorted(e["line"] for e in response.json()["error"]["details"]["errors"])
    assert lines == [2, 3, 4]
    assert metadata_of(client) == before
    good = "file,supplier,price\nimg/3.png,B,35.5\nimg/5.png,C,\n"
    response = client.post("/v1/sets/shoes/manifest", headers=ADMIN,
                           files={"file": ("manifest.csv", good.encode(), "text/csv")})
    assert response.status_code == 200 and response.json() == {"rows": 2, "updated": 2}
    after = metadata_of(client)
    assert after[shas[3]] == {"supplier": "B", "price": 35.5} and after[shas[5]] == {"supplier": "C"}
    cheap = search(client, {"must": [{"key": "price", "range": {"gt": 35, "lt": 36}}]}).json()["hits"]
    assert [h["image"]["sha256"] for h in cheap] == [shas[3]]


def test_export_round_trips(client: TestClient, shas: list[str]) -> None:
    response = client.get("/v1/sets/shoes/manifest.jsonl", headers=ADMIN)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/x-ndjson")
    rows = [json.loads(line) for line in response.text.splitlines()]
    assert {r["sha256"] for r in rows} == set(shas)
    exported = {r.pop("sha256"): {k: v for k, v in r.items() if k != "file"} for r in rows}
    assert exported == metadata_of(client)
    again = client.post("/v1/sets/shoes/manifest", headers=ADMIN,
                        files={"file": ("manifest.jsonl", response.content, "application/x-ndjson")})
    assert again.status_code == 200 and metadata_of(client) == exported
