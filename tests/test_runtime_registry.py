"""The runtime registry: the factories pick the plain local runtime off a GPU, the accelerated plug-in where asked
(or on a GPU), vLLM for a server; the plug-ins compute what the plain runtime computes; the core never imports a
plug-in (it loads them by name: tests/test_layering.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from rubricsearch.rerank.factory import load_reranker
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.runtime.config import LocalConfig
from rubricsearch.retrieval.runtime.local import LocalRuntime, local_engine
from rubricsearch.retrieval.runtime.registry import RUNTIMES, runtime_class


def test_every_registered_runtime_loads() -> None:
    for task, names in RUNTIMES.items():
        for name in names:
            cls = runtime_class(task, name)  # type: ignore[arg-type]
            assert isinstance(cls, type) and {"embed", "health", "load", "close"} <= set(dir(cls)), (task, name)
            assert task == "embedding" or hasattr(cls, "score"), (task, name)


def test_auto_is_the_plain_runtime_off_a_gpu(tiny_embedding_dir: Path, tiny_reranker_dir: Path) -> None:
    emb = load_embedder(str(tiny_embedding_dir), device="cpu", store=PackageStore(storage_dtype="float32"))
    rr = load_reranker(str(tiny_reranker_dir), device="cpu", store=PackageStore(storage_dtype="float32"))
    assert type(emb.runtime) is LocalRuntime and type(rr.runtime) is LocalScoringRuntime
    assert local_engine(LocalConfig(engine="accelerated"), emb.runtime.loaded) == "accelerated"
    assert local_engine(LocalConfig(), emb.runtime.loaded) == "local"


def test_the_accelerated_plugin_equals_the_plain_runtime(tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                                         make_png: Any) -> None:
    """Off a GPU the accelerated runtimes fall back to the plain passes: same vectors, same scores."""
    a, b = make_png(96, 80, 1), make_png(64, 96, 2)
    items = [{"image": a, "text": "stripes"}, {"text": "a dog"}, {"image": [a, b]}]
    vectors = {}
    scores = {}
    for engine in ("local", "accelerated"):
        emb = load_embedder(str(tiny_embedding_dir), device="cpu", dtype="float32", engine=engine,
                            store=PackageStore(storage_dtype="float32"))
        rr = load_reranker(str(tiny_reranker_dir), device="cpu", dtype="float32", engine=engine,
                           store=PackageStore(storage_dtype="float32"))
        assert (type(emb.runtime).__name__ == "AcceleratedRuntime") == (engine == "accelerated")
        assert (type(rr.runtime).__name__ == "AcceleratedScoringRuntime") == (engine == "accelerated")
        vectors[engine] = emb.embed(items)
        scores[engine] = rr.score({"text": "stripes", "image": a}, [{"image": b}, {"image": a}, "text"], "Judge")
    np.testing.assert_array_equal(vectors["local"], vectors["accelerated"])
    np.testing.assert_array_equal(scores["local"], scores["accelerated"])
