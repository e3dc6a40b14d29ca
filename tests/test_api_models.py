"""REST API on tiny real checkpoints: embeddings, rerank and visual packages equal direct model calls."""

from __future__ import annotations

import base64
import io
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from fastapi.testclient import TestClient
from safetensors.torch import load as load_safetensors

from rubricsearch.app.deps import MAX_EMBEDDING_INPUTS, MAX_RERANK_DOCUMENTS
from rubricsearch.app.main import create_app
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import create_job, create_set
from rubricsearch.retrieval.qwen.model.checkpoint import is_test_model
from tests.api_helpers import api_settings, built_state, client_for, data_url, ingest


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "api", tiny_embedding_dir, tiny_reranker_dir)


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


@pytest.fixture(scope="module")
def pngs(make_png) -> list[bytes]:
    return [make_png(80, 64, 11), make_png(48, 96, 12), make_png(64, 64, 13)]


@pytest.fixture(scope="module")
def shas(state: AppState, pngs: list[bytes]) -> list[str]:
    return ingest(state, pngs[:2])


def _vectors(body: dict) -> np.ndarray:
    return np.array([d["embedding"] for d in body["data"]], dtype=np.float32)


def test_text_embeddings_equal_direct_calls(client: TestClient, state: AppState) -> None:
    r = client.post("/v1/embeddings", json={"input": ["a red cat", "dark forehead stripes"]})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "list" and body["model"] == state.embedder.model_id
    assert [d["index"] for d in body["data"]] == [0, 1] and body["data"][0]["object"] == "embedding"
    assert body["usage"]["prompt_tokens"] > 0 and body["usage"]["total_tokens"] == body["usage"]["prompt_tokens"]
    np.testing.assert_allclose(_vectors(body), state.embedder.embed(["a red cat", "dark forehead stripes"]), atol=1e-6)
    single = client.post("/v1/embeddings", json={"input": "a red cat"}).json()
    np.testing.assert_allclose(_vectors(single)[0], _vectors(body)[0], atol=1e-6)


def test_multimodal_items_equal_direct_calls(client: TestClient, state: AppState, pngs: list[bytes],
                                             shas: list[str]) -> None:
    request = {"input": [
        {"image": data_url(pngs[2])},
        {"image": {"image_id": shas[0]}, "text": "short fur", "instruction": "Find images matching this description"},
        {"image": [data_url(pngs[2]), {"image_id": shas[1].upper()}], "text": ["two", "views"]},
        "a plain string",
    ], "instruction": "Represent the colour"}
    r = client.post("/v1/embeddings", json=request)
    assert r.status_code == 200, r.text
    direct = state.embedder.embed([
        {"image": pngs[2], "instruction": "Represent the colour"},
        {"image": pngs[0], "text": "short fur", "instruction": "Find images matching this description"},
        {"image": [pngs[2], pngs[1]], "text": ["two", "views"], "instruction": "Represent the colour"},
        {"text": "a plain string", "instruction": "Represent the colour"},
    ])
    np.testing.assert_allclose(_vectors(r.json()), direct, atol=1e-6)


def test_vllm_messages_equal_items(client: TestClient, pngs: list[bytes], shas: list[str]) -> None:
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": "Represent the user input."}]},
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": data_url(pngs[2])}},
                                     {"type": "text", "text": "A cat in the snow."}]},
        {"role": "assistant", "content": [{"type": "text", "text": ""}]},
    ]
    one = client.post("/v1/embeddings", json={"messages": conversation, "continue_final_message": True,
                                              "add_special_tokens": True})
    assert one.status_code == 200, one.text
    item = client.post("/v1/embeddings", json={"input": [{"image": data_url(pngs[2]), "text": "A cat in the snow.",
                                                          "instruction": "Represent the user input."}]})
    np.testing.assert_allclose(_vectors(one.json()), _vectors(item.json()), atol=1e-6)
    batch = client.post("/v1/embeddings", json={"input": [], "messages": [
        conversation, [{"role": "user", "content": [{"type": "image_id", "image_id": shas[0]}]}]]})
    assert batch.status_code == 200, batch.text
    ref = client.post("/v1/embeddings", json={"input": [{"image": {"image_id": shas[0]}}]}).json()
    np.testing.assert_allclose(_vectors(batch.json()), np.vstack([_vectors(one.json()), _vectors(ref)]), atol=1e-6)


