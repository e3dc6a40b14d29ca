"""The ends of search: ``POST /v1/search`` declares its JSON and its form body (FastAPI validates both against
their models), a search only reads, and the Python API's ``search_set`` (docs/api.md) answers what the route
answers, provenance included.

Tiny real checkpoints, a real catalog and FAISS index, the real app.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient
from sqlalchemy import select

from rubricsearch.app.main import create_app
from rubricsearch.app.schemas.common import MAX_CRITERION_CHARS
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState, foreground_runner, open_state
from rubricsearch.indexer.catalog import resolve_set
from rubricsearch.indexer.catalog.tables import Base
from tests.api_helpers import ADMIN_KEY, bearer, one_state, wait_job
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[1]
ADMIN = bearer(ADMIN_KEY)

state, client = one_state("search-ends")


@pytest.fixture(scope="module")
def refs(client: TestClient) -> str:
    """Six references ingested through the API; the set's id."""
    created = client.post("/v1/sets", json={"name": "refs", "dimensions": 96}, headers=ADMIN)
    assert created.status_code == 201, created.text
    job = client.post("/v1/sets/refs/images", headers=ADMIN, files=[
        ("files", (f"r{i}.png", noise_png(48 + 8 * i, 72, 600 + i), "image/png")) for i in range(6)]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    return str(created.json()["id"])


def _errors(response: Any) -> list[tuple[Any, ...]]:
    assert response.status_code == 422, response.text
    assert response.json()["error"]["type"] == "validation_error"
    return [tuple(e["loc"]) for e in response.json()["error"]["details"]["errors"]]


def test_the_form_is_read_by_its_model(client: TestClient, refs: str) -> None:
    """Blank fields are absent, `criteria` holds one criterion per line and may repeat, values are trimmed."""
    r = client.post("/v1/search", data={"set_id": " refs ", "rubric": "  ", "top_k": " 5 ", "top_n": "",
                                        "rerank": " ", "criteria": ["short fur\n\n triangular ears ", "no stripes"]})
    assert r.status_code == 200, r.text
    prov = r.json()["provenance"]
    assert prov["criteria"] == ["short fur", "triangular ears", "no stripes"] and prov["top_k"] == 5
    assert prov["reranked"] and prov["set"]["name"] == "refs" and len(r.json()["hits"]) == 5
    # urlencoded, without a file, is the same form
    plain = client.post("/v1/search", content=b"set_id=refs&rubric=stripes&rerank=off&top_n=2",
                        headers={"content-type": "application/x-www-form-urlencoded"})
    assert plain.status_code == 200 and not plain.json()["provenance"]["reranked"] and len(plain.json()["hits"]) == 2


def test_form_errors_name_the_field(client: TestClient, refs: str) -> None:
    assert _errors(client.post("/v1/search", data={"set_id": "refs", "rubric": "x", "top_k": "0"})) == [
        ("body", "top_k")]
    assert _errors(client.post("/v1/search", data={"set_id": "refs", "top_n": "many"})) == [("body", "top_n")]
    assert _errors(client.post("/v1/search", data={"rubric": "x"})) == [("body", "set_id")]
    assert _errors(client.post("/v1/search", data={"set_id": " ", "rubric": "x"})) == [("body", "set_id")]
    assert _errors(client.post("/v1/search", data={"set_id": "refs", "criteria": "ok\n" + "x" * (
        MAX_CRITERION_CHARS + 1)})) == [("body", "criteria", "1")]
    bad = client.post("/v1/search", data={"set_id": "refs", "rubric": "x", "filter": "[1,"})
    assert _errors(bad) == [("body", "filter")] and "the filter is not JSON" in bad.text


def _catalog_rows(state: AppState) -> dict[str, list[tuple[Any, ...]]]:
    with state.catalog.read() as session:
        return {table.name: sorted((tuple(row) for row in session.execute(select(table))), key=repr)
                for table in Base.metadata.sorted_tables}


def test_a_search_writes_nothing(client: TestClient, state: AppState, refs: str) -> None:
    """A set without a vector set (created while no model was loaded; ingestion creates it with the first image)
    is searched as empty, with the reason; no search writes the catalog or the index."""
    created = client.post("/v1/sets", json={"name": "not-yet"}, headers=ADMIN)
    assert created.status_code == 201, created.text
    empty = created.json()["id"]
    state.index.drop_set(empty)  # as a set created before the embedder was known has it
    rows, vectors = _catalog_rows(state), state.index.vectors(refs, sorted(state.index.ids(refs)))
    for body in ({"set_id": "not-yet", "rubric": "stripes"}, {"set_id": "not-yet", "criteria": ["a", "no b"]}):
        r = client.post("/v1/search", json=body)
        assert r.status_code == 200, r.text
        assert r.json()["hits"] == [] and r.json()["provenance"]["reranked"] is False
        status = r.json()["provenance"]["rerank_status"]
        assert status == "skipped: the shortlist is empty (no reference is indexed yet)"
    form = client.post("/v1/search", data={"set_id": "not-yet", "rubric": "stripes", "rerank": "false"})
    assert form.status_code == 200 and form.json()["hits"] == []
    for body in ({"set_id": "refs", "rubric": "stripes"}, {"set_id": "refs", "criteria": ["x"], "top_n": 0}):
        assert client.post("/v1/search", json=body).status_code == 200
    assert not state.index.has_set(empty)
    assert _catalog_rows(state) == rows
    after = state.index.vectors(refs, sorted(state.index.ids(refs)))
    assert after.keys() == vectors.keys() and all((after[k] == v).all() for k, v in vectors.items())


def test_the_python_api_example_answers_what_the_route_answers(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
        capsys: pytest.CaptureFixture[str]) -> None:
    """docs/api.md's ``search_set`` example, run as written on a set "cats", equals ``POST /v1/search``."""
    for key, value in {"RUBRICSEARCH_DATA_DIR": str(tmp_path / "data"),
                       "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(tiny_embedding_dir),
                       "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(tiny_reranker_dir)}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # no stray .env is read
    prepared = open_state(Settings(), ingest=True)
    try:
        cats = prepared.ingestion.create_set("cats")
        job = prepared.ingestion.create_job_from_uploads(cats.id, [(f"c{i}.png", noise_png(40 + 6 * i, 56, 70 + i))
                                                                   for i in range(7)])
        foreground_runner(prepared).run_until_idle(job_id=job.id)
    finally:
        prepared.close()

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "docs" / "api.md").read_text(), flags=re.S)
    example = next(block for block in blocks if "search_set(" in block)
    scope: dict[str, Any] = {}
    exec(example, scope)
    found = scope["found"]
    printed = capsys.readouterr().out.splitlines()
    assert len(found.hits) == 5 and len(printed) == 6 and printed[-1] == "ok 0"
    assert all(set(hit.criteria) == {"short fur", "triangular ears"} for hit in found.hits)

    served = AppState.build(Settings())
    try:
        with served.catalog.read() as session:
            assert resolve_set(session, "cats").id == cats.id
        api = TestClient(create_app(served.settings, state=served)).post(
            "/v1/search", json={"set_id": "cats", "criteria": ["short fur", "triangular ears"], "top_n": 5}).json()
    finally:
        served.close()
    mine = found.model_dump(mode="json")
    assert [h["image"]["sha256"] for h in api["hits"]] == [h["image"]["sha256"] for h in mine["hits"]]
    for a, b in zip(api["hits"], mine["hits"], strict=True):
        assert a["score"] == pytest.approx(b["score"], abs=1e-6) and a["criteria"].keys() == b["criteria"].keys()
    assert api["provenance"] == mine["provenance"] and list(api["provenance"]) == list(mine["provenance"])


@pytest.mark.parametrize("content_type, first", [
    (b"application/json", b'{"set_id": "x", "criteria": ["'),
    (b"multipart/form-data; boundary=b", b'--b\r\nContent-Disposition: form-data; name="set_id"\r\n\r\nx'),
])
def test_a_hang_up_mid_body_is_recorded_as_499(state: AppState, caplog: pytest.LogCaptureFixture,
                                               content_type: bytes, first: bytes) -> None:
    """Either body stops with a disconnect: FastAPI's body reader would make that a 400; it stays a 499."""
    import anyio

    app = create_app(state.settings, state=state)
    sent: list[dict[str, Any]] = []
    chunks = [{"type": "http.request", "body": first, "more_body": True}, {"type": "http.disconnect"}]

    async def receive() -> dict[str, Any]:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/search", "raw_path": b"/v1/search", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", content_type), (b"host", b"x")],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 80), "state": {}}
    with caplog.at_level("INFO"):
        anyio.run(app, scope, receive, send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    assert b'route="/v1/search",status="499"' in app.state.metrics.render()
