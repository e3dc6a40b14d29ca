"""While the models are prepared (the demo's first run trains them) the routes that need no model answer:
sets are listed, created, read and deleted, jobs and images listed; the routes that need a model answer 503
with the progress. The preparation is held open by the test: it opens the stores as the demo's does
(:meth:`AppState.preparing`), then waits for the test before it loads the models."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from rubricsearch.app.warmup import Warmup
from tests.api_helpers import ADMIN_KEY, api_settings, bearer, wait_job
from tests.conftest import noise_png

ADMIN = bearer(ADMIN_KEY)


@pytest.fixture
def warming(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
            ) -> Iterator[tuple[TestClient, threading.Event, Warmup]]:
    """A served app whose preparation has opened its stores and waits for the event to load the models."""
    settings = api_settings(tmp_path / "data", tiny_embedding_dir, tiny_reranker_dir)
    release = threading.Event()

    def prepare(warmup: Warmup) -> AppState:
        state = AppState.preparing(settings)
        warmup.stores = state
        warmup.report("demo models training", 0.25, 600.0)
        try:
            while not release.wait(0.1):
                warmup.check()
            state.load()
        except BaseException:
            state.close()
            raise
        return state

    warmup = Warmup(prepare)
    with TestClient(create_app(settings, warmup=warmup)) as client:
        deadline = time.monotonic() + 60
        while warmup.stores is None:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        yield client, release, warmup


def test_sets_are_listed_and_created_while_the_models_are_prepared(
        warming: tuple[TestClient, threading.Event, Warmup]) -> None:
    client, release, warmup = warming
    png = noise_png(48, 40)
    assert client.get("/v1/sets", headers=ADMIN).json() == {"data": []}
    created = client.post("/v1/sets", json={"name": "cats"}, headers=ADMIN)
    assert created.status_code == 201, created.text
    assert client.post("/v1/sets", json={"name": "gone"}, headers=ADMIN).status_code == 201
    assert client.delete("/v1/sets/gone", headers=ADMIN).status_code == 204
    assert [s["name"] for s in client.get("/v1/sets", headers=ADMIN).json()["data"]] == ["cats"]
    assert client.get("/v1/sets/cats", headers=ADMIN).json()["counts"]["indexed"] == 0
    assert client.get("/v1/sets/cats/images", headers=ADMIN).json()["total"] == 0
    assert client.get("/v1/jobs", headers=ADMIN).json() == {"data": []}
    assert client.post("/v1/sets", json={"name": "cats"}, headers=ADMIN).status_code == 409  # still checked

    # what needs a model waits, and says how long
    search = client.post("/v1/search", json={"set_id": "cats", "criteria": ["short fur"]}, headers=ADMIN)
    upload = client.post("/v1/sets/cats/images", files=[("files", ("a.png", png, "image/png"))], headers=ADMIN)
    for refused in (search, upload):
        assert refused.status_code == 503 and "Retry-After" in refused.headers, refused.text
        assert refused.json()["error"]["details"]["warmup"]["text"] == "demo models training: 25 % — about 10 min left"

    release.set()
    deadline = time.monotonic() + 120
    while not warmup.done:
        assert warmup.failure is None and time.monotonic() < deadline
        time.sleep(0.1)
    # the set made during the preparation takes images once the models are there
    job = client.post("/v1/sets/cats/images", files=[("files", ("a.png", png, "image/png"))], headers=ADMIN)
    assert job.status_code == 202, job.text
    assert wait_job(client, job.json()["id"])["state"] == "succeeded"
    assert client.get("/v1/sets/cats", headers=ADMIN).json()["counts"]["indexed"] == 1
    hits = client.post("/v1/search", json={"set_id": "cats", "criteria": ["short fur"]}, headers=ADMIN)
    assert hits.status_code == 200 and len(hits.json()["hits"]) == 1, hits.text
