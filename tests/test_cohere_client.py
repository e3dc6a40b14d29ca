"""``POST /v2/embed`` with the official ``cohere`` client against a real uvicorn server on 127.0.0.1.

``README_EXAMPLE`` is docs/api.md's text (checked); the test points it at this server and checks its vectors
against the embedder called directly with the documented instructions.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import cohere
import numpy as np
import pytest
from fastapi import FastAPI

from rubricsearch.app.main import create_app
from rubricsearch.app.routers.cohere import quantize
from rubricsearch.app.schemas.cohere import INPUT_TYPE_INSTRUCTIONS
from tests.api_helpers import SEARCH_KEY, api_settings, data_url, serve_in_thread

README_EXAMPLE = '''\
import base64
import cohere

co = cohere.ClientV2(api_key="EMPTY", base_url="http://127.0.0.1:8000")  # a real key if search requires one
model = "Qwen/Qwen3-VL-Embedding-2B"
with open("cat.png", "rb") as f:
    cat = "data:image/png;base64," + base64.b64encode(f.read()).decode()

queries = co.embed(model=model, input_type="search_query", texts=["short fur, triangular ears"],
                   embedding_types=["float", "int8", "ubinary"])
docs = co.embed(model=model, input_type="search_document", output_dimension=64, inputs=[
    {"content": [{"type": "text", "text": "a cat in the snow"},
                 {"type": "image_url", "image_url": {"url": cat}}]},
    {"content": [{"type": "image_url", "image_url": {"url": cat}}]},
])
# Your own instruction instead of input_type's (a rubricsearch extension)
custom = co.embed(model=model, input_type="image", images=[cat],
                  request_options={"additional_body_parameters": {"instruction": "Represent the colours."}})
print(len(queries.embeddings.float_[0]), len(docs.embeddings.float_[0]))
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
           ) -> Iterator[tuple[str, FastAPI]]:
    settings = api_settings(tmp_path_factory.mktemp("cohere"), tiny_embedding_dir, tiny_reranker_dir,
                            models={"embedding_model_aliases": ["Qwen/Qwen3-VL-Embedding-2B"],
                                    "reranker_model_aliases": ["Qwen/Qwen3-VL-Reranker-2B"]},
                                    auth={"search_api_keys": []})
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield url, app


def _floats(values: Any) -> np.ndarray:
    return np.asarray(values, dtype=np.float32)


def test_readme_example(server: tuple[str, FastAPI], tmp_path: Path, make_png, monkeypatch: pytest.MonkeyPatch,
                        ) -> None:
    url, app = server
    png = make_png(96, 64, 3)
    (tmp_path / "cat.png").write_bytes(png)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    scope: dict[str, Any] = {}
    assert README_EXAMPLE in (Path(__file__).resolve().parents[1] / "docs" / "api.md").read_text()
    exec(README_EXAMPLE.replace("http://127.0.0.1:8000", url), scope)
    embedder = app.state.rubricsearch.embedder

    queries = scope["queries"]
    want = embedder.embed([{"text": "short fur, triangular ears",
                            "instruction": INPUT_TYPE_INSTRUCTIONS["search_query"]}])
    np.testing.assert_allclose(_floats(queries.embeddings.float_), want, atol=1e-6)
    assert queries.embeddings.int8 == quantize(want, "int8")
    assert queries.embeddings.ubinary == quantize(want, "ubinary")
    assert queries.meta.billed_units.input_tokens > 0

    docs = _floats(scope["docs"].embeddings.float_)
    want_docs = embedder.embed([{"text": "a cat in the snow", "image": png,
                                 "instruction": INPUT_TYPE_INSTRUCTIONS["search_document"]},
                                {"image": png, "instruction": INPUT_TYPE_INSTRUCTIONS["search_document"]}], 64)
    assert docs.shape == (2, 64)
    np.testing.assert_allclose(docs, want_docs, atol=1e-6)
    custom = _floats(scope["custom"].embeddings.float_)
    np.testing.assert_allclose(custom, embedder.embed([{"image": png, "instruction": "Represent the colours."}]),
                               atol=1e-6)
    # the instruction matters: input_type's default instruction gives another vector
    assert not np.allclose(custom, embedder.embed([{"image": png,
                                                    "instruction": INPUT_TYPE_INSTRUCTIONS["image"]}]), atol=1e-4)


def test_all_embedding_types_agree(server: tuple[str, FastAPI], monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = server
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    co = cohere.ClientV2(api_key="EMPTY", base_url=url)
    got = co.embed(model="Qwen/Qwen3-VL-Embedding-2B", input_type="classification", texts=["a", "b c"],
                   embedding_types=["float", "int8", "uint8", "binary", "ubinary", "base64"])
    e = got.embeddings
    floats = _floats(e.float_)
    assert floats.shape == (2, 128)
    np.testing.assert_allclose(np.linalg.norm(floats, axis=1), 1.0, atol=1e-5)
    decoded = np.stack([np.frombuffer(base64.b64decode(s), dtype="<f4") for s in e.base64 or []])
    np.testing.assert_array_equal(decoded, floats)
    int8 = np.asarray(e.int8)
    assert int8.min() >= -127 and int8.max() <= 127 and np.abs(int8).max() == 127
    np.testing.assert_array_equal(np.asarray(e.uint8), int8 + 128)
    cos = (int8[0] @ int8[1]) / np.linalg.norm(int8[0]) / np.linalg.norm(int8[1])
    assert abs(cos - floats[0] @ floats[1]) < 0.02
    bits = np.unpackbits(np.asarray(e.ubinary, dtype=np.uint8), axis=1)
    np.testing.assert_array_equal(bits, (floats > 0).astype(np.uint8))
    np.testing.assert_array_equal(np.asarray(e.binary), np.asarray(e.ubinary) - 128)


RERANK_EXAMPLE = '''\
import cohere

co = cohere.ClientV2(api_key="EMPTY", base_url="http://127.0.0.1:8000")
ranked = co.rerank(model="Qwen/Qwen3-VL-Reranker-2B", query="a ginger cat with triangular ears",
                   documents=["a black fox", "a ginger cat", "a red sports car"], top_n=2)
for r in ranked.results:
    print(r.index, round(r.relevance_score, 3))
'''


def test_v2_rerank_with_the_official_client(server: tuple[str, FastAPI], monkeypatch: pytest.MonkeyPatch) -> None:
    """``co.rerank`` of the cohere v2 client posts to ``/v2/rerank``: scores equal the reranker called directly
    (default instruction), best first, ``top_n`` kept; errors come back as the client's exceptions."""
    url, app = server
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    scope: dict[str, Any] = {}
    exec(RERANK_EXAMPLE.replace("http://127.0.0.1:8000", url), scope)
    docs = ["a black fox", "a ginger cat", "a red sports car"]
    want = app.state.rubricsearch.reranker.score({"text": "a ginger cat with triangular ears"},
                                                  [{"text": d} for d in docs])
    results = scope["ranked"].results
    best = sorted(range(3), key=lambda i: -want[i])[:2]
    assert [r.index for r in results] == best
    for r in results:
        assert abs(r.relevance_score - want[r.index]) <= 1e-5
    co = cohere.ClientV2(api_key="EMPTY", base_url=url)
    assert len(co.rerank(model="Qwen/Qwen3-VL-Reranker-2B", query="q", documents=docs).results) == 3
    with pytest.raises(cohere.NotFoundError):
        co.rerank(model="rerank-v3.5", query="q", documents=docs)
    with pytest.raises(cohere.UnprocessableEntityError):
        co.rerank(model="Qwen/Qwen3-VL-Reranker-2B", query="q", documents=[])


