"""Shared set-up for the REST API tests: one loaded state (tiny real checkpoints) per test module."""

from __future__ import annotations

import base64
import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from fastapi.testclient import TestClient
from pydantic import SecretStr

from rubricsearch.app.main import create_app
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import ImageSource, add_image, create_set
from tests.conftest import TOWERS

ADMIN_KEY = "admin-key-0123456789abcdef"
SEARCH_KEY = "search-key-0123456789abcdef"


def api_settings(data_dir: Path, embedding: Path, reranker: Path, **overrides: Any) -> Settings:
    """Settings for tests; ``overrides`` are top-level values or, for a group, a dict of the fields it changes
    (``models={"device": "cpu"}``), merged into the defaults here."""
    values: dict[str, Any] = {
        "data_dir": data_dir,
        "models": {"embedding_model": str(embedding), "reranker_model": str(reranker), "dtype": "float32",
                   "embedding_model_aliases": ["my-embedder"],
                   # the plain reference engine even on a CUDA box (Liger's rotary switch is process-wide; the
                   # accelerated engine has its own GPU tests)
                   "engine": "local"},
        "auth": {"admin_api_keys": [ADMIN_KEY], "search_api_keys": [SEARCH_KEY]},
    }
    for name, value in overrides.items():
        values[name] = {**values[name], **value} if isinstance(values.get(name), dict) else value
    return Settings(_env_file=None, **values)


def built_state(tmp_path_factory: Any, name: str, embedding: Path, reranker: Path,
                **overrides: Any) -> Iterator[AppState]:
    """A module fixture's body: an AppState on a fresh data dir, closed afterwards."""
    built = AppState.build(api_settings(tmp_path_factory.mktemp(name), embedding, reranker, **overrides))
    try:
        yield built
    finally:
        built.close()


def tower_states(name: str) -> Any:
    """A module-scoped ``state`` fixture that runs the module once per reranker tower layout (``TOWERS``: the
    embedder's vision tower, or another one), with one ingestion worker and float32 packages."""

    @pytest.fixture(scope="module", params=TOWERS, name="state")
    def state(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
              reranker_dir_for: Callable[[str], Path]) -> Iterator[AppState]:
        yield from built_state(tmp_path_factory, name, tiny_embedding_dir, reranker_dir_for(request.param),
                               ingest={"workers": 1}, packages={"storage_dtype": "float32"})

    return state


def one_state(name: str) -> Any:
    """A module-scoped ``state`` fixture on the first reranker tower layout only, and its ``client`` fixture:
    ``state, client = one_state("name")`` at a module's top."""

    @pytest.fixture(scope="module", name="state")
    def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
              reranker_dir_for: Callable[[str], Path]) -> Iterator[AppState]:
        yield from built_state(tmp_path_factory, name, tiny_embedding_dir, reranker_dir_for(TOWERS[0]),
                               ingest={"workers": 1}, packages={"storage_dtype": "float32"})

    @pytest.fixture(scope="module", name="client")
    def client(state: AppState) -> TestClient:
        return client_for(state)

    return state, client


def client_for(state: AppState, **overrides: Any) -> TestClient:
    """A client on a new app sharing ``state`` (models stay loaded); ``overrides`` change app settings as
    :meth:`Settings.updated` takes them."""
    auth = overrides.get("auth", {})
    for name in ("admin_api_keys", "search_api_keys"):
        if name in auth:
            auth[name] = [SecretStr(k) for k in auth[name]]
    settings = state.settings.updated(overrides)
    return TestClient(create_app(settings, state=state), raise_server_exceptions=False)


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


def ingest(state: AppState, images: list[bytes], set_name: str = "refs") -> list[str]:
    """Put images into the blob store and a reference set, as ingestion would."""
    shas = []
    with state.catalog.write() as session:
        ref = create_set(session, set_name)
        for data in images:
            sha = state.blobs.put(data)
            add_image(session, ref.id, sha256=sha, byte_size=len(data), source=ImageSource.UPLOAD)
            shas.append(sha)
    return shas


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def wait_job(client: httpx.Client, job_id: str) -> dict[str, Any]:
    """The job as GET /v1/jobs/{id} shows it once finished (the server's workers run it in the background);
    ``client`` is a TestClient or an httpx client on a live server."""
    deadline = time.monotonic() + 120
    while True:
        job: dict[str, Any] = client.get(f"/v1/jobs/{job_id}", headers=bearer(ADMIN_KEY)).json()
        if job["state"] not in ("queued", "running"):
            return job
        assert time.monotonic() < deadline, f"job {job_id} did not finish"
        time.sleep(0.05)


@contextmanager
def serve_in_thread(app: FastAPI, log_level: str = "warning") -> Iterator[str]:
    """``app`` served by uvicorn on 127.0.0.1 (an ephemeral port) in a thread; yields its base URL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, log_level=log_level, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 120
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=30)
        sock.close()
