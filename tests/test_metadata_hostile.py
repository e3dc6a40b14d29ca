"""Text and numbers that cannot poison a set, through the REST API on tiny real checkpoints, FAISS, and SQLite
and PostgreSQL.

Every metadata entrance (PATCH, JSONL and CSV manifests, a zip's manifest, multipart upload metadata, facet
schemas, filter values) refuses a lone surrogate, a NUL and an integer beyond int64 with a 422 naming the key,
and stores nothing; values an older version stored are skipped, never a 500. Manifests refuse duplicate
columns and keys, paths outside their folder and over-long CSV cells (naming the line).
"""

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
from sqlalchemy import select

from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import check_metadata, parse_manifest
from rubricsearch.indexer.catalog.tables import Image
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.index.filters import parse_filter
from rubricsearch.retrieval.remote.package_keys import PackageKey
from tests.api_helpers import ADMIN_KEY, bearer, built_state, client_for, wait_job
from tests.conftest import TOWERS, noise_png
from tests.conftest_catalog import CATALOG_BACKENDS, postgres_schema

pytestmark = pytest.mark.timeout(300)
ADMIN = {**bearer(ADMIN_KEY), "Content-Type": "application/json"}
N = 4
BIG = 10**400
# JSON as a client may send it: \u escapes can spell a lone surrogate, which no UTF-8 encoder accepts
SURROGATE, NUL = '"a\\ud800b"', '"a\\u0000b"'


@pytest.fixture(scope="module", params=CATALOG_BACKENDS, name="state")
def state(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
          reranker_dir_for: Callable[[str], Path]) -> Iterator[AppState]:
    """The module runs once on a SQLite catalog and once on PostgreSQL (when configured): every entrance must
    refuse before either backend stores anything."""
    with contextlib.ExitStack() as stack:
        url = {} if request.param == "sqlite" else {"database_url": stack.enter_context(postgres_schema())}
        for built in built_state(tmp_path_factory, "api-hostile", tiny_embedding_dir, reranker_dir_for(TOWERS[0]),
                                 ingest={"workers": 1}, packages={"storage_dtype": "float32"}, **url):
            assert built.catalog.dialect == {"sqlite": "sqlite", "postgres": "postgresql"}[request.param]
            yield built


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


