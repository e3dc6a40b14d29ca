"""A check that the CPU tests (``test_graphed_tower.py``) and the GPU tests (``test_gpu_tower.py``) both run."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from retrieval.images import decode_image
from retrieval.qwen.loading import LoadedQwen


def host_made_inputs_equal_the_grid_pass(loaded: LoadedQwen, make_png: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """``VisionEncoder``'s eager pass fed host-made inputs (``vision.PRECOMPUTED``, which on a GPU spares the stream
    syncs) gives the packages of the pass that derives them from ``grid_thw``, to the bit: mixed sizes, a repeated
    grid, out of size order."""
    from retrieval.qwen import vision

    sizes = ((448, 448, 1), (320, 640, 2), (448, 448, 3), (96, 160, 4), (640, 320, 5))
    images = [decode_image(make_png(w, h, seed)) for w, h, seed in sizes]
    host_made = vision.VisionEncoder(loaded).encode(images)
    monkeypatch.setattr(vision, "PRECOMPUTED", False)
    from_grid = vision.VisionEncoder(loaded).encode(images)
    for got, want in zip(host_made, from_grid, strict=True):
        assert got.grid_thw == want.grid_thw
        assert torch.equal(got.embeds, want.embeds) and torch.equal(got.deepstack, want.deepstack)