def test_base64_and_dimensions(client: TestClient, state: AppState) -> None:
    floats = client.post("/v1/embeddings", json={"input": ["x", "y"], "dimensions": 64}).json()
    b64 = client.post("/v1/embeddings", json={"input": ["x", "y"], "dimensions": 64,
                                              "encoding_format": "base64"}).json()
    decoded = np.stack([np.frombuffer(base64.b64decode(d["embedding"]), dtype="<f4") for d in b64["data"]])
    assert decoded.shape == (2, 64)
    np.testing.assert_allclose(decoded, _vectors(floats), atol=1e-7)
    np.testing.assert_allclose(np.linalg.norm(decoded, axis=1), 1.0, atol=1e-5)
    np.testing.assert_allclose(decoded, state.embedder.embed(["x", "y"], 64), atol=1e-6)


def test_model_names_and_listing(client: TestClient, state: AppState, tiny_embedding_dir: Path) -> None:
    for name in (state.embedder.model_id, "my-embedder", tiny_embedding_dir.name, "MY-EMBEDDER"):
        r = client.post("/v1/embeddings", json={"model": name, "input": "a"})
        assert r.status_code == 200 and r.json()["model"] == state.embedder.model_id
    missing = client.post("/v1/embeddings", json={"model": "gpt-4", "input": "a"})
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "not_found"
    models = client.get("/v1/models").json()
    assert [m["kind"] for m in models["data"]] == ["embedding", "reranker"]
    assert models["data"][0]["id"] == state.embedder.model_id and "my-embedder" in models["data"][0]["aliases"]
    assert models["data"][0]["test_model"] is True
    emb, rer = models["data"]
    assert emb["dimension"] == state.embedder.dimension and emb["dimensions_min"] == 64
    assert emb["limits"]["max_tokens"] == 8192 and rer["limits"]["max_tokens"] == 10240 and rer["dimension"] is None
    assert emb["limits"]["max_inputs"] == MAX_EMBEDDING_INPUTS and rer["limits"]["max_inputs"] == MAX_RERANK_DOCUMENTS
    assert str(tiny_embedding_dir) not in str(models)  # ids and aliases, never the checkpoint's path


def test_rerank_equals_direct_scores_sorted(client: TestClient, state: AppState, pngs: list[bytes],
                                            shas: list[str]) -> None:
    docs = ["a tabby cat", {"image": {"image_id": shas[0]}}, {"text": "grey", "image": data_url(pngs[2])},
            {"content": [{"type": "text", "text": "striped"}, {"type": "image_url",
                                                             "image_url": {"url": data_url(pngs[1])}}]}]
    request = {"query": {"text": "a cat", "image": data_url(pngs[0])}, "documents": docs,
               "instruction": "Same ear shape?"}
    r = client.post("/v1/rerank", json=request)
    assert r.status_code == 200, r.text
    body = r.json()
    direct = state.reranker.score({"text": "a cat", "image": pngs[0]}, [
        "a tabby cat", {"image": pngs[0]}, {"text": "grey", "image": pngs[2]},
        {"text": "striped", "image": pngs[1]}], "Same ear shape?")
    assert body["rerank_status"] == "ok" and body["model"] == state.reranker.model_id
    assert [x["index"] for x in body["results"]] == sorted(range(4), key=lambda i: -direct[i])
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(direct[result["index"]], abs=1e-6)
        assert "document" not in result
    top = client.post("/v1/rerank", json={**request, "top_n": 2, "return_documents": True}).json()["results"]
    assert [x["index"] for x in top] == [x["index"] for x in body["results"][:2]]
    echoed = {x["index"]: x["document"] for x in top}
    assert all(echoed[i] == ({"text": docs[i]} if isinstance(docs[i], str) else docs[i]) for i in echoed)


