"""A check that the CPU tests (``test_graphed_tower.py``) and the GPU tests (``test_gpu_tower.py``) both run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen


def host_made_inputs_equal_the_grid_pass(loaded: LoadedQwen, make_png: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The encoders' eager pass fed host-made inputs (which on a GPU spares the stream syncs) gives the
    packages of the tower's own pass, which derives them from ``grid_thw``, to the bit: mixed sizes, a repeated
    grid, out of size order. The accelerated encoder's (on a GPU: its grouped attention), whose eager pass is the
    plain one's."""
    from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
    from rubricsearch.retrieval.qwen.engine import vision

    sizes = ((448, 448, 1), (320, 640, 2), (448, 448, 3), (96, 160, 4), (640, 320, 5))
    images = [decode_image(make_png(w, h, seed)) for w, h, seed in sizes]
    host_made = AcceleratedVisionEncoder(loaded).encode(images)

    def grid_pass(visual: Any, inputs: dict[str, Any], max_seqlen: int) -> Any:  # transformers' call, grid on device
        grid_thw = torch.tensor([list(g) for g in inputs["grids"]], dtype=torch.long, device=loaded.device)
        return visual(inputs["pixels"], grid_thw=grid_thw, return_dict=True, max_seqlen=max_seqlen)

    monkeypatch.setattr(vision, "tower_inputs", lambda _visual, grids, _device: {"grids": grids})
    monkeypatch.setattr(vision, "tower_forward", grid_pass)
    from_grid = AcceleratedVisionEncoder(loaded).encode(images)
    for got, want in zip(host_made, from_grid, strict=True):
        assert got.grid_thw == want.grid_thw
        assert torch.equal(got.embeds, want.embeds) and torch.equal(got.deepstack, want.deepstack)
