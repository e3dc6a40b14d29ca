"""``RUBRICSEARCH_MODELS__COMPILE_BLOCKS`` reaches both local models: every block of both towers and of the embedder's
LM is compiled (lazily, so no compiler runs here); without it none is. Compiled results are checked against the
official reference on a GPU in ``tests/test_gpu.py``."""

from __future__ import annotations

from pathlib import Path

import pytest

from rubricsearch.app.state import open_state
from rubricsearch.retrieval.runtime.local import LocalRuntime
from tests.api_helpers import api_settings


@pytest.mark.parametrize("compile_blocks", [True, False])
def test_compile_setting_reaches_every_block(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                             compile_blocks: bool) -> None:
    state = open_state(api_settings(tmp_path, tiny_embedding_dir, tiny_reranker_dir,
                                    models={"compile_blocks": compile_blocks}),
                       embedder=True, reranker=True)
    try:
        for model in (state.embedder, state.reranker):
            assert isinstance(model.runtime, LocalRuntime)
            inner = model.runtime.loaded.model
            # the reranker's LM layers stay eager (its KV-cache passes would recompile per layer)
            blocks = [*inner.visual.blocks, *(inner.language_model.layers if model is state.embedder else [])]
            assert blocks and {b._compiled_call_impl is not None for b in blocks} == {compile_blocks}
        assert all(b._compiled_call_impl is None for b in state.reranker.runtime.loaded.model.language_model.layers)
    finally:
        state.close()
