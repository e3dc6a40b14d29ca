"""Bounded work for any JSON body: the shape scan counts exactly what it promises (checked against the parsed
tree on random documents with hostile strings, at window sizes that split strings and escapes), bodies over the
value or depth limit are refused on every JSON route before they are parsed, and parsing runs off the event loop.
"""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import rubricsearch.app.jsonbody as jsonbody
from rubricsearch.app.errors import BodyTooLarge
from rubricsearch.app.jsonbody import JsonTooDeep, check_shape
from rubricsearch.app.state import AppState
from tests.api_helpers import ADMIN_KEY, bearer, built_state, client_for

TRICKY = ['"', "\\", '\\"', '"\\', "\\\\", "\\\\\\", ",", "[", "]", "{", "}", ":", "\n", "é", "\u2028", "\x00", " "]


def _random_string(rng: random.Random) -> str:
    return "".join(rng.choice(TRICKY) if rng.random() < 0.6 else rng.choice("ab") for _ in range(rng.randrange(12)))


def _random_doc(rng: random.Random, depth: int = 0) -> Any:
    kind = rng.randrange(6 if depth < 6 else 3)
    if kind == 0:
        return _random_string(rng)
    if kind == 1:
        return rng.choice([0, -1.5, True, None, 12345678901234567890])
    if kind == 2:
        return rng.choice([[], {}])
    if kind in (3, 4):
        return [_random_doc(rng, depth + 1) for _ in range(rng.randrange(5))]
    return {_random_string(rng): _random_doc(rng, depth + 1) for _ in range(rng.randrange(5))}


def _expected(doc: Any) -> tuple[int, int]:
    """(values as the scan counts them: containers plus separators, the deepest nesting) from the parsed tree."""
    if isinstance(doc, list | dict):
        children = list(doc.values()) if isinstance(doc, dict) else doc
        counts = [_expected(c) for c in children]
        return (1 + max(len(children) - 1, 0) + sum(v for v, _ in counts),
                1 + max((d for _, d in counts), default=0))
    return 0, 0


def _measured(body: bytes) -> tuple[int, int]:
    """The smallest limits the scan lets ``body`` through with."""
    values = next(n for n in range(0, 10_000) if _passes(body, n, 1000))
    depth = next(n for n in range(0, 1000) if _passes(body, 10_000, n))
    return values, depth


def _passes(body: bytes, max_values: int, max_depth: int) -> bool:
    try:
        check_shape(body, max_values=max_values, max_depth=max_depth)
    except (BodyTooLarge, JsonTooDeep):
        return False
    return True


@pytest.mark.parametrize("window", [1 << 20, 64, 7, 2])
def test_the_scan_counts_values_and_depth_of_the_parsed_tree(monkeypatch: pytest.MonkeyPatch, window: int) -> None:
    monkeypatch.setattr(jsonbody, "_WINDOW", window)
    rng = random.Random(window)
    for _ in range(300):
        doc = _random_doc(rng)
        for text in (json.dumps(doc), json.dumps(doc, ensure_ascii=False, indent=1)):
            assert _measured(text.encode()) == _expected(doc), text


def test_a_string_of_escapes_longer_than_a_window_is_one_string(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonbody, "_WINDOW", 16)
    for inner in ('\\"' * 50, "\\\\" * 50, "\\\\" * 25 + '\\"' * 25, "a" * 99 + "\\\\"):
        body = ('[["' + inner + '", 1], 2]').encode()
        assert json.loads(body)[0][0]  # valid JSON
        assert _measured(body) == (4, 2)  # two arrays, two commas


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "json-bounds", tiny_embedding_dir, tiny_reranker_dir)


def _post(client: TestClient, path: str, body: bytes) -> Any:
    return client.post(path, content=body, headers={"content-type": "application/json", **bearer(ADMIN_KEY)})


def test_many_keys_or_items_are_413_before_parsing_on_every_json_route(state: AppState,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonbody, "MAX_JSON_VALUES", 1000)
    client = client_for(state)
    parsed: list[int] = []
    real_loads = jsonbody.json.loads
    monkeypatch.setattr(jsonbody.json, "loads", lambda b, **kw: parsed.append(len(b)) or real_loads(b, **kw))
    keys = ("{" + ",".join(f'"k{i}": 1' for i in range(1500)) + "}").encode()
    items = ('{"input": [' + ",".join(['"x"'] * 1500) + "]}").encode()
    for path, body in (("/v1/search", keys), ("/v1/sets", keys), ("/v1/embeddings", items), ("/v1/rerank", keys),
                       ("/v1/sets/any/imports", keys), ("/v2/embed", keys)):
        response = _post(client, path, body)
        assert response.status_code == 413, (path, response.text)
        assert response.json()["error"]["details"]["limit"] == 1000
    assert len(keys) not in parsed and len(items) not in parsed  # refused unparsed
    under = ("{" + ",".join(f'"k{i}": 1' for i in range(900)) + "}").encode()
    response = _post(client, "/v1/sets", under)
    assert response.status_code == 422 and len(under) in parsed  # parsed, then refused by the schema


