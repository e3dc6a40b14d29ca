"""Hostile text and bodies a fuzzer rarely makes: lone surrogates and NUL characters (which UTF-8 encoders,
tokenizers, file systems and PostgreSQL refuse), object nesting, wrong top-level types, invalid UTF-8 and
broken multipart. Each is a 4xx in the error envelope, never a 500, and the client goes on."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.state import AppState
from tests.api_helpers import ADMIN_KEY, bearer, built_state, client_for

JSON = {"content-type": "application/json"}
ADMIN_JSON = {**JSON, **bearer(ADMIN_KEY)}


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "api-hostile-text", tiny_embedding_dir, tiny_reranker_dir)


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


@pytest.fixture(scope="module")
def set_id(client: TestClient) -> str:
    return str(client.post("/v1/sets", json={"name": "hostile"}, headers=bearer(ADMIN_KEY)).json()["id"])


def _is_4xx(response) -> None:
    assert 400 <= response.status_code < 500, (response.status_code, response.text[:300])
    error = response.json()["error"]
    assert error["type"] and error["message"]


def _json_routes(set_id: str) -> list[str]:
    return ["/v1/search", "/v1/embeddings", "/v1/rerank", "/v1/sets", f"/v1/sets/{set_id}/imports"]


@pytest.mark.parametrize("text", ["\\ud800", "a\\udfffb", "\\u0000", "nul\\u0000inside"])
def test_lone_surrogates_and_nul_are_4xx(client: TestClient, set_id: str, text: str) -> None:
    bodies = {
        "/v1/search": f'{{"set_id": "{set_id}", "criteria": ["{text}"]}}',
        "/v1/embeddings": f'{{"input": "{text}"}}',
        "/v1/rerank": f'{{"query": "{text}", "documents": ["x"]}}',
        "/v1/sets": f'{{"name": "{text}"}}',
        f"/v1/sets/{set_id}/imports": f'{{"urls": ["http://127.0.0.1/{text}"]}}',
    }
    for route, body in bodies.items():
        response = client.post(route, content=body, headers=ADMIN_JSON)
        if "\\u0000" in text and route in ("/v1/search", "/v1/embeddings", "/v1/rerank"):
            # NUL is a character a tokenizer reads; models may take it. A surrogate is not text.
            assert response.status_code < 500, (route, response.status_code, response.text[:300])
            continue
        if "\\u0000" in text and route == "/v1/sets" and text != "\\u0000":
            # a set name loses its control characters on the way in (indexer/names.py)
            assert response.status_code == 201 and response.json()["name"] == text.replace("\\u0000", "")
            continue
        _is_4xx(response)
    assert client.get("/healthz").status_code == 200


def test_object_nesting_and_wrong_top_level_types_are_4xx(client: TestClient, set_id: str) -> None:
    deep = '{"a": ' * 5000 + "1" + "}" * 5000
    for route in _json_routes(set_id):
        for body in (deep, "[]", '"x"', "null", "1e999", "NaN", "{", "\xff\xfe", '{"name": 1e999}'):
            _is_4xx(client.post(route, content=body.encode("latin-1"), headers=ADMIN_JSON))
    assert client.get("/healthz").status_code == 200


def test_broken_multipart_is_4xx(client: TestClient, set_id: str) -> None:
    route = f"/v1/sets/{set_id}/images"
    auth = bearer(ADMIN_KEY)
    good = b'--XX\r\ncontent-disposition: form-data; name="files"; filename="a.png"\r\n\r\nabc\r\n--XX--\r\n'
    cases = [
        ("multipart/form-data", good),  # no boundary
        ("multipart/form-data; boundary=XX", good[:40]),  # truncated
        ("multipart/form-data; boundary=YY", good),  # wrong boundary
        ("multipart/form-data; boundary=XX", b"--XX\r\n\r\n\r\n--XX--\r\n"),  # a part without disposition
        ("multipart/form-data; boundary=XX", b""),
        ("text/plain", b"hello"),
        ("application/x-www-form-urlencoded", b"files=%ZZ&&=="),
    ]
    for content_type, body in cases:
        _is_4xx(client.post(route, content=body, headers={**auth, "content-type": content_type}))
    # A file name that is not UTF-8 is still a file: the job takes it and reports the item, not a 500.
    odd_name = (b'--XX\r\ncontent-disposition: form-data; name="files"; filename="\xff\xfe.png"\r\n\r\n'
                b"abc\r\n--XX--\r\n")
    response = client.post(route, content=odd_name,
                           headers={**auth, "content-type": "multipart/form-data; boundary=XX"})
    assert response.status_code == 202, response.text[:300]
    assert client.get("/healthz").status_code == 200


@pytest.mark.parametrize("value", ["9" * 30, "-" + "9" * 30, "-1", "0", "1e3", "NaN", "\u0661"])
def test_odd_numbers_in_every_path_and_query(client: TestClient, set_id: str, value: str) -> None:
    auth = bearer(ADMIN_KEY)
    requests = [
        ("GET", f"/v1/jobs/{value}"), ("POST", f"/v1/jobs/{value}/cancel"), ("GET", f"/v1/jobs/{value}/events"),
        ("GET", f"/v1/sets/{value}"), ("DELETE", f"/v1/sets/{value}"),
        ("GET", f"/v1/sets/{set_id}/images?after={value}"), ("GET", f"/v1/sets/{set_id}/images?limit={value}"),
        ("DELETE", f"/v1/sets/{set_id}/images/{value}"), ("GET", f"/v1/jobs?limit={value}"),
        ("GET", f"/v1/jobs?after={value}"), ("GET", f"/v1/jobs?set_id={value}"),
        ("GET", f"/?set={value}"), ("GET", f"/admin?job={value}"),
    ]
    for method, url in requests:
        response = client.request(method, url, headers=auth)
        assert response.status_code < 500, (method, url, response.status_code, response.text[:300])


def test_odd_credentials_and_forms(client: TestClient) -> None:
    """Headers and forms a browser never sends: non-ASCII keys, odd schemes, broken login forms, odd cookies."""
    for header in ("Bearer \xe9\xe9", "Bearer ", "Bearer a b", "Basic Zm9vOmJhcg==", "bearer" + " x" * 2000):
        response = client.get("/v1/sets", headers={"Authorization": header.encode("latin-1")})
        assert response.status_code < 500, (header[:20], response.status_code)
    for body in (b"", b"key=%ZZ", b"key=\xff&csrf=\xfe", b"key=" + b"k" * 100_000, b"&&&===", b"key=\x00"):
        response = client.post("/admin/login", content=body,
                               headers={"content-type": "application/x-www-form-urlencoded"})
        assert response.status_code < 500, (body[:20], response.status_code, response.text[:200])
    for cookie in ("\xff\xfe", "x" * 5000, "rubricsearch_session=%%%; a=b", "=;=;="):
        response = client.get("/admin", headers={"cookie": cookie.encode("latin-1")})
        assert response.status_code < 500, (cookie[:20], response.status_code)
    for path in ("/static/../app/main.py", "/static/%2e%2e/%2e%2e/etc/passwd", "/static/%00", "/static/" + "a" * 5000):
        response = client.get(path)
        assert response.status_code in (400, 404, 405), (path[:40], response.status_code)
    assert client.get("/healthz").status_code == 200


def test_odd_import_sources(state: AppState, tmp_path: Path) -> None:
    """Folder and URL imports with names no file system or URL parser takes: 4xx, or a job whose items fail."""
    (tmp_path / "sub").mkdir()
    folders = AppState.build(state.settings.model_copy(update={"import_root": tmp_path,
                                                                "data_dir": tmp_path / "data"}))
    client = client_for(folders)
    set_id = client.post("/v1/sets", json={"name": "imports"}, headers=bearer(ADMIN_KEY)).json()["id"]
    route = f"/v1/sets/{set_id}/imports"
    for folder in ("sub\\u0000x", "\\u0000", "../../etc", "/etc", "sub/" + "a" * 5000, "sub/\\udcff", "C:\\\\x"):
        body = '{"folder": "' + folder + '"}'
        response = client.post(route, content=body, headers=ADMIN_JSON)
        assert 400 <= response.status_code < 500, (folder[:20], response.status_code, response.text[:300])
    # Not storable (NUL, control characters, over-long, empty): refused before a job exists.
    for url in ("http://\\u0000/", "http://127.0.0.1/\\u0000", "http://a" + "a" * 100_000, "", "http://a b/"):
        response = client.post(route, content='{"urls": ["' + url + '"]}', headers=ADMIN_JSON)
        _is_4xx(response)
    # Storable but unfetchable: a job whose item fails (the worker reports why).
    for url in ("http://[::1", "http://127.0.0.1:99999/", "http://127.0.0.1:-1/", "ftp://127.0.0.1/a", "x"):
        response = client.post(route, content='{"urls": ["' + url + '"]}', headers=ADMIN_JSON)
        assert response.status_code in (202, 400, 422), (url[:20], response.status_code, response.text[:300])
    response = client.post("/v1/sets", content='{"name": "d", "description": "a\\u0000b"}', headers=ADMIN_JSON)
    _is_4xx(response)
    assert client.get("/healthz").status_code == 200
    folders.close()


@pytest.mark.postgres
def test_nul_anywhere_is_4xx_on_postgresql(state: AppState, postgres_schema_url: str, tmp_path: Path) -> None:
    """PostgreSQL text cannot hold NUL: a NUL in a path, query, body or file name is refused, never a 500."""
    pg = AppState.build(state.settings.model_copy(update={"database_url": postgres_schema_url,
                                                          "data_dir": tmp_path / "data"}))
    try:
        client = client_for(pg)
        auth = bearer(ADMIN_KEY)
        set_id = client.post("/v1/sets", json={"name": "pg"}, headers=auth).json()["id"]
        for method, url in [("GET", "/v1/sets/a%00b"), ("DELETE", "/v1/sets/a%00b"), ("GET", "/v1/jobs/a%00b"),
                            ("POST", "/v1/jobs/a%00b/cancel"), ("GET", "/v1/jobs?set_id=a%00b"),
                            ("GET", "/v1/sets/a%00b/images"), ("DELETE", f"/v1/sets/{set_id}/images/a%00b"),
                            ("GET", "/?set=a%00b"), ("GET", "/admin?job=a%00b")]:
            response = client.request(method, url, headers=auth)
            assert response.status_code < 500, (method, url, response.text)
        named = client.post("/v1/sets", content='{"name": "a\\u0000b"}', headers=ADMIN_JSON)
        assert named.status_code == 201 and named.json()["name"] == "ab"  # names lose control characters
        for route, body in [("/v1/sets", '{"name": "n", "description": "\\u0000"}'),
                            ("/v1/search", '{"set_id": "a\\u0000b", "criteria": ["x"]}'),
                            (f"/v1/sets/{set_id}/imports", '{"urls": ["http://127.0.0.1/\\u0000"]}')]:
            _is_4xx(client.post(route, content=body, headers=ADMIN_JSON))
        upload = (b'--XX\r\ncontent-disposition: form-data; name="files"; filename="a\x00b.png"\r\n\r\n'
                  b"abc\r\n--XX--\r\n")
        response = client.post(f"/v1/sets/{set_id}/images", content=upload,
                               headers={**auth, "content-type": "multipart/form-data; boundary=XX"})
        assert response.status_code < 500, response.text
        assert client.get(f"/v1/sets/{set_id}", headers=auth).status_code == 200
    finally:
        pg.close()
