"""Liger's RMSNorm and rotary kernels (``LocalConfig.fused_kernels``, ``auto`` on the server's accelerated engine) are
refused clearly where they cannot run when asked for outright, and left off there under ``auto``. Their results are
checked against the official reference on a GPU (``tests/test_gpu.py``, mode ``fused``) and their speed in the GPU
report (``bench/gpu_report.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels as fused_kernels
from rubricsearch.app.state import open_state
from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels import fused_kernels_problem, fused_kernels_wanted
from rubricsearch.retrieval.plugins.accelerated.model import accelerate
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.runtime.config import LocalConfig
from rubricsearch.retrieval.runtime.local import LocalRuntime
from tests.api_helpers import api_settings

needs_cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal on a machine without CUDA")


def test_auto_means_wherever_they_can_run(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert fused_kernels_wanted("auto", cpu) is False  # no CUDA: the transformers kernels, no refusal
    assert fused_kernels_wanted(True, cpu) is True  # asked for: the loader refuses it below
    assert fused_kernels_wanted(False, cuda) is False
    monkeypatch.setattr(fused_kernels, "fused_kernels_problem", lambda device: None)  # a GPU with liger-kernel
    assert fused_kernels_wanted("auto", cuda) is True
    monkeypatch.setattr(fused_kernels, "fused_kernels_problem", lambda device: "no liger-kernel")
    assert fused_kernels_wanted("auto", cuda) is False


def test_problem_names_the_device() -> None:
    problem = fused_kernels_problem(torch.device("cpu"))
    assert problem is not None and "CUDA" in problem


@needs_cpu_only
def test_the_accelerated_engine_refuses_fused_kernels_without_cuda(tiny_embedding_dir: Path) -> None:
    loaded = load_qwen(tiny_embedding_dir, device="cpu")
    with pytest.raises(BackendUnavailable, match="the fused kernels need a CUDA device"):
        accelerate(loaded, LocalConfig(fused_kernels=True))
    accelerate(loaded, LocalConfig(fused_kernels="auto"))  # where they can run: here nowhere, and no refusal
    assert loaded.model is not None and loaded.fused_kernels is False


@needs_cpu_only
@pytest.mark.parametrize("role", ["embedder", "reranker"])
def test_the_servers_models_ask_for_them_where_they_can_run(tmp_path: Path, tiny_embedding_dir: Path,
                                                           tiny_reranker_dir: Path, role: str) -> None:
    """The server's models ask for the kernels ``auto`` (wherever they can run): without CUDA each opens on the
    plain engine with transformers' kernels instead of refusing; asked for them outright, the accelerated engine
    refuses (above)."""
    state = open_state(api_settings(tmp_path, tiny_embedding_dir, tiny_reranker_dir, models={"engine": "auto"}),
                       embedder=role == "embedder", reranker=role == "reranker")
    try:
        model = state.embedder_ if role == "embedder" else state.reranker_
        assert type(model.runtime).__name__ in ("LocalRuntime", "LocalScoringRuntime")
        assert isinstance(model.runtime, LocalRuntime) and model.runtime.loaded.fused_kernels is False
    finally:
        state.close()


def test_linear_patch_embed_equals_the_convolution(tiny_embedding_dir: Path) -> None:
    """The fused path's patch embedding (one matrix product for the stride-equals-kernel Conv3d) gives the
    convolution's output at float32 rounding, shares its weight, and differs once the weight differs."""
    from rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels import linear_patch_embed

    embed = load_qwen(tiny_embedding_dir, device="cpu", dtype="float32").model.visual.patch_embed
    pixels = torch.randn(37, embed.proj.weight[0].numel(), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = embed(pixels)
        linear_patch_embed(embed)
        got = embed(pixels)
        assert got.shape == expected.shape == (37, embed.embed_dim)
        assert torch.allclose(got, expected, atol=1e-5, rtol=1e-5)
        embed.proj.weight[0].add_(1.0)  # the product reads the module's weight (a view, not a copy)
        assert not torch.allclose(embed(pixels)[:, 0], expected[:, 0], atol=1e-3)
