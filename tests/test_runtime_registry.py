"""The runtime registry: the factories pick the plain local runtime off a GPU, the accelerated plug-in where asked
(or on a GPU), vLLM for a server; the plug-ins compute what the plain runtime computes; the core never imports a
plug-in (it loads them by name)."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rubricsearch.rerank.factory import load_reranker
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.runtime.config import LocalConfig
from rubricsearch.retrieval.runtime.local import LocalRuntime, local_engine
from rubricsearch.retrieval.runtime.registry import PLUGIN_MODULES, RUNTIMES, runtime_class

ROOT = Path(__file__).resolve().parents[1]
# the model core: what runs whatever the runtime (the factories load runtimes through the registry)
CORE = ["retrieval/runtime", "retrieval/embedding", "rerank/task.py", "rerank/factory.py", "rerank/protocol.py",
        "rerank/local.py", "rerank/prompts.py", "rerank/prefix.py", "app/models.py"]


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


def _imports(path: Path) -> set[str]:
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.update({node.module, *(f"{node.module}.{a.name}" for a in node.names)})
        elif isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
    return names


@pytest.mark.parametrize("part", CORE)
def test_the_core_never_imports_a_plugin(part: str) -> None:
    target = ROOT / part
    files = sorted(target.rglob("*.py")) if target.is_dir() else [target]
    assert files
    for path in files:
        hits = {m for m in _imports(path) for p in PLUGIN_MODULES if m == p or m.startswith(p + ".")}
        assert not hits, f"{path.relative_to(ROOT)} imports plug-in modules {sorted(hits)}: load them by name"
