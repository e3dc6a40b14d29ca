"""``compile=True`` (the Python API's option; the server keeps compiled blocks off, docs/performance.md) reaches
both local models: every block of both towers and of the embedder's LM is compiled (lazily, so no compiler runs
here); without it none is. Compiled results are checked against the official reference on a GPU in
``tests/test_gpu.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rubricsearch.rerank import load_reranker
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.runtime.local import LocalRuntime


@pytest.mark.parametrize("compile_blocks", [True, False])
def test_compile_reaches_every_block(tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                     compile_blocks: bool) -> None:
    store = PackageStore(storage_dtype="float32")
    embedder = load_embedder(str(tiny_embedding_dir), device="cpu", dtype="float32", compile=compile_blocks,
                             store=store)
    reranker = load_reranker(str(tiny_reranker_dir), device="cpu", dtype="float32", compile=compile_blocks,
                             store=store)
    for model in (embedder, reranker):
        assert isinstance(model.runtime, LocalRuntime)
        inner = model.runtime.loaded.model
        # the reranker's LM layers stay eager (its KV-cache passes would recompile per layer)
        blocks = [*inner.visual.blocks, *(inner.language_model.layers if model is embedder else [])]
        assert blocks and {b._compiled_call_impl is not None for b in blocks} == {compile_blocks}
    assert all(b._compiled_call_impl is None for b in reranker.runtime.loaded.model.language_model.layers)
