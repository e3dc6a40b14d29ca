"""Judgments through the REST API, on tiny real checkpoints, the real index and catalog: record one or a
list (replacing a cell), undo, list with filters and pages, JSONL export and import, derive from metadata, the
judgment beside the model's on every search hit, who may write, and bad input answered with a 4xx that changes
nothing; on SQLite and (when configured) PostgreSQL catalogs."""

from __future__ import annotations

import contextlib
import io
import json
import zipfile
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog.judgments import MAX_BATCH
from rubricsearch.retrieval.images import decode_image
from tests.api_helpers import ADMIN_KEY, SEARCH_KEY, bearer, built_state, client_for, wait_job
from tests.conftest import TOWERS, noise_png
from tests.conftest_catalog import CATALOG_BACKENDS, postgres_schema

pytestmark = pytest.mark.timeout(300)
ADMIN = bearer(ADMIN_KEY)
N = 4
BREEDS = ["tabby", "siamese", "tabby", "siamese"]
URL = "/v1/sets/cats/judgments"


@pytest.fixture(scope="module", params=CATALOG_BACKENDS)
def state(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
          reranker_dir_for: Callable[[str], Path]) -> Iterator[AppState]:
    """The app on a SQLite catalog, and (when configured) on a PostgreSQL one."""
    with contextlib.ExitStack() as stack:
        database = stack.enter_context(postgres_schema()) if request.param == "postgres" else None
        yield from built_state(tmp_path_factory, "api-judgments", tiny_embedding_dir, reranker_dir_for(TOWERS[0]),
                               database_url=database, ingest={"workers": 1}, packages={"storage_dtype": "float32"})


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