def test_errors_through_the_client(server: tuple[str, FastAPI], monkeypatch: pytest.MonkeyPatch) -> None:
    url, _ = server
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    co = cohere.ClientV2(api_key="EMPTY", base_url=url)
    with pytest.raises(cohere.NotFoundError):
        co.embed(model="embed-v4.0", input_type="search_query", texts=["a"])
    with pytest.raises(cohere.BadRequestError):  # remote URLs are never fetched by the embed endpoint
        co.embed(model="Qwen/Qwen3-VL-Embedding-2B", input_type="image", images=["http://127.0.0.1:1/x.png"])
    with pytest.raises(cohere.BadRequestError):
        co.embed(model="Qwen/Qwen3-VL-Embedding-2B", input_type="search_query", texts=["a"], truncate="START")
    with pytest.raises(cohere.UnprocessableEntityError):
        co.embed(model="Qwen/Qwen3-VL-Embedding-2B", input_type="search_query", texts=["a"], images=[data_url(b"x")])


def test_needs_key_when_configured(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    from fastapi.testclient import TestClient

    app = create_app(api_settings(tmp_path, tiny_embedding_dir, tiny_reranker_dir, auth={"search_requires_key": True}))
    with TestClient(app, raise_server_exceptions=False) as client:
        body = {"model": "my-embedder", "texts": ["a"]}
        assert client.post("/v2/embed", json=body).status_code == 401
        ok = client.post("/v2/embed", json=body, headers={"Authorization": f"Bearer {SEARCH_KEY}"})
        assert ok.status_code == 200, ok.text
        assert str(tiny_embedding_dir) not in ok.text  # the model is named by its id, never by a path


@pytest.mark.parametrize(("body", "status"), [
    ({"model": "Qwen/Qwen3-VL-Embedding-2B"}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": []}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a"] * 1025}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a"], "embedding_types": ["float16"]}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a"], "output_dimension": 0}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a"], "output_dimension": 100_000}, 400),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a"], "max_tokens": 16}, 400),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "inputs": [{"content": []}]}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B",
      "inputs": [{"content": [{"type": "video_url", "video_url": {"url": "x"}}]}]}, 422),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "images": ["data:image/png;base64,AAAA"]}, 400),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a " * 16_000], "truncate": "NONE"}, 413),
    ({"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": [1]}, 422),
])
def test_hostile_bodies(server: tuple[str, FastAPI], body: dict[str, Any], status: int) -> None:
    import httpx

    r = httpx.post(server[0] + "/v2/embed", json=body, timeout=60)
    assert r.status_code == status, r.text
    assert set(r.json()["error"]) == {"type", "message", "details"}


def test_long_text_is_cut_at_the_end_by_default(server: tuple[str, FastAPI]) -> None:
    import httpx

    body = {"model": "Qwen/Qwen3-VL-Embedding-2B", "texts": ["a " * 16_000]}
    r = httpx.post(server[0] + "/v2/embed", json=body, timeout=120)
    assert r.status_code == 200, r.text
    assert r.json()["meta"]["billed_units"]["input_tokens"] <= 8192