@pytest.fixture(scope="module")
def shas(client: TestClient) -> list[str]:
    assert client.post("/v1/sets", json={"name": "hostile"}, headers=ADMIN).status_code == 201
    images = [noise_png(40 + 4 * i, 52, 700 + i) for i in range(N)]
    job = client.post("/v1/sets/hostile/images", headers=bearer(ADMIN_KEY),
                      files=[("files", (f"{i}.png", d, "image/png")) for i, d in enumerate(images)]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded", job
    return [decode_image(d).sha256 for d in images]


def fill(template: str, raw: object) -> str:
    """``template`` with its ``@`` replaced by ``raw`` as JSON text (``raw`` may spell what json.dumps cannot)."""
    return template.replace("@", str(raw))


def metadata_of(client: TestClient) -> dict[str, dict[str, Any]]:
    page = client.get("/v1/sets/hostile/images?limit=100", headers=ADMIN)
    assert page.status_code == 200, page.text
    return {img["sha256"]: img["metadata"] for img in page.json()["data"]}


def search(client: TestClient, flt: Any) -> Any:
    body = {"set_id": "hostile", "rubric": "a picture", "rerank": False, "top_k": 50, "top_n": 0, "filter": flt}
    return client.post("/v1/search", headers=ADMIN, json=body)


def manifest(client: TestClient, name: str, body: bytes) -> Any:
    return client.post("/v1/sets/hostile/manifest", headers=bearer(ADMIN_KEY), files={"file": (name, body)})


@pytest.mark.parametrize("raw", [SURROGATE, NUL, str(BIG), f"[1, {BIG}]", f"[{SURROGATE}]"])
def test_patch_refuses_unstorable_values_naming_the_key(client: TestClient, shas: list[str], raw: str) -> None:
    before = metadata_of(client)
    body = fill('{"metadata": {"label": "fine", "bad": @}}', raw)
    r = client.patch(f"/v1/sets/hostile/images/{shas[0]}", headers=ADMIN, content=body.encode())
    assert r.status_code == 422 and "bad" in r.json()["error"]["message"], r.text
    assert metadata_of(client) == before


@pytest.mark.parametrize("raw", [SURROGATE, NUL, str(BIG)])
def test_manifests_refuse_unstorable_values_and_change_nothing(client: TestClient, shas: list[str], raw: str) -> None:
    before = metadata_of(client)
    good = json.dumps({"sha256": shas[1], "label": "ok"})
    jsonl = f'{good}\n{{"sha256": "{shas[0]}", "bad": {raw}}}\n'.encode()
    r = manifest(client, "manifest.jsonl", jsonl)
    assert r.status_code == 422 and "bad" in r.text and '"line":2' in r.text.replace(" ", ""), r.text
    if raw == str(BIG):
        r = manifest(client, "manifest.csv", f"sha256,label,bad\n{shas[1]},ok,1\n{shas[0]},x,{BIG}\n".encode())
        assert r.status_code == 422 and "line 3.bad" in r.text and "int64" in r.text, r.text
    assert metadata_of(client) == before


def test_multipart_upload_metadata_refuses_a_surrogate(client: TestClient, shas: list[str]) -> None:
    meta = fill('{"new.png": {"bad": @}}', SURROGATE)
    r = client.post("/v1/sets/hostile/images", headers=bearer(ADMIN_KEY), data={"metadata": meta},
                    files=[("files", ("new.png", noise_png(30, 30, 99), "image/png"))])
    assert r.status_code == 422 and "bad" in r.text, r.text
    assert len(metadata_of(client)) == N


def test_facet_schema_refuses_a_surrogate_and_keeps_its_version(client: TestClient, shas: list[str]) -> None:
    url = "/v1/sets/hostile/facets/schema"
    version = client.get(url, headers=ADMIN).json()["version"]
    body = fill('{"attributes": [{"name": "color", "values": ["red", @]}]}', SURROGATE)
    r = client.put(url, headers=ADMIN, content=body.encode())
    assert r.status_code == 422 and "values[1]" in r.text, r.text
    assert client.get(url, headers=ADMIN).json()["version"] == version


@pytest.mark.parametrize("flt", [
    fill('{"must": [{"key": "label", "match": {"value": @}}]}', SURROGATE),
    fill('{"must": [{"key": "label", "match": {"any": ["x", @]}}]}', NUL),
    fill('{"must": [{"key": "n", "match": {"value": @}}]}', BIG),
    fill('{"must": [{"key": "n", "range": {"gte": @}}]}', BIG),
])
def test_filter_values_are_422_not_500(client: TestClient, shas: list[str], flt: str) -> None:
    body = fill('{"set_id": "hostile", "rubric": "x", "rerank": false, "top_n": 0, "filter": @}', flt)
    r = client.post("/v1/search", headers=ADMIN, content=body.encode())
    assert r.status_code == 422 and "filter.must[0]" in r.text, r.text


def test_values_an_older_version_stored_are_skipped_everywhere(client: TestClient, shas: list[str],
                                                                 state: AppState) -> None:
    bad = {"label": "old", "price": 5, "ghost": "a\ud800b", "nul": "a\x00b", "huge": BIG}
    if state.catalog.dialect == "postgresql":  # its JSONB never held a surrogate or NUL: no version stored one
        bad = {k: v for k, v in bad.items() if k not in ("ghost", "nul")}
    with state.catalog.write() as session:
        row = session.scalars(select(Image).where(Image.sha256 == shas[2])).one()
        row.meta = bad
        set_id = row.set_id
    state.index.set_payloads(set_id, {shas[2]: bad})  # the index file of that version held them too
    try:
        assert metadata_of(client)[shas[2]] == {"label": "old", "price": 5}
        export = client.get("/v1/sets/hostile/manifest.jsonl", headers=ADMIN)
        assert export.status_code == 200
        rows = [json.loads(line) for line in export.text.splitlines()]
        assert len(rows) == N and {"sha256": shas[2], "file": "2.png", "label": "old", "price": 5} in rows
        assert client.get("/v1/sets/hostile/metadata/counts", headers=ADMIN).status_code == 200
        for flt in [None, {"must": [{"key": "price", "range": {"gte": 1}}]},
                    {"must": [{"key": "huge", "range": {"gte": 1}}]}]:
            r = search(client, flt)
            assert r.status_code == 200, r.text
        hits = search(client, {"must": [{"key": "price", "range": {"gte": 1}}]}).json()["hits"]
        assert [h["image"]["metadata"] for h in hits] == [{"label": "old", "price": 5}]
        # a PATCH replaces or removes such a field
        r = client.patch(f"/v1/sets/hostile/images/{shas[2]}", headers=ADMIN,
                         json={"metadata": {"ghost": None, "nul": None, "huge": 7}})
        assert r.status_code == 200 and r.json()["metadata"] == {"label": "old", "price": 5, "huge": 7}, r.text
    finally:
        client.patch(f"/v1/sets/hostile/images/{shas[2]}", headers=ADMIN, json={"metadata": {}, "replace": True})


def test_a_csv_cell_over_the_bound_is_422_naming_the_line(client: TestClient, shas: list[str]) -> None:
    body = f"sha256,label\n{shas[0]},ok\n{shas[1]},{'x' * 200_000}\n".encode()
    r = manifest(client, "manifest.csv", body)
    assert r.status_code == 422 and "line 3" in r.text, r.text
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("a.png", noise_png(30, 31, 5))
        zf.writestr("manifest.csv", f"file,label\na.png,{'y' * 200_000}\n")
    r = client.post("/v1/sets/hostile/images", headers=bearer(ADMIN_KEY),
                    files=[("files", ("m.zip", buf.getvalue(), "application/zip"))])
    assert r.status_code == 422 and "line 2" in r.text, r.text


def test_duplicate_columns_and_keys_are_refused(client: TestClient, shas: list[str]) -> None:
    before = metadata_of(client)
    r = manifest(client, "manifest.csv", f"sha256,label,label\n{shas[0]},a,b\n".encode())
    assert r.status_code == 422 and "'label'" in r.text and "more than once" in r.text, r.text
    r = manifest(client, "manifest.csv", f"file,sha256,file\n0.png,{shas[0]},1.png\n".encode())
    assert r.status_code == 422 and "'file'" in r.text, r.text
    r = manifest(client, "manifest.jsonl", f'{{"sha256": "{shas[0]}", "label": "a", "label": "b"}}\n'.encode())
    assert r.status_code == 422 and "'label'" in r.text and "more than once" in r.text, r.text
    assert metadata_of(client) == before


def test_paths_outside_the_manifest_folder_are_refused(client: TestClient, shas: list[str]) -> None:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("img1.png", noise_png(30, 32, 6))
        zf.writestr("manifest.csv", "file,label\n./../img1.png,escaped\n")
    r = client.post("/v1/sets/hostile/images", headers=bearer(ADMIN_KEY),
                    files=[("files", ("m.zip", buf.getvalue(), "application/zip"))])
    assert r.status_code == 422 and "not a path inside" in r.text, r.text
    rows = parse_manifest(b"file,label\n./a/./b.png,x\nc/../d.png,y\n..hidden.png,z\n", "manifest.csv").rows
    assert [r.file for r in rows] == ["a/b.png", "d.png", "..hidden.png"]


def test_keys_and_package_keys_refuse_a_trailing_newline() -> None:
    key = "rspkg-" + "0" * 32 + "-" + "1" * 32 + "-float32-" + "a" * 64
    assert PackageKey.parse(key) is not None
    assert PackageKey.parse(key + "\n") is None
    for bad in ({"label\n": "x"}, {"a": "b", "tags\n": ["x"]}):
        with pytest.raises(InvalidMetadata, match="invalid key"):
            check_metadata(bad)
    with pytest.raises(InvalidMetadata, match="invalid key"):
        parse_filter({"must": [{"key": "label\n", "match": {"value": "x"}}]})


def test_a_manifest_applied_in_chunks_is_all_or_nothing(client: TestClient, shas: list[str], state: AppState,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    import rubricsearch.indexer.jobs.metadata as jobs_metadata

    monkeypatch.setattr(jobs_metadata, "_CHUNK", 2)
    before = metadata_of(client)
    stranger = "f" * 64  # no image of the set: found out only when its chunk is applied
    rows = [{"sha256": sha, "label": "chunked"} for sha in shas[:3]] + [{"sha256": stranger, "label": "x"}]
    r = manifest(client, "manifest.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode())
    assert r.status_code == 422 and r.json()["error"]["details"]["errors"][0]["line"] == 4, r.text
    assert metadata_of(client) == before
    hits = search(client, {"must": [{"key": "label", "match": {"value": "chunked"}}]}).json()["hits"]
    assert hits == []  # the index payloads set by the first chunk were put back
    r = manifest(client, "manifest.jsonl", "".join(json.dumps(row) + "\n" for row in rows[:3]).encode())
    assert r.status_code == 200 and r.json() == {"rows": 3, "updated": 3}, r.text
    hits = search(client, {"must": [{"key": "label", "match": {"value": "chunked"}}]}).json()["hits"]
    assert {h["image"]["sha256"] for h in hits} == set(shas[:3])
    client.post("/v1/sets/hostile/manifest", headers=bearer(ADMIN_KEY), files={"file": ("manifest.jsonl", "".join(
        json.dumps({"sha256": sha, "label": None}) + "\n" for sha in shas[:3]).encode())})


def test_rows_naming_one_image_twice_are_refused_however_named(client: TestClient, shas: list[str]) -> None:
    """By sha256 twice, by file twice, or once by file and once by its sha256: the later row would silently win."""
    before = metadata_of(client)
    rows = [{"file": "0.png", "label": "a"}, {"sha256": shas[1], "label": "b"}, {"sha256": shas[0], "label": "c"},
            {"sha256": shas[1].upper(), "label": "d"}, {"file": "2.png", "label": "e"}, {"file": "./2.png"},
            {"file": "ghost.png"}, {"file": "ghost.png"}]
    r = manifest(client, "manifest.jsonl", "".join(json.dumps(row) + "\n" for row in rows).encode())
    assert r.status_code == 422, r.text
    errors = r.json()["error"]["details"]["errors"]
    assert [(e["line"], e["error"]) for e in errors] == [
        (3, "names the same image as line 1"), (4, "names the same image as line 2"),
        (6, "names the same image as line 5"), (7, "no image named 'ghost.png' in this set"),
        (8, "names the same image as line 7")], errors
    assert "5 row(s) cannot be applied" in r.text
    assert metadata_of(client) == before
