"""``POST /v1/visual-packages``: same shape as the per-image GET, cached, one tower per model, and hostile
bodies answered with the error envelope."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from fastapi.testclient import TestClient

from rubricsearch.app.state import AppState
from tests.api_helpers import SEARCH_KEY, bearer, built_state, client_for, data_url, ingest
from tests.conftest import image_server

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
          tiny_reranker_other_tower_dir: Path) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "pkgs", tiny_embedding_dir, tiny_reranker_other_tower_dir,
                           packages={"storage_dtype": "float32"})


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


def _tensor(b64: str) -> torch.Tensor:
    return torch.load(io.BytesIO(base64.b64decode(b64)), weights_only=True)


def test_same_shape_as_get_for_every_form(client: TestClient, state: AppState, make_png) -> None:
    png = make_png(96, 64, 41)
    sha = ingest(state, [png], "pkg-refs")[0]
    got = client.get(f"/v1/images/{sha}/visual-package").json()
    forms: list[Any] = [{"image_id": sha}, data_url(png), base64.b64encode(png).decode()]
    r = client.post("/v1/visual-packages", json={"images": forms})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["model"] == state.embedder.model_id and len(body["data"]) == 3
    for pkg in body["data"]:
        assert set(pkg) == set(got) and pkg["image_sha256"] == sha
        assert pkg["image_grid_thw"] == got["image_grid_thw"]
        assert torch.equal(_tensor(pkg["image_embeds"]), _tensor(got["image_embeds"]))
    multi = client.post("/v1/visual-packages/upload", files=[("files", ("a.png", png, "image/png"))])
    assert multi.status_code == 200, multi.text
    assert multi.json()["data"][0]["image_embeds"] == got["image_embeds"]


def test_cached_by_fingerprint_and_model_picks_the_tower(client: TestClient, state: AppState, make_png) -> None:
    png = make_png(72, 72, 42)
    first = client.post("/v1/visual-packages", json={"images": [data_url(png)]}).json()["data"][0]
    before = state.embedder.packages.stats()
    second = client.post("/v1/visual-packages", json={"images": [data_url(png)]}).json()["data"][0]
    assert first["cached"] is False and second["cached"] is True
    after = state.embedder.packages.stats()
    assert after["vision_encodes"] == before["vision_encodes"]  # nothing encoded for the repeat
    other = client.post("/v1/visual-packages", json={"images": [data_url(png)], "model": "reranker"}).json()
    pkg = other["data"][0]
    assert other["model"] == state.reranker.model_id
    assert pkg["fingerprint"]["tower"] != first["fingerprint"]["tower"]
    assert not torch.equal(_tensor(pkg["image_embeds"]), _tensor(first["image_embeds"]))


@pytest.mark.parametrize(("body", "status"), [
    ({}, 422),
    ({"images": []}, 422),
    ({"images": ["data:image/png;base64,AAAA"]}, 400),
    ({"images": ["not base64 !!"]}, 400),
    ({"images": [{"image_id": "0" * 64}]}, 404),
    ({"images": [{"image_id": "xyz"}]}, 422),
    ({"images": [1, 2]}, 422),
    ({"images": ["data:image/png;base64,AAAA"] * 65}, 422),
    ({"images": ["http://127.0.0.1:1/x.png"]}, 403),  # loopback is refused by the URL guard
    ({"images": ["x"], "model": "gpt-4o"}, 404),
    ({"images": ["x"], "extra": 1}, 422),
])
def test_hostile_bodies(client: TestClient, body: dict[str, Any], status: int) -> None:
    r = client.post("/v1/visual-packages", json=body)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) >= {"type", "message"}


def test_hostile_uploads_and_auth(client: TestClient, state: AppState) -> None:
    r = client.post("/v1/visual-packages/upload", files=[("files", ("a.png", b"\x89PNG garbage", "image/png"))])
    assert r.status_code == 400 and "error" in r.json()
    r = client.post("/v1/visual-packages", content=b"images=1", headers={"content-type": "text/plain"})
    assert r.status_code == 415
    locked = client_for(state, auth={"search_requires_key": True})
    assert locked.post("/v1/visual-packages", json={"images": ["x"]}).status_code == 401
    assert locked.post("/v1/visual-packages", json={"images": ["x"]}, headers=bearer(SEARCH_KEY)).status_code == 400


def test_urls_go_through_the_url_guard(state: AppState, make_png) -> None:
    """A host the operator allowed is fetched (here a loopback server); the package equals the data-URL one."""
    png = make_png(64, 48, 43)

    with image_server(lambda path: (200, png)) as base:
        url = f"{base}/cat.png"
        allowed = client_for(state, ingest={"url_allowed_hosts": [base.removeprefix("http://")]})
        r = allowed.post("/v1/visual-packages", json={"images": [url, data_url(png)]})
        assert r.status_code == 200, r.text
        a, b = r.json()["data"]
        assert a["image_embeds"] == b["image_embeds"] and b["cached"] is False