@pytest.fixture(scope="module")
def shas(client: TestClient) -> list[str]:
    """N references whose manifest gives each a breed."""
    assert client.post("/v1/sets", json={"name": "cats"}, headers=ADMIN).status_code == 201
    images = [noise_png(40 + 4 * i, 48, 300 + i) for i in range(N)]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i, data in enumerate(images):
            zf.writestr(f"img/{i}.png", data)
        zf.writestr("manifest.csv", "file,breed\n" + "".join(f"img/{i}.png,{b}\n" for i, b in enumerate(BREEDS)))
    job = client.post("/v1/sets/cats/images", headers=ADMIN,
                      files=[("files", ("cats.zip", buf.getvalue(), "application/zip"))]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded", job
    return [decode_image(d).sha256 for d in images]


@pytest.fixture
def clean(client: TestClient, shas: list[str]) -> list[str]:
    """The references, with no judgment recorded."""
    assert client.delete(f"{URL}?all=true", headers=ADMIN).status_code == 200
    return shas


def cells(client: TestClient, **query: Any) -> dict[tuple[str, str], bool]:
    got = client.get(URL, params={"limit": 1000, **query}, headers=ADMIN)
    assert got.status_code == 200, got.text
    return {(j["sha256"], j["criterion"]): j["holds"] for j in got.json()["data"]}


def test_record_replace_undo_and_page(client: TestClient, clean: list[str]) -> None:
    one = client.post(URL, headers=ADMIN, json={"sha256": clean[0], "criterion": " has stripes ", "holds": True,
                                                "source": "person", "author": "ana"})
    assert one.status_code == 200, one.text
    [first] = one.json()["data"]
    assert (first["criterion"], first["source"], first["author"]) == ("has stripes", "person", "ana")
    ids = {i["sha256"]: i["id"] for i in client.get("/v1/sets/cats/images", headers=ADMIN).json()["data"]}
    image_id = ids[clean[1]]
    many = client.post(URL, headers=ADMIN, json=[
        {"sha256": clean[0], "criterion": "has stripes", "holds": False},
        {"image_id": image_id, "criterion": "has stripes", "holds": True}])
    assert many.status_code == 200, many.text
    later = many.json()["data"][0]
    assert later["id"] > first["id"] and later["author"].startswith("key:") and ADMIN_KEY not in later["author"]
    assert cells(client) == {(clean[0], "has stripes"): False, (clean[1], "has stripes"): True}
    undone = client.delete(f"{URL}/{later['id']}", headers=ADMIN)
    assert undone.status_code == 200 and undone.json()["sha256"] == clean[0]
    assert client.delete(f"{URL}/{later['id']}", headers=ADMIN).status_code == 404
    assert cells(client) == {(clean[1], "has stripes"): True}
    client.post(URL, headers=ADMIN, json=[{"sha256": s, "criterion": c, "holds": True}
                                          for s in clean for c in ("a", "b")])
    pages, after = [], None
    while True:
        page = client.get(URL, params={"limit": 3, **({"after": after} if after else {})}, headers=ADMIN).json()
        pages.append(len(page["data"]))
        after = page["next_after"]
        if after is None:
            break
    assert pages == [3, 3, 3] and page["total"] == 9
    assert set(cells(client, criterion="a")) == {(s, "a") for s in clean}
    assert set(cells(client, image=clean[2])) == {(clean[2], "a"), (clean[2], "b")}
    assert cells(client, source="person") == {}
    assert client.delete(URL, params={"criterion": "b"}, headers=ADMIN).json() == {"deleted": N}


def test_jsonl_export_and_import_round_trip(client: TestClient, clean: list[str]) -> None:
    client.post(URL, headers=ADMIN, json=[{"sha256": s, "criterion": "has stripes", "holds": i % 2 == 0,
                                           "source": "person", "author": "bo"} for i, s in enumerate(clean)])
    before = cells(client)
    by_query = client.get(URL, params={"format": "jsonl"}, headers=ADMIN)
    by_accept = client.get(URL, headers={**ADMIN, "Accept": "application/x-ndjson"})
    assert by_query.headers["content-type"].startswith("application/x-ndjson")
    assert by_query.content == by_accept.content
    lines = [json.loads(line) for line in by_query.text.splitlines()]
    assert {(x["sha256"], x["criterion"]): x["holds"] for x in lines} == before and lines[0]["author"] == "bo"
    upload = {**ADMIN, "Content-Type": "application/x-ndjson"}
    again = client.post(f"{URL}/import", content=by_query.content, headers=upload)
    assert again.status_code == 200 and [j["id"] for j in again.json()["data"]] == [x["id"] for x in lines]
    client.delete(f"{URL}?all=true", headers=ADMIN)
    back = client.post(f"{URL}/import", content=by_query.content + b"\n\n", headers=upload)
    assert back.status_code == 200, back.text
    assert back.json()["lines"] == N and cells(client) == before
    assert {j["author"] for j in back.json()["data"]} == {"bo"} and {j["source"] for j in back.json()["data"]} \
        == {"person"}


def test_derive_from_metadata(client: TestClient, clean: list[str]) -> None:
    dry = client.post(f"{URL}/derive", headers=ADMIN, json={"key": "breed", "dry_run": True,
                                                            "statements": {"siamese": "A siamese cat"}})
    assert dry.status_code == 200, dry.text
    body = dry.json()
    assert [(s["value"], s["statement"], s["yes"], s["no"]) for s in body["statements"]] == [
        ("tabby", "The breed is tabby", 2, 2), ("siamese", "A siamese cat", 2, 2)]
    assert body["judgments"] == 2 * N and body["recorded"] is False and cells(client) == {}
    done = client.post(f"{URL}/derive", headers=ADMIN, json={"key": "breed"})
    assert done.status_code == 200 and done.json()["recorded"] is True
    expected = {(s, f"The breed is {b}"): b == breed for s, breed in zip(clean, BREEDS, strict=True)
                for b in ("tabby", "siamese")}
    assert cells(client) == expected
    assert set(cells(client, source="derived")) == set(expected)


def test_search_hits_show_the_recorded_judgment(client: TestClient, clean: list[str]) -> None:
    client.post(URL, headers=ADMIN, json=[{"sha256": clean[0], "criterion": "striped", "holds": True},
                                          {"sha256": clean[1], "criterion": "striped", "holds": False},
                                          {"sha256": clean[1], "criterion": "not asked", "holds": True}])
    got = client.post("/v1/search", headers=ADMIN, json={"set_id": "cats", "criteria": [" striped", "fluffy"],
                                                         "top_k": 10, "top_n": 10})
    assert got.status_code == 200, got.text
    shown = {h["image"]["sha256"]: h["judgments"] for h in got.json()["hits"]}
    striped = got.json()["provenance"]["criteria"][0]  # the criterion as the search names it
    assert set(shown) == set(clean) and striped.strip() == "striped"
    assert shown[clean[0]] == {striped: True} and shown[clean[1]] == {striped: False}
    assert shown[clean[2]] == {} == shown[clean[3]]


def test_deleting_a_reference_deletes_its_judgments(client: TestClient, clean: list[str]) -> None:
    extra = noise_png(64, 64, 999)
    job = client.post("/v1/sets/cats/images", headers=ADMIN, files=[("files", ("x.png", extra, "image/png"))])
    assert wait_job(client, job.json()["id"])["state"] == "succeeded"
    sha = decode_image(extra).sha256
    client.post(URL, headers=ADMIN, json=[{"sha256": sha, "criterion": "c", "holds": True},
                                          {"sha256": clean[0], "criterion": "c", "holds": True}])
    assert client.delete(f"/v1/sets/cats/images/{sha}", headers=ADMIN).status_code == 204
    assert cells(client) == {(clean[0], "c"): True}


def test_writes_need_an_admin_key(client: TestClient, clean: list[str]) -> None:
    item = {"sha256": clean[0], "criterion": "c", "holds": True}
    assert client.post(URL, json=item).status_code == 401
    assert client.post(URL, json=item, headers=bearer(SEARCH_KEY)).status_code == 403
    assert client.get(URL, headers=bearer(SEARCH_KEY)).status_code == 200
    assert cells(client) == {}


def _refused(client: TestClient, status: int, method: str, path: str, **kw: Any) -> dict[str, Any]:
    before = client.get(URL, params={"format": "jsonl"}, headers=ADMIN).content
    got = client.request(method, path, headers={**ADMIN, **kw.pop("headers", {})}, **kw)
    assert got.status_code == status, got.text
    assert client.get(URL, params={"format": "jsonl"}, headers=ADMIN).content == before  # nothing changed
    error: dict[str, Any] = got.json()["error"]
    return error


def test_bad_input_is_a_4xx_that_changes_nothing(client: TestClient, clean: list[str]) -> None:
    client.post(URL, headers=ADMIN, json={"sha256": clean[0], "criterion": "kept", "holds": True})
    good = [{"sha256": s, "criterion": "new", "holds": True} for s in clean]
    unknown = "0" * 64
    assert "0000" in str(_refused(client, 404, "POST", URL, json=[*good, {"sha256": unknown, "criterion": "x",
                                                                          "holds": True}])["details"])
    _refused(client, 404, "POST", URL, json=[*good, {"image_id": 10**12, "criterion": "x", "holds": True}])
    _refused(client, 404, "POST", "/v1/sets/nope/judgments", json=good)
    _refused(client, 422, "POST", URL, json=[*good, {"sha256": clean[0], "criterion": "   ", "holds": True}])
    _refused(client, 422, "POST", URL, json=[*good, {"sha256": clean[0], "criterion": "x" * 501, "holds": True}])
    _refused(client, 422, "POST", URL, json=[*good, {"sha256": clean[0], "criterion": "x", "holds": "yes"}])
    _refused(client, 422, "POST", URL, json=[*good, {"sha256": clean[0], "image_id": 1, "criterion": "x",
                                                     "holds": True}])
    for criterion, author in (("\\ud800", "ana"), ("a\\u0000b", "ana"), ("c", "\\udfff")):
        raw = f'{{"sha256": "{clean[0]}", "criterion": "{criterion}", "holds": true, "author": "{author}"}}'
        _refused(client, 422, "POST", URL, content=raw.encode(), headers={"Content-Type": "application/json"})
    item = {"sha256": clean[0], "criterion": "c", "holds": True}
    over = _refused(client, 413, "POST", URL, json=[item] * (MAX_BATCH + 1))
    assert over["details"]["limit"] == MAX_BATCH
    million = ("[" + ",".join(['{"image_id":1,"criterion":"c","holds":true}'] * 10**6) + "]").encode()
    _refused(client, 413, "POST", URL, content=million, headers={"Content-Type": "application/json"})
    lines = b"\n".join(json.dumps(item).encode() for _ in range(MAX_BATCH + 1))
    ndjson = {"Content-Type": "application/x-ndjson"}
    _refused(client, 413, "POST", f"{URL}/import", content=lines, headers=ndjson)
    bad_line = _refused(client, 422, "POST", f"{URL}/import", headers=ndjson,
                        content=json.dumps(item).encode() + b'\n{"sha256": "' + clean[1].encode() + b'"}\nnot json')
    assert {tuple(e["loc"][:2]) for e in bad_line["details"]["errors"]} == {("body", "line 2"), ("body", "line 3")}
    _refused(client, 415, "POST", f"{URL}/import", content=lines, headers={"Content-Type": "text/csv"})
    _refused(client, 400, "POST", f"{URL}/derive", json={"key": "colour"})
    _refused(client, 400, "POST", f"{URL}/derive", json={"key": "breed", "statements": {"persian": "A persian"}})
    _refused(client, 400, "DELETE", URL)  # a delete names what it deletes
    _refused(client, 404, "DELETE", f"{URL}/{10**12}")


def test_a_deleted_set_takes_no_judgments(client: TestClient) -> None:
    assert client.post("/v1/sets", json={"name": "gone"}, headers=ADMIN).status_code == 201
    extra = noise_png(32, 32, 77)
    job = client.post("/v1/sets/gone/images", headers=ADMIN, files=[("files", ("g.png", extra, "image/png"))])
    assert wait_job(client, job.json()["id"])["state"] == "succeeded"
    item = {"sha256": decode_image(extra).sha256, "criterion": "c", "holds": True}
    assert client.post("/v1/sets/gone/judgments", headers=ADMIN, json=item).status_code == 200
    assert client.delete("/v1/sets/gone", headers=ADMIN).status_code == 204
    assert client.post("/v1/sets/gone/judgments", headers=ADMIN, json=item).status_code == 404
    assert client.get("/v1/sets/gone/judgments", headers=ADMIN).status_code == 404
