"""The capturable tower pass behind ``LocalConfig.cuda_graphs``
(``retrieval/plugins/accelerated/graphed_tower.py``), the eager pass of ``retrieval/qwen/engine/tower.py``, equals
the transformers tower pass handed ``grid_thw``. It runs eagerly here (no GPU); ``tests/test_gpu_tower.py`` replays
it as CUDA graphs."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.plugins.accelerated.graphed_tower import (
    MAX_IMAGES,
    MAX_PATCHES,
    GraphedTower,
    split_output,
    tower_pass,
)
from rubricsearch.retrieval.plugins.accelerated.tower_attention import GROUPED_ATTENTION, RUNS, register, runs_of
from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
from rubricsearch.retrieval.qwen.engine.tower import longest, per_image, tower_inputs
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen, load_qwen
from tests.tower_checks import host_made_inputs_equal_the_grid_pass

Grid = tuple[int, int, int]
GRIDS: dict[str, list[Grid]] = {
    "square": [(1, 8, 8)],
    "non-square": [(1, 6, 10)],
    "two images": [(1, 4, 4), (1, 8, 6)],
    "two frames": [(2, 4, 6)],
}


@pytest.fixture(scope="module")
def loaded(tiny_embedding_dir: Path) -> LoadedQwen:
    return load_qwen(tiny_embedding_dir, device="cpu", dtype="float32")


@pytest.fixture(params=["sdpa", "grouped"])
def attention(request: pytest.FixtureRequest, loaded: LoadedQwen) -> Iterator[str]:
    """Both attention paths the tower can take here: transformers' per-image SDPA and the grouped one the
    encoder switches to (on the CPU its per-run SDPA, fed the device ``cu_seqlens``)."""
    config = loaded.model.visual.config
    previous = config._attn_implementation
    if request.param == "grouped":
        assert register()
        config._attn_implementation = GROUPED_ATTENTION
    yield request.param
    config._attn_implementation = previous
    RUNS.runs = None


def _pixels(loaded: LoadedQwen, grids: list[Grid], seed: int = 0) -> torch.Tensor:
    ip = loaded.processor.image_processor
    dim = 3 * int(ip.temporal_patch_size) * int(ip.patch_size) ** 2
    patches = sum(t * h * w for t, h, w in grids)
    return torch.randn((patches, dim), generator=torch.Generator().manual_seed(seed))


def _plain(loaded: LoadedQwen, pixels: torch.Tensor, grids: list[Grid], attention: str) -> torch.Tensor:
    """The tower as ``VisionEncoder`` runs it eagerly, stacked like :func:`tower_pass`."""
    visual = loaded.model.visual
    kwargs: dict[str, Any] = {}
    if attention == "grouped":
        lengths = [h * w for t, h, w in grids for _ in range(t)]
        RUNS.runs, kwargs["max_seqlen"] = runs_of(lengths), max(lengths)
    out = visual(pixels, grid_thw=torch.tensor(grids, dtype=torch.long), return_dict=True, **kwargs)
    return torch.stack([out.pooler_output, *out.deepstack_features])


def _precomputed(loaded: LoadedQwen, pixels: torch.Tensor, grids: list[Grid], attention: str,
                 inputs_for: list[Grid] | None = None) -> torch.Tensor:
    visual = loaded.model.visual
    if attention == "grouped":
        RUNS.runs = runs_of([h * w for t, h, w in grids for _ in range(t)])
    inputs = {"pixels": pixels, **tower_inputs(visual, inputs_for or grids, loaded.device)}
    return tower_pass(visual, inputs, longest(grids))


@pytest.mark.parametrize("case", list(GRIDS))
def test_precomputed_pass_equals_the_tower(loaded: LoadedQwen, attention: str, case: str) -> None:
    grids = GRIDS[case]
    pixels = _pixels(loaded, grids)
    with torch.inference_mode():
        expected = _plain(loaded, pixels, grids, attention)
        got = _precomputed(loaded, pixels, grids, attention)
    levels = len(loaded.model.visual.deepstack_visual_indexes)
    tokens = sum(t * h * w for t, h, w in grids) // 4
    assert got.shape == (1 + levels, tokens, loaded.hidden_size)
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=1e-6, rtol=0)


@pytest.mark.parametrize("case,wrong", [("non-square", [(1, 10, 6)]),  # the grid transposed
                                        ("two images", [(1, 8, 6), (1, 4, 4)]),  # the images swapped
                                        ("square", [(1, 4, 16)])])  # as many patches, another shape
def test_wrong_precomputed_inputs_change_the_output(loaded: LoadedQwen, attention: str, case: str,
                                                    wrong: list[Grid]) -> None:
    """The check above can see the precomputed inputs: the tower really uses them (it is handed no usable
    grid), so inputs of another grid with as many patches give another output."""
    grids = GRIDS[case]
    pixels = _pixels(loaded, grids)
    with torch.inference_mode():
        right = _precomputed(loaded, pixels, grids, attention)
        other = _precomputed(loaded, pixels, grids, attention, inputs_for=wrong)
    assert right.shape == other.shape
    assert (right - other).abs().max() > 1e-3


def test_precomputed_inputs_are_those_transformers_computes(loaded: LoadedQwen) -> None:
    """Computed once per distinct grid and concatenated, they equal transformers' functions over the whole batch."""
    from transformers.vision_utils import get_vision_interpolation_indices_and_weights, get_vision_position_ids

    grids = GRIDS["two images"]
    inputs = tower_inputs(loaded.model.visual, grids, loaded.device)
    assert inputs["cu_seqlens"].tolist() == [0, 16, 64] and inputs["cu_seqlens"].dtype == torch.int32
    assert inputs["position_ids"].shape == (64, 2) and inputs["interp_indices"].shape[0] == 64
    visual = loaded.model.visual
    batch = [(1, 8, 6), (1, 4, 4), (1, 8, 6), (2, 4, 8), (1, 4, 4), (1, 8, 6)]  # repeated grids, out of order
    inputs = tower_inputs(visual, batch, loaded.device)
    grid_thw = torch.tensor(batch, dtype=torch.long)
    indices, weights = get_vision_interpolation_indices_and_weights(
        grid_thw, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    assert torch.equal(inputs["position_ids"], get_vision_position_ids(grid_thw, visual.spatial_merge_size))
    assert torch.equal(inputs["interp_indices"], indices) and torch.equal(inputs["interp_weights"], weights)
    assert inputs["cu_seqlens"].tolist() == [0, 48, 64, 112, 144, 176, 192, 240]  # one segment per frame
    assert longest(grids) == 48 and longest(GRIDS["two frames"]) == 24  # one frame is one segment


def test_split_output_matches_the_encoder_packages(loaded: LoadedQwen) -> None:
    """Per-image (embeds, deepstack) as ``AcceleratedVisionEncoder._run_tower`` makes them, and copies: no part is
    a view of the stacked (in a graph: static) output."""
    encoder = AcceleratedVisionEncoder(loaded, grouped_attention=True)
    grids = GRIDS["two images"]
    pixels = _pixels(loaded, grids, seed=3)
    with torch.inference_mode():
        packages = encoder._run_tower(pixels, grids, ["a", "b"])
        RUNS.runs = runs_of([h * w for t, h, w in grids for _ in range(t)])
        config = loaded.model.visual.config
        previous, config._attn_implementation = config._attn_implementation, GROUPED_ATTENTION
        try:
            stacked = tower_pass(loaded.model.visual, {"pixels": pixels, **tower_inputs(
                loaded.model.visual, grids, loaded.device)}, longest(grids))
        finally:
            config._attn_implementation, RUNS.runs = previous, None
    parts = split_output(stacked, grids, 4)
    for package, (embeds, deepstack) in zip(packages, parts, strict=True):
        assert embeds.shape == package.embeds.shape and deepstack.shape == package.deepstack.shape
        assert embeds.is_contiguous() and deepstack.is_contiguous()
        np.testing.assert_allclose(embeds.numpy(), package.embeds.numpy(), atol=1e-6, rtol=0)
        np.testing.assert_allclose(deepstack.numpy(), package.deepstack.numpy(), atol=1e-6, rtol=0)
        for part in (embeds, deepstack):
            assert part.untyped_storage().data_ptr() != stacked.untyped_storage().data_ptr()


def test_only_small_passes_are_graphed(loaded: LoadedQwen) -> None:
    graphs = GraphedTower(loaded.model.visual, loaded.device)
    assert graphs.fits([(1, 32, 32)]) and graphs.fits([(1, 60, 120)])  # one image at the default max_pixels
    assert graphs.fits([(1, 32, 32)] * MAX_IMAGES)
    assert not graphs.fits([(1, 8, 8)] * (MAX_IMAGES + 1))  # an ingestion batch runs eagerly
    assert not graphs.fits([(1, 96, 96)] * 2) and MAX_PATCHES < 2 * 96 * 96  # GPU-bound anyway: eager
    bulk = GraphedTower(loaded.model.visual, loaded.device, max_images=64, max_patches=65536, one_length=True)
    assert bulk.fits([(1, 28, 28)] * 64) and bulk.fits([(1, 24, 32), (1, 32, 24)] * 32)  # orientations: one length
    assert not bulk.fits([(1, 28, 28)] * 63 + [(1, 28, 30)])  # a mixed-size set's batch: eager


@pytest.mark.parametrize("role", ["embedder", "reranker"])
def test_cuda_graphs_reach_the_vision_encoder(tiny_embedding_dir: Path, tiny_reranker_dir: Path, role: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Each accelerated local model hands its ``cuda_graphs`` to the encoder it builds; on the CPU the encoder runs
    eagerly whatever it says, and its stats carry the graph counters."""
    import rubricsearch.retrieval.plugins.accelerated.runtime
    from rubricsearch.rerank.factory import load_reranker
    from rubricsearch.retrieval.embedding.factory import load_embedder

    seen: list[bool] = []

    class Spy(AcceleratedVisionEncoder):
        def __init__(self, *args: Any, cuda_graphs: bool = False, **kwargs: Any) -> None:
            seen.append(cuda_graphs)
            super().__init__(*args, cuda_graphs=cuda_graphs, **kwargs)

    # both accelerated runtimes build their encoder there
    monkeypatch.setattr(rubricsearch.retrieval.plugins.accelerated.runtime, "AcceleratedVisionEncoder", Spy)
    path = tiny_embedding_dir if role == "embedder" else tiny_reranker_dir
    load: Any = load_embedder if role == "embedder" else load_reranker
    loaded = load_qwen(path, device="cpu", dtype="float32", lm_rows=() if role == "embedder" else ("yes", "no"))
    model = load(loaded, packages=VisualPackages(PackageStore(storage_dtype="float32")), cuda_graphs=True,
                 engine="accelerated")
    assert seen == [True]
    assert not model.runtime.vision.cuda_graphs
    stats = model.runtime.vision.stats()
    assert stats["tower_graph_replays"] == stats["tower_graph_captures"] == 0


def test_per_image_cuts_a_batch_into_each_images_contiguous_parts() -> None:
    """One gather gives every image its own DeepStack block ``[levels, tokens, hidden]``, contiguous and equal
    to the slice of the batch, whatever the mix of sizes (one token included)."""
    sizes = [4, 1, 7, 2, 3]
    embeds, deepstack = torch.randn(sum(sizes), 5), torch.randn(3, sum(sizes), 5)
    parts, at = per_image(embeds, deepstack, sizes), 0
    assert len(parts) == len(sizes)
    for n, (e, d) in zip(sizes, parts, strict=True):
        assert torch.equal(e, embeds[at:at + n]) and torch.equal(d, deepstack[:, at:at + n]) and d.is_contiguous()
        at += n
    assert per_image(embeds[:0], deepstack[:, :0], []) == []


def test_only_runs_of_long_images_are_cut_out_for_cudnn() -> None:
    """Long runs alone (in power-of-two counts), the shorter runs between them merged into one FlashAttention block
    each."""
    from rubricsearch.retrieval.plugins.accelerated.tower_attention import cudnn_blocks

    runs = runs_of([16, 16, 7000, 7000, 64, 32, 5000])
    assert cudnn_blocks(runs, 4096) == [(False, [(0, 16, 2)]), (True, [(32, 7000, 2)]),
                                        (False, [(14032, 64, 1), (14096, 32, 1)]), (True, [(14128, 5000, 1)])]
    assert cudnn_blocks(runs, 1 << 30) == [(False, runs)]  # no photos: the one variable-length call, as before
    assert cudnn_blocks(runs_of([6912] * 16), 4096) == [(True, [(0, 6912, 16)])]
    seen: set[int] = set()  # a length met for the first time stays with FlashAttention once
    assert cudnn_blocks(runs_of([7000, 7000]), 4096, seen) == [(False, [(0, 7000, 2)])] and seen == {7000}
    assert cudnn_blocks(runs_of([7000, 7000]), 4096, seen) == [(True, [(0, 7000, 2)])]
    # 13 photos of one size: 8 + 4 + 1, counts whose cuDNN plans any other mix reuses
    assert cudnn_blocks(runs_of([16] + [5000] * 13), 4096) == [
        (False, [(0, 16, 1)]), (True, [(16, 5000, 8)]), (True, [(40016, 5000, 4)]), (True, [(60016, 5000, 1)])]


def test_no_cudnn_inside_flash_only_on_this_thread_alone() -> None:
    """A CUDA graph's warm-up runs under ``flash_only`` (its capture runs FlashAttention): no plan built for it."""
    import threading

    from rubricsearch.retrieval.plugins.accelerated.kernels.cudnn_attention import flash_only, usable

    assert usable()
    other: list[bool] = []
    with flash_only():
        assert not usable()
        thread = threading.Thread(target=lambda: other.append(usable()))
        thread.start()
        thread.join()
    assert other == [True] and usable()


def test_an_eager_encoder_pass_on_host_made_inputs_equals_the_grid_pass(loaded: LoadedQwen, make_png: Any,
                                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """On the CPU (``tests/test_gpu_tower.py`` checks the same on a GPU)."""
    host_made_inputs_equal_the_grid_pass(loaded, make_png, monkeypatch)
