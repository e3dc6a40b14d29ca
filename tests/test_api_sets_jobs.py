"""REST sets, images and jobs on tiny real checkpoints: uploads (images and zips), URL and folder imports,
paging, bytes and thumbnails, SSE progress on a live uvicorn, deletes, session + CSRF auth, error paths."""

from __future__ import annotations

import io
import json
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import Response
from fastapi.testclient import TestClient
from PIL import Image

import rubricsearch.app.routers.jobs as jobs_router
from rubricsearch.app import http_limits
from rubricsearch.app.auth import issue_admin_session
from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from rubricsearch.retrieval.images import decode_image
from tests import fixtures_images as fx
from tests.api_helpers import ADMIN_KEY, SEARCH_KEY, bearer, built_state, client_for, wait_job
from tests.conftest import image_server, noise_png

pytestmark = pytest.mark.timeout(180)
ADMIN = bearer(ADMIN_KEY)
SLOW_S = 0.3


def served_image(path: str) -> tuple[int, bytes]:
    """/img/N.png is a generated PNG; /slow/N.png the same after a pause; anything else is a 404."""
    kind, _, name = path.strip("/").partition("/")
    if kind not in ("img", "slow") or not name.endswith(".png"):
        return 404, b""
    if kind == "slow":
        time.sleep(SLOW_S)
    return 200, noise_png(36, 36, 500 + int(name.removesuffix(".png")))


@pytest.fixture(scope="module")
def http_port() -> Iterator[int]:
    with image_server(served_image) as base:
        yield int(base.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def import_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("import-root")
    (root / "shelf").mkdir()
    for i in range(3):
        (root / "shelf" / f"f{i}.png").write_bytes(noise_png(44, 30, 700 + i))
    return root


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          http_port: int, import_root: Path) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "api-sets", tiny_embedding_dir, tiny_reranker_dir,
                           ingest={"workers": 1, "url_allowed_hosts": [f"127.0.0.1:{http_port}"]},
                           packages={"storage_dtype": "float32"}, import_root=import_root)


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


def error(response: Any, status: int, kind: str) -> dict[str, Any]:
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == kind
    return response.json()["error"]