def test_visual_package_is_vllm_layout_and_cached(client: TestClient, state: AppState, shas: list[str]) -> None:
    sha = shas[1]
    encodes = state.embedder.stats["vision_encodes"]
    state.store.delete_image(sha)
    first = client.get(f"/v1/images/{sha}/visual-package")
    assert first.status_code == 200, first.text
    body = first.json()
    tensor = torch.load(io.BytesIO(base64.b64decode(body["image_embeds"])), weights_only=True)
    package = state.store.get(sha, state.embedder.packages.fingerprint)
    assert package is not None and body["cached"] is False
    assert torch.equal(tensor, package.to_vllm_layout())
    t, h, w = body["image_grid_thw"]
    assert tensor.shape == (t * h * w // 4, body["hidden_size"] * (1 + body["deepstack_levels"]))
    assert body["tokens"] == tensor.shape[0] and body["width"] == tensor.shape[1] and body["dtype"] == "float32"
    assert torch.load(io.BytesIO(base64.b64decode(body["image_grid_thw_b64"])), weights_only=True).tolist() == [t, h, w]
    again = client.get(f"/v1/images/{sha.upper()}/visual-package?dtype=bfloat16").json()
    assert again["cached"] is True and again["dtype"] == "bfloat16"
    assert state.embedder.stats["vision_encodes"] == encodes + 1  # computed once, then served from the store
    client.post("/v1/embeddings", json={"input": [{"image": {"image_id": sha}}]})
    assert state.embedder.stats["vision_encodes"] == encodes + 1  # the embedder reuses it too
    raw = client.get(f"/v1/images/{sha}/visual-package", params={"format": "safetensors", "model": "reranker"})
    assert raw.status_code == 200 and raw.headers["content-type"] == "application/octet-stream"
    tensors = load_safetensors(raw.content)
    assert tensors["image_grid_thw"].tolist() == [t, h, w] and tensors["image_embeds"].shape[0] == t * h * w // 4


def test_visual_package_errors(client: TestClient, pngs: list[bytes], state: AppState) -> None:
    unknown = client.get(f"/v1/images/{'ab' * 32}/visual-package")
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found"
    stray = state.blobs.put(pngs[2])  # in the blob store but in no reference set: not ingested
    assert client.get(f"/v1/images/{stray}/visual-package").status_code == 404
    assert client.get("/v1/images/not-a-sha/visual-package").json()["error"]["type"] == "validation_error"
    assert client.get(f"/v1/images/{'ab' * 32}/visual-package?format=png").status_code == 422
    assert client.get(f"/v1/images/{'ab' * 32}/visual-package?model=nope").status_code == 404


def test_metrics_and_health(client: TestClient, state: AppState, shas: list[str]) -> None:
    client.get(f"/v1/images/{shas[0]}/visual-package")
    with state.catalog.write() as session:
        ref = create_set(session, "metrics-set")
        job = create_job(session, ref.id, "urls", ["http://127.0.0.1:1/a.png", "http://127.0.0.1:1/b.png"])
    assert client.get("/healthz").json() == {"status": "ok"}
    ready = client.get("/readyz").json()
    assert ready["status"] == "ready" and all(ready["checks"].values()) and ready["test_models"] is True
    text = client.get("/metrics").text
    assert 'route="/v1/images/{sha256}/visual-package"' in text and shas[0] not in text
    tower = state.embedder.packages.fingerprint
    assert tower is not None and ready["towers_shared"] is True
    assert [t["roles"] for t in ready["towers"]] == [["embedding", "reranker"]]
    for name in (f'rubricsearch_vision_encodes_total{{model="embedding",purpose="reference",tower="{tower.short}"}}',
                 f'rubricsearch_vision_tower{{local="true",models="embedding+reranker",tower="{tower.short}"}} 1.0',
                 "rubricsearch_vision_towers_shared 1.0", "rubricsearch_package_hits_total",
                 "rubricsearch_package_store_bytes{tier=\"memory\"}", "rubricsearch_jobs_active",
                 "rubricsearch_http_request_duration_seconds_bucket"):
        assert name in text
    assert f'rubricsearch_job_items{{job_id="{job.id}",kind="total",set_id="{ref.id}"}} 2.0' in text
    assert f'rubricsearch_job_progress{{job_id="{job.id}",set_id="{ref.id}"}} 0.0' in text


def test_lifespan_builds_and_closes(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path) -> None:
    settings = api_settings(tmp_path, tiny_embedding_dir, tiny_reranker_dir)
    for _ in range(2):  # the second start proves the first released the FAISS directory lock
        with TestClient(create_app(settings)) as c:
            assert c.get("/readyz").status_code == 200
            assert c.post("/v1/embeddings", json={"input": "a"}).status_code == 200


@pytest.mark.slow
def test_fallback_to_generated_test_models(tmp_path: Path) -> None:
    missing = str(tmp_path / "not-downloaded")
    settings = Settings(_env_file=None, data_dir=tmp_path / "data", models={"embedding_model": missing,
                                                                            "reranker_model": missing,
                                                                            "fallback_to_test_models": True,
                                                                            "dtype": "float32"})
    with TestClient(create_app(settings)) as c:
        assert c.get("/readyz").json()["test_models"] is True
        r = c.post("/v1/embeddings", json={"model": missing, "input": "a"})  # the configured name still works
        assert r.status_code == 200 and r.json()["model"] == "embedding"  # its folder, never the path
        assert c.post("/v1/rerank", json={"query": "a", "documents": ["b"]}).status_code == 200
    assert is_test_model(tmp_path / "data" / "test-models" / "reranker")
