"""Bounded work per request: size limits refuse before tokenising, token limits refuse unless the caller asks
for truncation, and malformed numbers or nesting are 4xx in the error envelope, never a 500."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from pydantic import SecretStr

from rubricsearch.app import http_limits
from rubricsearch.app.schemas.common import MAX_INSTRUCTION_CHARS, MAX_TEXT_CHARS
from rubricsearch.app.services import MAX_CRITERIA
from rubricsearch.app.state import AppState
from tests.api_helpers import ADMIN_KEY, bearer, built_state, client_for


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "api-limits", tiny_embedding_dir, tiny_reranker_dir)


@pytest.fixture(scope="module")
def set_id(state: AppState) -> str:
    client = client_for(state)
    return str(client.post("/v1/sets", json={"name": "limits"}, headers=bearer(ADMIN_KEY)).json()["id"])


@pytest.fixture(scope="module")
def client(state: AppState, set_id: str) -> TestClient:
    return client_for(state)


def _error(response, status: int, kind: str) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert error["type"] == kind and error["message"]
    return dict(error)


def _long_text(state: AppState, tokens_wanted: int) -> str:
    """Text over ``tokens_wanted`` tokens yet under the character limit (multi-byte characters: the tiny
    byte-level tokenizer spends several tokens on each)."""
    tokenizer = state.embedder.runtime.loaded.processor.tokenizer  # type: ignore[attr-defined]
    text = "".join(chr(0x4E00 + (i * 7) % 5000) for i in range(MAX_TEXT_CHARS // 2))
    assert len(tokenizer(text)["input_ids"]) > tokens_wanted + 50
    return text


def test_deep_nesting_is_422_and_the_client_goes_on(client: TestClient, set_id: str) -> None:
    body = '{{"set_id": "{}", "criteria": {}}}'.format(set_id, "[" * 5000 + "]" * 5000)
    _error(client.post("/v1/search", content=body, headers={"content-type": "application/json"}),
           422, "validation_error")
    assert client.get("/healthz").status_code == 200


def test_huge_and_negative_integers_are_4xx(client: TestClient, set_id: str) -> None:
    huge = "9" * 30
    error = _error(client.get(f"/v1/sets/{set_id}/images", params={"after": huge}), 422, "validation_error")
    assert "after" in error["message"]
    _error(client.get(f"/v1/sets/{set_id}/images", params={"after": -1}), 422, "validation_error")
    _error(client.delete(f"/v1/sets/{set_id}/images/{huge}", headers=bearer(ADMIN_KEY)), 404, "not_found")
    _error(client.get(f"/v1/jobs/{huge}", headers=bearer(ADMIN_KEY)), 404, "not_found")


def test_nan_and_infinity_are_422(client: TestClient, set_id: str) -> None:
    for literal in ("NaN", "Infinity", "-Infinity", "1e999"):
        body = f'{{"set_id": "{set_id}", "rubric": "x", "top_k": {literal}}}'
        _error(client.post("/v1/search", content=body, headers={"content-type": "application/json"}),
               422, "validation_error")


def test_text_over_the_character_limit_is_refused_before_tokenising(client: TestClient, state: AppState) -> None:
    before = state.embedder.stats["lm_tokens"]
    error = _error(client.post("/v1/embeddings", json={"input": "a" * (MAX_TEXT_CHARS + 1)}), 422,
                   "validation_error")
    assert str(MAX_TEXT_CHARS) in error["message"]
    error = _error(client.post("/v1/rerank", json={"query": "q", "documents": ["d"],
                                                   "instruction": "i" * (MAX_INSTRUCTION_CHARS + 1)}),
                   422, "validation_error")
    assert str(MAX_INSTRUCTION_CHARS) in error["message"]
    assert state.embedder.stats["lm_tokens"] == before  # nothing reached the model


def test_too_many_criteria_is_one_clear_error(client: TestClient, state: AppState, set_id: str) -> None:
    """One limit (MAX_CRITERIA, what the compare page says), one message, however many are sent."""
    limit = MAX_CRITERIA
    for count in (limit + 1, 33, 200):
        body = {"set_id": set_id, "criteria": [f"c{i}" for i in range(count)]}
        error = _error(client.post("/v1/search", json=body), 400, "invalid_input")
        assert error["message"] == f"at most {limit} criteria are allowed, got {count}"


def test_over_the_token_limit_is_refused_unless_truncation_is_asked(client: TestClient, state: AppState) -> None:
    limit = state.embedder.max_length  # type: ignore[attr-defined]
    text = _long_text(state, limit)
    error = _error(client.post("/v1/embeddings", json={"input": text}), 413, "payload_too_large")
    assert error["details"]["limit"] == limit and error["details"]["tokens"] > limit
    ok = client.post("/v1/embeddings", json={"input": text, "truncate": True})
    assert ok.status_code == 200, ok.text
    assert ok.json()["usage"]["prompt_tokens"] == limit  # cut to the limit, as the official classes cut

    rerank_limit = state.reranker.max_length  # type: ignore[attr-defined]
    doc = _long_text(state, rerank_limit)
    error = _error(client.post("/v1/rerank", json={"query": "q", "documents": [doc]}), 413, "payload_too_large")
    assert error["details"]["limit"] == rerank_limit
    ok = client.post("/v1/rerank", json={"query": "q", "documents": [doc], "truncate": True})
    assert ok.status_code == 200, ok.text


def test_keys_are_compared_whole_not_by_length(state: AppState) -> None:
    """A wrong key of the admin key's length, and the search key brought to it, are not admin keys."""
    from tests.api_helpers import SEARCH_KEY

    client = client_for(state)
    same_length = "x" * len(ADMIN_KEY)
    padded_search = (SEARCH_KEY + "0" * len(ADMIN_KEY))[: len(ADMIN_KEY)]  # padded or cut to the same length
    assert len(padded_search) == len(ADMIN_KEY) and padded_search != ADMIN_KEY
    for key in (same_length, padded_search, ADMIN_KEY[:-1] + ("a" if ADMIN_KEY[-1] != "a" else "b")):
        _error(client.post("/v1/sets", json={"name": "nope"}, headers=bearer(key)), 401, "unauthorized")
    assert client.post("/v1/sets", json={"name": "yes"}, headers=bearer(ADMIN_KEY)).status_code == 201


