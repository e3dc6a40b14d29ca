"""The reranker's fine-tune on CUDA (run on the device machine: ``pytest -m gpu``): a bfloat16 base under search's
fused kernels, float32 adapters computed in bfloat16, packages read from a CUDA store, and a version that loads and
scores them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.tuning import fine_tune_reranker, save_version
from rubricsearch.rerank.tuning.cells import example
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore, Purpose, Usage
from rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels import fused_kernels_problem
from rubricsearch.retrieval.runtime.config import LocalConfig
from rubricsearch.retrieval.tuning.judgments import JudgedCell
from tests.fine_tune_worlds import CRITERIA, SETTINGS
from tests.gpu_modes import _reference_kernels_after  # noqa: F401 (autouse: Liger's rotary is process-wide)

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


def test_a_cuda_fine_tune_trains_float32_adapters_and_its_version_scores_the_packages(
        tiny_reranker_dir: Path, make_png: Callable[..., bytes], tmp_path: Path) -> None:
    images = [decode_image(make_png(48 + 8 * (i % 3), 40, seed=i)) for i in range(12)]
    store = PackageStore(storage_dtype="bfloat16", memory_device="cuda")
    ingest = load_reranker(tiny_reranker_dir, store=store, device="cuda", dtype="bfloat16")
    ingest.packages.get_or_encode(images, purpose=Purpose.INGEST)
    cells = [JudgedCell(2 * i + k + 1, img.sha256, c, (i + k) % 2 == 0)
             for i, img in enumerate(images) for k, c in enumerate(CRITERIA)]
    tuned = fine_tune_reranker(tiny_reranker_dir, cells, store, settings=replace(SETTINGS, steps=8, lr=1e-2),
                               local=LocalConfig(device="cuda", fused_kernels="auto"))
    assert tuned.loaded.dtype == torch.bfloat16 and tuned.vision_encodes == 0
    # trained through the serving engine: with the server's fused kernels, Liger's wherever liger-kernel is installed
    assert tuned.loaded.fused_kernels == (fused_kernels_problem(tuned.loaded.device) is None)
    trainable = [p for p in tuned.peft_model.parameters() if p.requires_grad]
    assert trainable and all(p.dtype == torch.float32 and p.is_cuda for p in trainable)
    assert len(tuned.losses) == 8 and all(torch.isfinite(torch.tensor(tuned.losses)))
    out = tmp_path / "reranker-v1"
    save_version(tuned, out)
    pairs = [example(c).pair for c in cells[:6]]
    version = load_reranker(out, store=store, device="cuda", dtype="bfloat16")
    usage = Usage()
    before, after = ingest.score_pairs(pairs, usage=usage), version.score_pairs(pairs, usage=usage)
    assert usage.total() == 0, "the version reads the base's packages"
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-4, "the merged adapters change scores"
