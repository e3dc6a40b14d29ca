"""Floating-point operations of the tower and the LM pass, counted from the model's config, for MFU.

Matrix products only (2 x parameters x tokens for the linear layers, plus attention's QK^T and AV), the
way MFU is usually reported; element-wise work is not counted. Peak: ``PEAK_TFLOPS``, bf16 matrix products as
an 8192^3 product runs them on an H100 (an H200 has the same compute).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

PEAK_TFLOPS = 798.0


def _linear_params(module: Any) -> int:
    import torch

    return sum(m.weight.numel() for m in module.modules() if isinstance(m, torch.nn.Linear))


def vision_flops(visual: Any, grids: Sequence[tuple[int, int, int]]) -> float:
    """One tower pass over images with these patch grids."""
    cfg = visual.config
    merge = int(cfg.spatial_merge_size) ** 2
    blocks = _linear_params(visual.blocks)
    mergers = _linear_params(visual.merger) + sum(_linear_params(m) for m in visual.deepstack_merger_list)
    patch = visual.patch_embed.proj.weight.numel()
    total = 0.0
    for t, h, w in grids:
        n = t * h * w
        total += 2 * n * (blocks + patch) + 2 * (n // merge) * mergers
        total += 4 * n * n * int(cfg.hidden_size) * int(cfg.depth)
    return total


def lm_flops(language_model: Any, config: Any, lengths: Sequence[int]) -> float:
    """One LM pass over sequences of these lengths (causal attention: half the square)."""
    params = _linear_params(language_model.layers)
    hidden, layers = int(config.hidden_size), int(config.num_hidden_layers)
    return float(sum(2 * n * params + 2 * n * n * hidden * layers for n in lengths))

