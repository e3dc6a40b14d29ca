"""Web UI sessions are bound to the admin key that signed in: rotating or removing it ends them."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi import Response
from fastapi.testclient import TestClient
from pydantic import SecretStr

from rubricsearch.app.auth import issue_admin_session
from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from tests.api_helpers import ADMIN_KEY, built_state


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "sessions", tiny_embedding_dir, tiny_reranker_dir)


def error(response: Any, status: int, kind: str) -> None:
    assert response.status_code == status, response.text
    assert response.json()["error"]["type"] == kind


def test_a_session_ends_when_its_key_is_rotated_out(state: AppState) -> None:
    """With a fixed session secret, a cookie survives restarts only while the admin key that signed in is still
    configured: removing that key (or rotating to a new one) ends it, other keys' sessions go on."""
    new_key = "admin-key-rotated-0123456789ab"

    def app_with(*keys: str) -> TestClient:
        settings = state.settings.updated({"auth": {"session_secret": SecretStr("s" * 32), "search_requires_key": True,
                                                    "admin_api_keys": [SecretStr(k) for k in keys]}})
        client = TestClient(create_app(settings, state=state), raise_server_exceptions=False)

        def login(response: Response, key: str) -> dict[str, str]:
            return {"csrf": issue_admin_session(response, settings, key)}

        client.app.add_api_route("/test-login", login, methods=["POST"])  # type: ignore[attr-defined]
        return client

    sessions = {}
    for key in (ADMIN_KEY, new_key):
        c = app_with(ADMIN_KEY, new_key)
        csrf = c.post("/test-login", params={"key": key}).json()["csrf"]
        sessions[key] = (c.cookies["rs_session"], csrf)

    def create(keys: tuple[str, ...], session: str, name: str) -> Any:
        c = app_with(*keys)
        cookie, csrf = sessions[session]
        c.cookies.set("rs_session", cookie)
        return c.post("/v1/sets", json={"name": name}, headers={"X-CSRF-Token": csrf})

    assert create((ADMIN_KEY, new_key), ADMIN_KEY, "rot-both").status_code == 201
    error(create((new_key,), ADMIN_KEY, "rot-removed"), 401, "unauthorized")  # its key was removed
    assert create((new_key,), new_key, "rot-new").status_code == 201  # the other key's session goes on
    error(create((ADMIN_KEY,), new_key, "rot-rotated"), 401, "unauthorized")
    reader = app_with(new_key)
    reader.cookies.set("rs_session", sessions[ADMIN_KEY][0])
    error(reader.get("/v1/sets"), 401, "unauthorized")  # no longer an admin session, even to read
