"""One error envelope for every failure; auth, limits and the kind -> status table."""

from __future__ import annotations

import inspect
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

import rubricsearch.app.auth as auth
import rubricsearch.retrieval.errors as domain
from rubricsearch.app import http_limits
from rubricsearch.app.deps import MAX_INPUTS, AdminAccess
from rubricsearch.app.errors import STATUS_BY_KIND, status_for
from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from tests.api_helpers import ADMIN_KEY, SEARCH_KEY, api_settings, bearer, built_state, client_for, data_url


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "api-errors", tiny_embedding_dir, tiny_reranker_dir)


def _with_test_routes(client: TestClient) -> TestClient:
    """A mutation guarded like every real one, and a route that fails unexpectedly."""
    def mutate(_: AdminAccess) -> dict[str, bool]:
        return {"changed": True}

    def boom() -> None:
        raise RuntimeError("secret internals at /srv/private")

    client.app.add_api_route("/v1/test-mutation", mutate, methods=["POST"])  # type: ignore[attr-defined]
    client.app.add_api_route("/test-boom", boom, methods=["GET"])  # type: ignore[attr-defined]
    return client


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return _with_test_routes(client_for(state))


def _error(response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"type", "message", "details"}
    assert body["error"]["type"] == kind and body["error"]["message"]
    return body["error"]


def test_every_domain_error_has_a_status() -> None:
    classes = [c for _, c in inspect.getmembers(domain, inspect.isclass) if issubclass(c, domain.RubricSearchError)]
    assert len(classes) >= 13
    for cls in classes:
        assert cls.kind in STATUS_BY_KIND, cls

    class Custom(domain.ImageError):
        kind = "some_new_image_problem"

    assert status_for(Custom("x")) == 400  # an unlisted kind inherits its parent's status


def test_bad_input_is_400(client: TestClient, make_png, monkeypatch: pytest.MonkeyPatch) -> None:
    for image in ("http://127.0.0.1:9/x.png", "/etc/passwd", "file:///etc/hostname", "data:image/png,notbase64",
                  data_url(b"not an image")):
        err = _error(client.post("/v1/embeddings", json={"input": [{"image": image}]}), 400, "invalid_image")
        assert "root:" not in err["message"]
    _error(client.post("/v1/embeddings", json={"input": "a", "dimensions": 10}), 400, "invalid_input")
    _error(client.post("/v1/embeddings", json={"messages": [{"role": "assistant", "content": "hi"}]}),
           400, "invalid_input")
    monkeypatch.setitem(MAX_INPUTS, "embedding", 2)  # every embedding and rerank route reads the one table
    monkeypatch.setitem(MAX_INPUTS, "reranker", 1)
    small = client_for(client.app.state.rubricsearch)  # type: ignore[attr-defined]
    assert small.post("/v1/embeddings", json={"input": ["a", "b"]}).status_code == 200  # within the bound
    _error(small.post("/v1/embeddings", json={"input": ["a", "b", "c"]}), 400, "invalid_input")
    _error(small.post("/v1/rerank", json={"query": "q", "documents": ["a", "b"]}), 400, "invalid_input")
    emb, rr = (client.app.state.rubricsearch.model(kind).model_id  # type: ignore[attr-defined]
               for kind in ("embedding", "reranker"))
    _error(small.post("/v2/embed", json={"model": emb, "texts": ["a", "b", "c"], "input_type": "search_document",
                                         "embedding_types": ["float"]}), 400, "invalid_input")
    _error(small.post("/v2/rerank", json={"model": rr, "query": "q", "documents": ["a", "b"]}), 400, "invalid_input")


def test_validation_errors_are_422_without_echoing_input(client: TestClient) -> None:
    cases = [
        {"input": [{"images": "typo"}]},
        {"input": [1, 2, 3]},
        {"input": "a", "messages": [{"role": "user", "content": "b"}]},
        {"input": "a", "encoding_format": "int8"},
        {"query": "only rerank fields"},
    ]
    for body in cases:
        err = _error(client.post("/v1/embeddings", json=body), 422, "validation_error")
        assert err["details"]["errors"] and all("input" not in e for e in err["details"]["errors"])
    err = _error(client.post("/v1/embeddings", json={"input": [1, 2]}), 422, "validation_error")
    assert "token-id input is not supported" in err["message"]
    _error(client.post("/v1/rerank", json={"query": "q", "documents": [{"text": "a", "content": []}]}),
           422, "validation_error")
    _error(client.post("/v1/embeddings", content=b"{not json", headers={"content-type": "application/json"}),
           422, "validation_error")


def test_routing_errors(client: TestClient) -> None:
    _error(client.get("/v1/nothing-here"), 404, "not_found")
    _error(client.get("/v1/embeddings"), 405, "method_not_allowed")
    _error(client.post("/v1/embeddings", content=b"input=a", headers={"content-type": "text/plain"}),
           415, "unsupported_media_type")
    _error(client.post("/v1/rerank", data={"query": "a"}), 415, "unsupported_media_type")


