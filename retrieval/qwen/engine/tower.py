"""One eager pass of the vision tower, fed its grid-derived inputs made on the host.

Everything the Qwen3-VL tower derives from the image grids with data-dependent steps (``.tolist()``,
``repeat_interleave``, a host tensor copied to the device) is computed here on the host once per distinct grid,
with transformers' own ``get_vision_*`` functions: the cumulative image lengths, the longest image, the rotary
position ids and the position-embedding interpolation indices and weights. The tower pops them from its kwargs
instead of computing them, so a pass never waits for the device (on a CPU it is the same arithmetic:
``tests/test_graphed_tower.py`` checks it against the tower handed ``grid_thw``). The accelerated plug-in
captures this very pass as a CUDA graph (:mod:`retrieval.plugins.accelerated.graphed_tower`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rubricsearch.retrieval.qwen.engine.forward import upload

Grid = tuple[int, int, int]


def tower_inputs(visual: Any, grids: Sequence[Grid], device: torch.device) -> dict[str, torch.Tensor]:
    """The grid-derived inputs of a tower pass, computed on the host and uploaded to ``device`` without waiting
    for it (outside any capture): ``cu_seqlens``, ``position_ids``, ``interp_indices``, ``interp_weights``, exactly
    as the tower's forward would compute them from ``grid_thw`` (the same transformers functions). Each image's
    values depend on its grid alone, so they are computed once per distinct grid, in one call for all of them (a
    batch of same-size images pays for one grid, not one per image), and gathered in the batch's order."""
    from transformers.vision_utils import (
        get_vision_cu_seqlens,
        get_vision_interpolation_indices_and_weights,
        get_vision_position_ids,
    )

    distinct = list(dict.fromkeys(grids))
    unique = torch.tensor([list(g) for g in distinct], dtype=torch.long)
    indices, weights = get_vision_interpolation_indices_and_weights(
        unique, num_grid_per_side=visual.num_grid_per_side, mode=visual.interpolation_mode,
        align_corners=visual.interpolation_align_corners, spatial_merge_size=visual.config.spatial_merge_size)
    sizes = [t * h * w for t, h, w in distinct]
    starts = np.cumsum([0, *sizes[:-1]]).tolist()
    spans = {g: (start, start + n) for g, n, start in zip(distinct, sizes, starts, strict=True)}
    rows = torch.from_numpy(np.concatenate([np.arange(*spans[g]) for g in grids]))
    host = {"cu_seqlens": get_vision_cu_seqlens(torch.tensor([list(g) for g in grids], dtype=torch.long)),
            "position_ids": get_vision_position_ids(unique, visual.spatial_merge_size)[rows],
            "interp_indices": indices[rows], "interp_weights": weights[rows]}
    return {name: upload(t, device) for name, t in host.items()}


def longest(grids: Sequence[Grid]) -> int:
    """The longest attention segment (one frame of one image), known on the host."""
    return max(h * w for _, h, w in grids)


def tower_forward(visual: Any, inputs: dict[str, torch.Tensor], max_seqlen: int) -> Any:
    """The tower's output for ``inputs``: ``pixels`` (tower dtype, on its device) and the :func:`tower_inputs`. No
    host data and no sync: ``grid_thw`` is only a placeholder, the tower pops the precomputed values instead."""
    grid_thw = torch.empty((0, 3), dtype=torch.long)  # never read: every value derived from it is given
    return visual(inputs["pixels"], grid_thw=grid_thw, return_dict=True, max_seqlen=max_seqlen,
                  cu_seqlens=inputs["cu_seqlens"], position_ids=inputs["position_ids"],
                  interp_indices=inputs["interp_indices"], interp_weights=inputs["interp_weights"])


def per_image(embeds: torch.Tensor, deepstack: torch.Tensor, sizes: Sequence[int],
              ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """A pass's merged embeddings ``[tokens, hidden]`` (contiguous) and DeepStack features ``[levels, tokens,
    hidden]`` cut into each image's contiguous parts with one gather for the whole batch: embeds are row
    views, the features of every image are copied next to each other (not one copy per image, which launched
    two small kernels per image from the thread the GPU waits on). The cuts are a few torch calls for the
    whole batch, not a few per image: each call lets go of the GIL and waits to get it back."""
    levels, total, hidden = deepstack.shape
    n = np.asarray(sizes, dtype=np.int64)
    starts, rows = np.cumsum(n) - n, levels * n  # each image: first token, rows of its output block
    k = np.arange(levels * total, dtype=np.int64) - np.repeat(np.cumsum(rows) - rows, rows)  # row in its block
    size = np.maximum(np.repeat(n, rows), 1)
    index = (k // size) * total + np.repeat(starts, rows) + k % size  # level-major within each image
    flat = deepstack.reshape(levels * total, hidden).index_select(0, upload(torch.from_numpy(index), embeds.device))
    parts = embeds.split(list(sizes))
    if len(set(sizes)) == 1:  # a batch of one size (the usual ingestion batch): one view, unbound
        return list(zip(parts, flat.view(len(sizes), levels, sizes[0], hidden).unbind(0), strict=True))
    blocks = flat.split(rows.tolist())
    return [(part, block.view(levels, count, hidden)) for part, block, count in zip(parts, blocks, sizes, strict=True)]
