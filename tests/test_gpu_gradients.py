"""The passes with gradients on CUDA (run on the device machine: ``pytest -m gpu``): the accelerated reranker runs its
trainers' and evidence maps' passes packed, FlashAttention forward and backward, and they give what the padded
passes give, at bfloat16 rounding (``tests/test_packed_prefix.py`` checks them exactly in float32 on a CPU)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.evidence import criterion_pair, explain_many
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.plugins.accelerated.packed_rows import PackedRows
from rubricsearch.rerank.prefix import PaddedRows, shared_prefix_states
from rubricsearch.rerank.task import RERANK_MAX_LENGTH
from rubricsearch.retrieval.images import image_handle
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.core import Truncation
from tests.gpu_modes import _reference_kernels_after  # noqa: F401 (autouse: Liger's rotary is process-wide)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

CRITERIA = ["round ears", "no forehead stripes", "dark forehead stripes and green eyes"]


def _cosine(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), dim=0))


def test_packed_passes_with_gradients_match_the_padded_ones_on_cuda(tiny_reranker_dir: Path,
                                                                    make_png: Callable[..., bytes]) -> None:
    rr = load_reranker(tiny_reranker_dir, device="cuda", dtype="bfloat16", cuda_graphs=True,
                       store=PackageStore(storage_dtype="bfloat16"))  # graphs on, as the server loads it
    runtime = rr.runtime
    packed = runtime.row_passes()
    assert isinstance(runtime, LocalScoringRuntime) and isinstance(packed, PackedRows) and packed.graphs is not None
    padded = PaddedRows(runtime.loaded, runtime.pad_id)
    references = [image_handle(make_png(448, 448 - 64 * (i % 3), 30 + i)) for i in range(5)]
    candidate = image_handle(make_png(448, 448, 3))
    known = {img.sha256: img.image.size for img in (*references, candidate)}
    asks = [(c, Content(images=[r])) for r in references for c in CRITERIA]
    runtime.row_passes = lambda: padded  # type: ignore[method-assign]
    try:
        expected = explain_many(runtime, asks, known, candidate=candidate, method="gradient_x_input")
    finally:
        del runtime.row_passes
    # eagerly, then captured (the shape's second call), then replayed: each as the padded passes give it
    for run in ("eager", "captured", "replayed"):
        maps = explain_many(runtime, asks, known, candidate=candidate, method="gradient_x_input")
        worst = min(_cosine(torch.tensor(a.images[0].values), torch.tensor(b.images[0].values))
                    for a, b in zip(maps, expected, strict=True))
        drift = max(abs(a.p_yes - b.p_yes) for a, b in zip(maps, expected, strict=True))
        print(f"packed ({run}) vs padded evidence, bf16: worst map cosine {worst:.4f}, P(yes) drift {drift:.2e}")
        assert worst >= 0.98 and drift <= 0.01
    counters = packed.graphs.counters
    assert counters["graph_captures"] >= 1 and counters["graph_replays"] >= 2, counters
    # a trainer's forward: prefixes under the graph too; the gradient reaches every layer's weights alike
    pairs = [criterion_pair(c, d, candidate)[0] for c, d in asks]
    packages = {p.image_sha256: p for p in runtime.packages.get_or_encode([*references, candidate])}
    _, _, groups, _ = runtime.plan(pairs, packages, Truncation(RERANK_MAX_LENGTH))
    assert len(groups) == len(CRITERIA)
    weights = [layer.self_attn.k_proj.weight for layer in runtime.loaded.model.language_model.layers]
    grads = []
    for passes in (runtime.row_passes(), padded):
        for w in weights:
            w.requires_grad_(True)
        try:
            states = torch.cat(shared_prefix_states(passes, groups, max_batch=4))
            grads.append(torch.autograd.grad((states @ runtime.weight).sum(), weights))
        finally:
            for w in weights:
                w.requires_grad_(False)
    worst_grad = min(_cosine(a, b) for a, b in zip(*grads, strict=True))
    print(f"packed vs padded weight gradients, bf16: worst layer cosine {worst_grad:.4f}")
    assert worst_grad >= 0.98