def test_body_limits_are_413(state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(http_limits, "MAX_REQUEST_BYTES", 2048)  # read when the app is made
    small = client_for(state)
    err = _error(small.post("/v1/embeddings", json={"input": "x" * 5000}), 413, "payload_too_large")
    assert err["details"]["limit"] == 2048

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streaming cap must stop it
        yield b'{"input": "'
        for _ in range(10):
            yield b"x" * 1000
        yield b'"}'

    _error(small.post("/v1/embeddings", content=chunks(), headers={"content-type": "application/json"}),
           413, "payload_too_large")
    assert small.post("/v1/embeddings", json={"input": "fits"}).status_code == 200


def test_image_over_byte_limit_is_413(state: AppState, make_png, monkeypatch: pytest.MonkeyPatch) -> None:
    big = make_png(300, 300, 5)
    monkeypatch.setattr("rubricsearch.app.settings.MAX_IMAGE_BYTES", 1024)
    c = TestClient(create_app(state.settings, state=state), raise_server_exceptions=False)
    _error(c.post("/v1/embeddings", json={"input": [{"image": data_url(big)}]}), 413, "payload_too_large")


def test_admin_key_required_for_mutations(client: TestClient, state: AppState) -> None:
    _error(client.post("/v1/test-mutation"), 401, "unauthorized")
    assert client.post("/v1/test-mutation").headers["www-authenticate"] == "Bearer"
    _error(client.post("/v1/test-mutation", headers=bearer("wrong-key-0123456789")), 401, "unauthorized")
    _error(client.post("/v1/test-mutation", headers=bearer(SEARCH_KEY)), 403, "forbidden")
    assert client.post("/v1/test-mutation", headers=bearer(ADMIN_KEY)).json() == {"changed": True}
    keyless = _with_test_routes(client_for(state, auth={"admin_api_keys": []}))
    _error(keyless.post("/v1/test-mutation", headers=bearer(ADMIN_KEY)), 403, "forbidden")


def test_search_keys_when_required(client: TestClient, state: AppState) -> None:
    # open by default; an unknown key is ignored there because OpenAI clients always send one
    assert client.post("/v1/embeddings", json={"input": "a"}, headers=bearer("EMPTY")).status_code == 200
    closed = client_for(state, auth={"search_requires_key": True})
    _error(closed.post("/v1/embeddings", json={"input": "a"}), 401, "unauthorized")
    _error(closed.post("/v1/rerank", json={"query": "a", "documents": ["b"]}, headers=bearer("EMPTY")),
           401, "unauthorized")
    _error(closed.get(f"/v1/images/{'ab' * 32}/visual-package"), 401, "unauthorized")
    for key in (SEARCH_KEY, ADMIN_KEY):
        assert closed.post("/v1/embeddings", json={"input": "a"}, headers=bearer(key)).status_code == 200


def test_rate_limit_is_429(state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(auth, "RATE_LIMIT_BURST", 2)
    limited = client_for(state, auth={"rate_limit_per_minute": 1})
    assert [limited.get("/v1/models").status_code for _ in range(2)] == [200, 200]
    r = limited.get("/v1/models")
    _error(r, 429, "rate_limited")
    assert int(r.headers["retry-after"]) >= 1
    assert limited.get("/v1/models", headers=bearer(SEARCH_KEY)).status_code == 200  # a key has its own bucket
    assert limited.get("/healthz").status_code == 200  # probes are never limited
    assert all(limited.get("/v1/models", headers=bearer(ADMIN_KEY)).status_code == 200 for _ in range(3))


def test_not_ready_is_503(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path) -> None:
    app = create_app(api_settings(tmp_path, tiny_embedding_dir, tiny_reranker_dir))
    c = TestClient(app, raise_server_exceptions=False)  # lifespan not run: nothing is loaded
    _error(c.get("/readyz"), 503, "backend_unavailable")
    _error(c.post("/v1/embeddings", json={"input": "a"}), 503, "backend_unavailable")
    assert c.get("/healthz").status_code == 200


def test_models_that_cannot_load_stop_start_up(tmp_path: Path, tiny_reranker_dir: Path) -> None:
    settings = api_settings(tmp_path, tmp_path / "no-such-model", tiny_reranker_dir)
    with pytest.raises(domain.BackendUnavailable), TestClient(create_app(settings)):
        pass


def test_unexpected_errors_are_500_without_internals(client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    r = client.get("/test-boom", headers=bearer(ADMIN_KEY))
    err = _error(r, 500, "internal_error")
    assert "secret" not in r.text and "/srv" not in r.text and err["details"] == {}
    assert client.get("/healthz").status_code == 200  # the server stays up
    client.post("/v1/test-mutation", headers=bearer(ADMIN_KEY + "x"))
    client.post("/v1/embeddings", json={"input": 5}, headers=bearer(SEARCH_KEY))
    assert "secret internals" in caplog.text  # logged for the operator...
    assert ADMIN_KEY not in caplog.text and SEARCH_KEY not in caplog.text and "Bearer" not in caplog.text


def test_a_client_that_hangs_up_mid_body_is_no_server_error(state: AppState, caplog: pytest.LogCaptureFixture
                                                           ) -> None:
    """The body of a search stops with a disconnect: no 500, no ERROR log, and the metrics record 499."""
    import anyio

    app = create_app(state.settings, state=state)
    sent: list[dict] = []
    chunks = [{"type": "http.request", "body": b'{"set_id": "x", "criteria": ["', "more_body": True},
              {"type": "http.disconnect"}]

    async def receive() -> dict:
        return chunks.pop(0) if chunks else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST",
             "scheme": "http", "path": "/v1/search", "raw_path": b"/v1/search", "query_string": b"",
             "root_path": "", "headers": [(b"content-type", b"application/json"), (b"host", b"x")],
             "client": ("127.0.0.1", 5), "server": ("127.0.0.1", 80), "state": {}}
    with caplog.at_level("INFO"):
        anyio.run(app, scope, receive, send)
    assert [m["status"] for m in sent if m["type"] == "http.response.start"] == [499]
    assert not [r for r in caplog.records if r.levelname == "ERROR"]
    metrics = app.state.metrics.render()
    assert b'status="499"' in metrics and b'route="/v1/search",status="500"' not in metrics