def zip_of(entries: dict[str, bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for name, data in entries.items():
            zf.writestr(name, data)
    return buf.getvalue()


def new_set(client: TestClient, name: str, **extra: Any) -> dict[str, Any]:
    r = client.post("/v1/sets", json={"name": name, **extra}, headers=ADMIN)
    assert r.status_code == 201, r.text
    return r.json()


@contextmanager
def live_server(state: AppState, **overrides: Any) -> Iterator[str]:
    """The app on a real uvicorn at 127.0.0.1 (any free port), sharing the loaded state."""
    app = create_app(state.settings.updated(overrides), state=state)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def sse_events(base: str, job_id: str) -> list[tuple[str, str]]:
    """(event, data) pairs and ('comment', text) lines of a job's stream, read incrementally."""
    events: list[tuple[str, str]] = []
    name = "message"
    with httpx.stream("GET", f"{base}/v1/jobs/{job_id}/events", timeout=60) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for line in r.iter_lines():
            if line.startswith(":"):
                events.append(("comment", line[1:].strip()))
            elif line.startswith("event:"):
                name = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                events.append((name, line.split(":", 1)[1].strip()))
    return events


def test_sets_crud_and_errors(client: TestClient, state: AppState) -> None:
    created = new_set(client, "crud", description="first", dimensions=96)
    assert created["dimensions"] == 96 and created["counts"] == {"indexed": 0, "pending": 0, "failed": 0}
    assert new_set(client, "crud-full")["dimensions"] == state.embedder.dimension
    assert client.get(f"/v1/sets/{created['id']}").json() == created
    assert client.get("/v1/sets/crud").json()["id"] == created["id"]
    assert "crud" in [s["name"] for s in client.get("/v1/sets").json()["data"]]
    error(client.post("/v1/sets", json={"name": "crud"}, headers=ADMIN), 409, "conflict")
    error(client.post("/v1/sets", json={"name": "x", "dimensions": 32}, headers=ADMIN), 400, "invalid_input")
    error(client.post("/v1/sets", json={"name": "x", "dimensions": 4096}, headers=ADMIN), 400, "invalid_input")
    error(client.post("/v1/sets", json={"dimensions": 64}, headers=ADMIN), 422, "validation_error")
    error(client.post("/v1/sets", content="name=x", headers={**ADMIN, "Content-Type": "text/plain"}), 415,
          "unsupported_media_type")
    error(client.post("/v1/sets", json={"name": "y"}), 401, "unauthorized")
    error(client.post("/v1/sets", json={"name": "y"}, headers=bearer(SEARCH_KEY)), 403, "forbidden")
    error(client.get("/v1/sets/nope"), 404, "not_found")
    error(client.delete("/v1/sets/nope", headers=ADMIN), 404, "not_found")
    assert client.delete("/v1/sets/crud-full", headers=ADMIN).status_code == 204


def test_upload_images_and_zips_end_to_end(client: TestClient, state: AppState) -> None:
    ref = new_set(client, "animals", dimensions=64)
    singles = [noise_png(40 + 3 * i, 56, i) for i in range(15)] + [fx.jpeg(64, 48, fx.RED)]
    mixed_zip = {f"mixed/m{i}.png": noise_png(48, 30 + i, 100 + i) for i in range(4)}
    files = [("files", (f"s{i}.{'jpg' if i == 15 else 'png'}", d, "image/png")) for i, d in enumerate(singles)]
    files += [("files", ("mixed.zip", zip_of(mixed_zip), "application/zip")),
              ("files", ("broken.png", b"not an image", "image/png"))]
    r = client.post("/v1/sets/animals/images", files=files, headers=ADMIN)
    assert r.status_code == 202, r.text
    first = r.json()
    assert first["set_id"] == ref["id"] and first["kind"] == "upload" and first["total"] == 21
    alone = {f"zoo/z{i}.png": noise_png(30, 60 - i, 200 + i) for i in range(10)} | {"zoo/readme.txt": b"hi"}
    r = client.post(f"/v1/sets/{ref['id']}/images", files=[("files", ("zoo.zip", zip_of(alone), "x/y"))],
                    headers=ADMIN)
    assert r.status_code == 202 and r.json()["kind"] == "zip" and r.json()["total"] == 10
    zip_job = r.json()

    done = wait_job(client, first["id"])
    assert (done["state"], done["done"], done["failed"], done["progress"]) == ("completed_with_errors", 20, 1, 1.0)
    assert done["errors"] == [{"ref": "broken.png", "error": done["errors"][0]["error"]}]
    assert done["errors"][0]["error"].startswith("invalid_image:")
    assert wait_job(client, zip_job["id"])["state"] == "succeeded"
    counts = client.get("/v1/sets/animals").json()["counts"]
    # broken.png never became an image, but the set counts it as its job does (the admin table shows both)
    assert counts == {"indexed": 30, "pending": 0, "failed": 1}

    # paging by keyset, and the status filter
    pages, after = [], None
    while True:
        page = client.get("/v1/sets/animals/images", params={"limit": 7, **({"after": after} if after else {})})
        body = page.json()
        assert body["total"] == 30
        pages += body["data"]
        after = body["next_after"]
        if after is None:
            break
    assert len(pages) == 30 and len({p["sha256"] for p in pages}) == 30
    assert client.get("/v1/sets/animals/images?status=failed").json()["total"] == 0
    error(client.get("/v1/sets/animals/images?status=weird"), 422, "validation_error")
    error(client.get("/v1/sets/animals/images?limit=0"), 422, "validation_error")

    # bytes and thumbnails
    jpeg = next(p for p in pages if p["original_name"] == "s15.jpg")
    assert jpeg["source"] == "upload" and (jpeg["width"], jpeg["height"]) == (64, 48)
    r = client.get(jpeg["url"])
    assert r.content == singles[15] and r.headers["content-type"] == "image/jpeg"
    assert r.headers["x-content-type-options"] == "nosniff" and "immutable" in r.headers["cache-control"]
    png = next(p for p in pages if p["original_name"] == "s3.png")
    assert client.get(png["url"]).headers["content-type"] == "image/png"
    thumb = client.get(png["thumbnail_url"], params={"size": 100})
    assert thumb.headers["content-type"] == "image/jpeg"
    assert max(Image.open(io.BytesIO(thumb.content)).size) <= 128
    assert (state.settings.data_dir / "thumbs" / png["sha256"][:2] / f"{png['sha256']}-128.jpg").exists()
    assert client.get(png["thumbnail_url"], params={"size": 100}).content == thumb.content
    error(client.get(f"/v1/images/{'0' * 64}"), 404, "not_found")
    error(client.get(f"/v1/images/{'0' * 64}/thumbnail"), 404, "not_found")
    error(client.get(png["thumbnail_url"], params={"size": 5000}), 422, "validation_error")

    jobs = client.get("/v1/jobs", params={"set_id": "animals"}).json()["data"]
    assert [j["id"] for j in jobs] == [zip_job["id"], first["id"]]  # newest first
    error(client.post(f"/v1/jobs/{first['id']}/cancel", headers=ADMIN), 409, "conflict")
    error(client.get("/v1/jobs/nope"), 404, "not_found")
    error(client.get("/v1/jobs", params={"set_id": "nope"}), 404, "not_found")


def test_upload_errors(client: TestClient, state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    new_set(client, "errs")
    png = ("files", ("a.png", noise_png(20, 20, 1), "image/png"))
    error(client.post("/v1/sets/errs/images", json={"files": []}, headers=ADMIN), 415, "unsupported_media_type")
    error(client.post("/v1/sets/errs/images", files=[("files", ("a.tar.gz", b"\x1f\x8b", "application/gzip"))],
                      headers=ADMIN), 415, "unsupported_media_type")
    error(client.post("/v1/sets/errs/images", files=[("other", ("a.png", b"x", "image/png"))], headers=ADMIN),
          422, "validation_error")
    error(client.post("/v1/sets/errs/images", files=[("files", ("bad.zip", b"PK\x03\x04junk", "x/y"))],
                      headers=ADMIN), 400, "invalid_input")
    error(client.post("/v1/sets/nope/images", files=[png], headers=ADMIN), 404, "not_found")
    error(client.post("/v1/sets/errs/images", files=[png]), 401, "unauthorized")
    monkeypatch.setattr(http_limits, "MAX_REQUEST_BYTES", 4096)  # read when the app is made
    small = client_for(state)
    big = ("files", ("big.png", noise_png(200, 200, 2), "image/png"))
    error(small.post("/v1/sets/errs/images", files=[big], headers=ADMIN), 413, "payload_too_large")
    error(client.post("/v1/sets/errs/imports", json={}, headers=ADMIN), 422, "validation_error")
    error(client.post("/v1/sets/errs/imports", json={"urls": ["http://x/a.png"], "folder": "a"}, headers=ADMIN),
          422, "validation_error")
    assert client.get("/v1/sets/errs").json()["counts"]["pending"] == 0  # nothing was queued


def test_url_and_folder_imports(client: TestClient, state: AppState, http_port: int) -> None:
    new_set(client, "imports", dimensions=64)
    base = f"http://127.0.0.1:{http_port}"
    urls = [f"{base}/img/{i}.png" for i in range(3)] + [f"{base}/missing.png", "http://127.0.0.1:9/blocked.png"]
    r = client.post("/v1/sets/imports/imports", json={"urls": urls}, headers=ADMIN)
    assert r.status_code == 202 and r.json()["kind"] == "url" and r.json()["total"] == 5
    job = wait_job(client, r.json()["id"])
    assert (job["done"], job["failed"]) == (3, 2)
    reasons = {e["ref"]: e["error"] for e in job["errors"]}
    assert reasons[f"{base}/missing.png"].startswith(("not_found", "invalid_input"))
    assert reasons["http://127.0.0.1:9/blocked.png"].startswith("forbidden")  # loopback, not an allowed host

    r = client.post("/v1/sets/imports/imports", json={"folder": "shelf"}, headers=ADMIN)
    assert r.status_code == 202 and r.json()["kind"] == "folder"
    assert wait_job(client, r.json()["id"])["done"] == 3
    assert client.get("/v1/sets/imports").json()["counts"]["indexed"] == 6
    error(client.post("/v1/sets/imports/imports", json={"folder": "../.."}, headers=ADMIN), 403, "forbidden")
    error(client.post("/v1/sets/imports/imports", json={"folder": "nope"}, headers=ADMIN), 404, "not_found")
    closed = client_for(state, import_root=None)
    error(closed.post("/v1/sets/imports/imports", json={"folder": "shelf"}, headers=ADMIN), 403, "forbidden")


def test_sse_progress_on_live_server_and_cancel(client: TestClient, state: AppState, http_port: int,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    new_set(client, "stream", dimensions=64)
    # Enough slow items that the job is still running when the stream opens (loads run in parallel).
    urls = [f"http://127.0.0.1:{http_port}/slow/{i}.png" for i in range(100, 112)]
    monkeypatch.setattr(jobs_router, "SSE_POLL_INTERVAL_S", 0.02)
    monkeypatch.setattr(jobs_router, "SSE_HEARTBEAT_S", SLOW_S / 4)
    with live_server(state) as base:
        job = client.post("/v1/sets/stream/imports", json={"urls": urls}, headers=ADMIN).json()
        events = sse_events(base, job["id"])
        assert httpx.get(f"{base}/v1/jobs/nope/events").status_code == 404
    names = [name for name, _ in events]
    assert names[-1] == "done" and names.count("done") == 1 and "progress" in names
    assert "heartbeat" in [data for name, data in events if name == "comment"]
    progress = [json.loads(data) for name, data in events if name == "progress"]
    assert [p["done"] for p in progress] == sorted(p["done"] for p in progress)
    final = json.loads(events[-1][1])
    assert final["state"] == "succeeded" and final["done"] == 12 and final["progress"] == 1.0

    # cancel: pending items stop at once, the job ends cancelled
    many = [f"http://127.0.0.1:{http_port}/slow/{i}.png" for i in range(10, 40)]
    job = client.post("/v1/sets/stream/imports", json={"urls": many}, headers=ADMIN).json()
    r = client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN)
    assert r.status_code == 202 and r.json()["id"] == job["id"]
    ended = wait_job(client, job["id"])
    assert ended["state"] == "cancelled" and ended["done"] < 30
    error(client.post(f"/v1/jobs/{job['id']}/cancel", headers=ADMIN), 409, "conflict")
    error(client.post("/v1/jobs/nope/cancel", headers=ADMIN), 404, "not_found")


def test_deletes(client: TestClient, state: AppState) -> None:
    new_set(client, "del-a", dimensions=64)
    new_set(client, "del-b", dimensions=64)
    shared, own = noise_png(50, 50, 900), noise_png(50, 52, 901)
    for name, files in (("del-a", [shared, own]), ("del-b", [shared])):
        job = client.post(f"/v1/sets/{name}/images", headers=ADMIN,
                          files=[("files", (f"{i}.png", d, "image/png")) for i, d in enumerate(files)]).json()
        assert wait_job(client, job["id"])["done"] == len(files)
    sha_shared, sha_own = decode_image(shared).sha256, decode_image(own).sha256
    images = {i["sha256"]: i for i in client.get("/v1/sets/del-a/images").json()["data"]}
    client.get(f"/v1/images/{sha_own}/thumbnail")
    assert client.delete(f"/v1/sets/del-a/images/{images[sha_own]['id']}", headers=ADMIN).status_code == 204
    error(client.get(f"/v1/images/{sha_own}"), 404, "not_found")
    assert not state.blobs.exists(sha_own) and not list((state.settings.data_dir / "thumbs").rglob(f"{sha_own}*"))
    error(client.delete(f"/v1/sets/del-a/images/{images[sha_own]['id']}", headers=ADMIN), 404, "not_found")
    error(client.delete(f"/v1/sets/del-b/images/{images[sha_shared]['id']}", headers=ADMIN), 404, "not_found")
    assert client.delete(f"/v1/sets/del-a/images/{sha_shared}", headers=ADMIN).status_code == 204
    assert client.get(f"/v1/images/{sha_shared}").status_code == 200  # del-b still holds it
    assert state.index.ids(client.get("/v1/sets/del-a").json()["id"]) == set()
    b_id = client.get("/v1/sets/del-b").json()["id"]
    assert client.delete("/v1/sets/del-b", headers=ADMIN).status_code == 204
    error(client.get("/v1/sets/del-b"), 404, "not_found")
    error(client.get(f"/v1/images/{sha_shared}"), 404, "not_found")
    assert not state.blobs.exists(sha_shared) and not state.index.has_set(b_id)
    assert client.get("/v1/jobs", params={"limit": 1000}).json()["data"]  # other sets' jobs remain
    assert all(j["set_id"] != b_id for j in client.get("/v1/jobs", params={"limit": 1000}).json()["data"])


def test_session_cookie_and_csrf(state: AppState) -> None:
    c = client_for(state, auth={"search_requires_key": True})

    def login(response: Response) -> dict[str, str]:
        return {"csrf": issue_admin_session(response, state.settings, ADMIN_KEY)}

    c.app.add_api_route("/test-login", login, methods=["POST"])  # type: ignore[attr-defined]
    csrf = c.post("/test-login").json()["csrf"]
    assert c.cookies.get("rs_session")
    assert c.get("/v1/sets").status_code == 200  # a session reads even when search needs a key
    error(c.post("/v1/sets", json={"name": "via-session"}), 403, "forbidden")  # no CSRF token
    error(c.post("/v1/sets", json={"name": "via-session"}, headers={"X-CSRF-Token": "wrong"}), 403, "forbidden")
    assert c.post("/v1/sets", json={"name": "via-session"}, headers={"X-CSRF-Token": csrf}).status_code == 201
    form = c.post("/v1/sets/via-session/images", data={"csrf_token": csrf},
                  files=[("files", ("a.png", noise_png(20, 24, 3), "image/png"))])
    assert form.status_code == 202, form.text
    forged = c.cookies["rs_session"][:-2] + "xx"
    c.cookies.clear()
    c.cookies.set("rs_session", forged)
    error(c.post("/v1/sets", json={"name": "forged"}, headers={"X-CSRF-Token": csrf}), 401, "unauthorized")
    other = TestClient(create_app(state.settings.updated({"auth": {"search_requires_key": True}}), state=state))
    error(other.get("/v1/sets"), 401, "unauthorized")


def test_delete_set_while_its_job_runs(client: TestClient, state: AppState, http_port: int) -> None:
    set_id = new_set(client, "busy", dimensions=64)["id"]
    urls = [f"http://127.0.0.1:{http_port}/slow/{i}.png" for i in range(50, 70)]
    job = client.post("/v1/sets/busy/imports", json={"urls": urls}, headers=ADMIN).json()
    deadline = time.monotonic() + 30
    while client.get(f"/v1/jobs/{job['id']}").json()["state"] == "queued" and time.monotonic() < deadline:
        time.sleep(0.02)
    assert client.delete("/v1/sets/busy", headers=ADMIN).status_code == 204
    error(client.get(f"/v1/jobs/{job['id']}"), 404, "not_found")
    assert not state.index.has_set(set_id)  # the batch in flight finished before the set went
    assert state.runner is not None and state.runner.running