def test_nesting_over_the_depth_limit_is_422(state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonbody, "MAX_JSON_DEPTH", 16)
    client = client_for(state)
    deep = ('{"name": "d", "x": ' + "[" * 16 + "]" * 16 + "}").encode()
    response = _post(client, "/v1/sets", deep)
    assert response.status_code == 422 and "nested deeper than 16" in response.json()["error"]["message"]
    shallow = ('{"name": "d", "x": ' + "[" * 14 + "]" * 14 + "}").encode()
    response = _post(client, "/v1/sets", shallow)
    assert response.status_code == 422 and "nested" not in response.json()["error"]["message"]


def test_bodies_are_parsed_off_the_event_loop(state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[bool] = []
    real = jsonbody._check_and_load

    def spy(body: bytes, max_values: int, max_depth: int, schema: Any = None) -> Any:
        try:
            asyncio.get_running_loop()
            seen.append(True)
        except RuntimeError:
            seen.append(False)
        return real(body, max_values, max_depth, schema)

    monkeypatch.setattr(jsonbody, "_check_and_load", spy)
    client = client_for(state)
    assert _post(client, "/v1/sets", b'{"name": "off-loop"}').status_code == 201
    assert _post(client, "/v1/search", b'{"set_id": "off-loop", "criteria": ["a"]}').status_code in (200, 409)
    assert seen == [False, False]


def test_a_body_with_many_errors_is_refused_with_their_count_only(state: AppState) -> None:
    """Unknown keys under the value limit, spread over many objects: 422 with the count (pydantic never builds the
    error list); a body with a few errors still lists them."""
    client = client_for(state)
    docs = ",".join("{" + ",".join(f'"u{j}": 1' for j in range(20)) + "}" for _ in range(200))
    for path, body in (("/v1/rerank", f'{{"query": "q", "documents": [{docs}]}}'),
                       ("/v1/search", "{" + ",".join(f'"k{i}": 1' for i in range(5000)) + "}")):
        response = _post(client, path, body.encode())
        assert response.status_code == 422, response.text
        error = response.json()["error"]
        assert error["type"] == "validation_error" and "validation errors" in error["message"]
        assert "errors" not in error["details"]
    few = _post(client, "/v1/sets", b'{"name": "few", "bad1": 1, "bad2": 2}')
    assert few.status_code == 422
    assert {tuple(e["loc"]) for e in few.json()["error"]["details"]["errors"]} == {("body", "bad1"), ("body", "bad2")}


def test_a_body_of_escapes_is_refused_before_parsing(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(jsonbody, "MAX_ESCAPES", 1000)
    monkeypatch.setattr(jsonbody, "_WINDOW", 64)  # the count adds up across windows
    at_limit = ('{"input": "' + "\\n" * 1000 + '"}').encode()
    check_shape(at_limit, max_values=10, max_depth=4)
    with pytest.raises(BodyTooLarge):
        check_shape(at_limit.replace(b"\\n", b"\\u00e9\\n", 1), max_values=10, max_depth=4)


def test_a_body_is_validated_once_off_the_event_loop(state: AppState, monkeypatch: pytest.MonkeyPatch) -> None:
    """A route's body schema validates the parsed body once, in the worker thread that parsed it: FastAPI's own
    validation on the event loop gets the validated model (passed through as it is), and an invalid body's
    errors come from the thread too."""
    from pydantic import TypeAdapter

    calls: list[tuple[bool, bool]] = []  # (on the event loop, given the parsed JSON rather than a model)
    real = TypeAdapter.validate_python

    def spy(self: TypeAdapter[Any], value: Any, **kw: Any) -> Any:
        if any(name in str(self._type) for name in ("SetCreate", "EmbeddingRequest")):
            try:
                asyncio.get_running_loop()
                calls.append((True, isinstance(value, dict)))
            except RuntimeError:
                calls.append((False, isinstance(value, dict)))
        return real(self, value, **kw)

    monkeypatch.setattr(TypeAdapter, "validate_python", spy)
    client = client_for(state)
    created = _post(client, "/v1/sets", b'{"name": "validated-once", "description": "d"}')
    assert created.status_code == 201 and created.json()["name"] == "validated-once"
    bad = _post(client, "/v1/sets", b'{"name": "invalid", "bad1": 1, "bad2": 2}')
    assert bad.status_code == 422
    assert {tuple(e["loc"]) for e in bad.json()["error"]["details"]["errors"]} == {("body", "bad1"), ("body", "bad2")}
    embedded = _post(client, "/v1/embeddings", b'{"input": "a cat", "dimensions": 64}')
    assert embedded.status_code == 200 and len(embedded.json()["data"][0]["embedding"]) == 64
    assert [parsed for on_loop, parsed in calls if not on_loop] == [True, True, True], calls  # each body once
    assert not any(parsed for on_loop, parsed in calls if on_loop), calls  # the loop sees models only
