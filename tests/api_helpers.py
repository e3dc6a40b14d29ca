"""Shared set-up for the REST API tests: one loaded state (tiny real checkpoints) per test module."""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fastapi.testclient import TestClient
from pydantic import SecretStr

from app.main import create_app
from app.settings import Settings
from app.state import AppState
from indexer.catalog import ImageSource, add_image, create_set

ADMIN_KEY = "admin-key-0123456789abcdef"
SEARCH_KEY = "search-key-0123456789abcdef"


def api_settings(data_dir: Path, embedding: Path, reranker: Path, **overrides: Any) -> Settings:
    values: dict[str, Any] = dict(
        data_dir=data_dir, embedding_model=str(embedding), reranker_model=str(reranker), dtype="float32",
        admin_api_keys=[ADMIN_KEY], search_api_keys=[SEARCH_KEY], embedding_model_aliases=["my-embedder"],
    )
    values.update(overrides)
    return Settings(_env_file=None, **values)


def built_state(tmp_path_factory: Any, name: str, embedding: Path, reranker: Path,
                **overrides: Any) -> Iterator[AppState]:
    """A module fixture's body: an AppState on a fresh data dir, closed afterwards."""
    built = AppState.build(api_settings(tmp_path_factory.mktemp(name), embedding, reranker, **overrides))
    try:
        yield built
    finally:
        built.close()


def client_for(state: AppState, **overrides: Any) -> TestClient:
    """A client on a new app sharing ``state`` (models stay loaded); ``overrides`` change app settings."""
    for name in ("admin_api_keys", "search_api_keys"):
        if name in overrides:
            overrides[name] = [SecretStr(k) for k in overrides[name]]
    settings = state.settings.model_copy(update=overrides)
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
