"""The decoded-pixel budget: held per request and per ingestion batch for the images' declared pixels, a request
over it waits briefly and then gets 503 with Retry-After, ingestion batches are cut to ``batch_pixels`` from the
first claim, and request images have their own per-image limit."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import ItemState, JobState
from rubricsearch.indexer.jobs import IngestionService
from rubricsearch.retrieval.errors import Overloaded
from rubricsearch.retrieval.pixel_budget import PixelBudget
from tests.api_helpers import built_state, client_for, data_url
from tests.conftest import noise_png
from tests.test_ingestion import items, make_service, runner  # noqa: F401  (the fixture)

pytestmark = pytest.mark.timeout(120)


def test_the_budget_waits_then_refuses_and_lets_waiters_in() -> None:
    budget = PixelBudget(100, wait_s=0.2)
    with budget.hold(60):
        t0 = time.monotonic()
        with pytest.raises(Overloaded) as refused, budget.hold(50):
            pass
        assert time.monotonic() - t0 >= 0.2 and refused.value.details["retry_after_s"] == 1
        got: list[float] = []

        def later() -> None:
            with budget.hold(50, wait_s=5):
                got.append(time.monotonic())

        waiter = threading.Thread(target=later)
        waiter.start()
        time.sleep(0.1)
        released = time.monotonic()
    waiter.join()
    assert got and got[0] >= released and budget.used == 0
    with budget.hold(10**9) as held:  # larger than the budget: takes all of it, alone
        assert held == 100


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "pixel-budget", tiny_embedding_dir, tiny_reranker_dir)


def test_a_request_over_the_budget_gets_503_with_retry_after(state: AppState) -> None:
    assert state.packages.pixel_budget is not None  # the app builds one
    budget = PixelBudget(100 * 100, wait_s=0.3)
    state.packages.pixel_budget = budget
    client = client_for(state)
    image = data_url(noise_png(80, 90, seed=41))
    with budget.hold(100 * 100 - 80 * 90 + 1):  # others hold all but too little
        refused = client.post("/v1/embeddings", json={"input": [{"image": image}]})
        assert refused.status_code == 503, refused.text
        assert refused.json()["error"]["type"] == "overloaded" and refused.headers["Retry-After"] == "1"
        search = client.post("/v1/rerank", json={"query": {"image": image}, "documents": ["a"]})
        assert search.status_code == 503
    assert budget.refused == 2
    assert client.post("/v1/embeddings", json={"input": [{"image": image}]}).status_code == 200
    # a cached image decodes nothing, so it needs no room
    with budget.hold(100 * 100):
        assert client.post("/v1/embeddings", json={"input": [{"image": image}]}).status_code == 200


def test_request_images_have_their_own_pixel_limit(state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("rubricsearch.app.settings.MAX_QUERY_IMAGE_PIXELS", 2500)
    limited = dataclasses.replace(state, settings=state.settings.updated({}))
    client = TestClient(create_app(limited.settings, state=limited), raise_server_exceptions=False)
    refused = client.post("/v1/embeddings", json={"input": [{"image": data_url(noise_png(60, 60, seed=42))}]})
    assert refused.status_code == 400 and "limit is 2500" in refused.json()["error"]["message"]
    assert client.post("/v1/embeddings", json={"input": [{"image": data_url(noise_png(50, 50, seed=43))}]}
                       ).status_code == 200


@pytest.mark.parametrize("overlapped", [True, False], ids=["overlapped", "one-batch-at-a-time"])
def test_ingestion_batches_fit_the_pixel_bound_from_the_first_claim(
        make_service: Callable[..., IngestionService], monkeypatch: pytest.MonkeyPatch,  # noqa: F811
        overlapped: bool) -> None:
    service = make_service()
    budget = PixelBudget(10**9)
    service.packages.pixel_budget = budget
    work = runner(service, batch_size=8, batch_pixels=3 * 64 * 64, pipeline=overlapped)
    batches: list[tuple[int, int]] = []  # (images prepared, pixels held meanwhile)
    real_prepare = work.processor.packages.prepare

    def spy(images: list[Any]) -> Any:
        batches.append((len(images), budget.used))
        return real_prepare(images)

    monkeypatch.setattr(work.processor.packages, "prepare", spy)
    ref = service.create_set("big", embedding_dim=64)
    job = service.create_job_from_uploads(ref.id, [(f"{i}.png", noise_png(64, 64, seed=200 + i)) for i in range(8)])
    assert work.run_until_idle() == 8
    assert service.get_job(job.id).state == JobState.SUCCEEDED
    assert [n for n, _ in batches] == [3, 3, 2]  # the first claim took 8; its batch kept what fits
    assert [held for _, held in batches] == [n * 64 * 64 for n, _ in batches]
    assert all(i.state == ItemState.DONE and i.attempts <= 1 for i in items(service, job.id))