def test_a_prefix_or_an_extension_of_the_admin_key_is_not_the_admin_key(state: AppState) -> None:
    """``Bearer a`` (and any other prefix), the key with a byte more, and the key twice are all refused."""
    from rubricsearch.app.auth import KeyRing

    ring = KeyRing([SecretStr(ADMIN_KEY)], [])
    for key in (ADMIN_KEY[:1], ADMIN_KEY[:8], ADMIN_KEY[:-1], ADMIN_KEY + "x", ADMIN_KEY * 2, ""):
        assert ring.identify(key) is None, key
    assert ring.identify(ADMIN_KEY) is not None
    client = client_for(state)
    for key in (ADMIN_KEY[:1], ADMIN_KEY[: len(ADMIN_KEY) // 2], ADMIN_KEY[:-1], ADMIN_KEY + "0"):
        _error(client.post("/v1/sets", json={"name": "prefix"}, headers=bearer(key)), 401, "unauthorized")


def test_max_json_bytes_refuses_json_bodies_over_it_declared_or_streamed(state: AppState,
                                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The JSON cap, set far below the request cap: a JSON body over it is 413 whether it declares its length
    or streams it chunked, on a route that never tokenises (so no later limit could refuse it instead); one
    under it passes, and a multipart upload larger than the JSON cap is not refused by it."""
    monkeypatch.setattr(http_limits, "MAX_REQUEST_BYTES", 1 << 20)  # read when the app is made
    client = client_for(state, limits={"max_json_bytes": 4096})
    body = ('{"set_id": "s", "criteria": ["' + "c" * 5000 + '"]}').encode()
    err = _error(client.post("/v1/search", content=body, headers={"content-type": "application/json"}),
                 413, "payload_too_large")
    assert err["details"]["limit"] == 4096

    def chunks() -> Iterator[bytes]:  # no Content-Length: the streaming cap must stop it
        for start in range(0, len(body), 700):
            yield body[start : start + 700]

    err = _error(client.post("/v1/search", content=chunks(), headers={"content-type": "application/json"}),
                 413, "payload_too_large")
    assert err["details"]["limit"] == 4096
    under = client.post("/v1/search", json={"set_id": "nope", "criteria": ["c" * 3000]})
    assert under.status_code != 413, under.text
    upload = client.post("/v1/sets/nope/images", files=[("files", ("a.png", b"p" * 8000, "image/png"))],
                         headers=bearer(ADMIN_KEY))
    assert upload.status_code != 413, upload.text


def test_wrong_bearer_keys_are_rate_limited_per_client(state: AppState) -> None:
    from rubricsearch.app.auth import FAILED_ATTEMPTS_PER_MINUTE

    client = client_for(state)
    wrong = bearer("w" * len(ADMIN_KEY))
    statuses = [client.post("/v1/sets", json={"name": "guess"}, headers=wrong).status_code
                for _ in range(FAILED_ATTEMPTS_PER_MINUTE + 2)]
    assert statuses[:FAILED_ATTEMPTS_PER_MINUTE] == [401] * FAILED_ATTEMPTS_PER_MINUTE
    limited = client.post("/v1/sets", json={"name": "guess"}, headers=wrong)
    error = _error(limited, 429, "rate_limited")
    assert int(limited.headers["Retry-After"]) >= 1
    assert error["details"]["limit_per_minute"] == FAILED_ATTEMPTS_PER_MINUTE
    # the right key still works from the same client
    assert client.get("/v1/sets", headers=bearer(ADMIN_KEY)).status_code == 200


def test_full_model_queues_refuse_new_work_with_retry_after(state: AppState, set_id: str,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """Real queued work (a large embedding request on the model's scheduler) above the limit: new model work
    is refused at once with 503 and Retry-After, counted in /metrics; once the queue drains it is admitted."""
    import threading
    import time

    from rubricsearch.retrieval.qwen.engine.forward import LMInput

    monkeypatch.setattr("rubricsearch.app.deps.MAX_QUEUED_MODEL_INPUTS", 1)
    client = client_for(state)
    scheduler = state.embedder.runtime.scheduler  # type: ignore[attr-defined]
    work = [LMInput(ids=[5 + (i % 50)] * 64, packages=[]) for i in range(3000)]
    runner = threading.Thread(target=scheduler.run, args=(work,))
    runner.start()
    try:
        deadline = time.monotonic() + 10
        while state.queued_inputs()["embedding"] <= 1 and time.monotonic() < deadline:
            time.sleep(0.001)
        refused = client.post("/v1/embeddings", json={"input": "a cat"})
        error = _error(refused, 503, "overloaded")
        assert refused.headers["Retry-After"] == "1" and error["details"]["limit"] == 1
        _error(client.post("/v1/search", json={"set_id": set_id, "rubric": "cats"}), 503, "overloaded")
        assert client.get("/healthz").status_code == 200  # non-model routes are not refused
    finally:
        runner.join()
    metrics = client.get("/metrics").text
    assert "rubricsearch_admission_refusals_total 2.0" in metrics
    assert 'rubricsearch_model_queue_inputs{model="embedding"} 0.0' in metrics
    assert client.post("/v1/embeddings", json={"input": "a cat"}).status_code == 200


def test_an_import_carries_at_most_max_import_urls(client: TestClient, set_id: str) -> None:
    from rubricsearch.app.schemas.common import MAX_IMPORT_URLS

    urls = [f"http://127.0.0.1:9/{i}.png" for i in range(MAX_IMPORT_URLS + 1)]
    error = _error(client.post(f"/v1/sets/{set_id}/imports", json={"urls": urls}, headers=bearer(ADMIN_KEY)),
                   422, "validation_error")
    assert str(MAX_IMPORT_URLS) in error["message"] and MAX_IMPORT_URLS <= 2000
