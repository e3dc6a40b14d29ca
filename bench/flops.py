"""Floating-point operations of the tower and the LM pass, counted from the model's config, for MFU.

Matrix products only (2 x parameters x tokens for the linear layers, plus attention's QK^T and AV), the
way MFU is usually reported; element-wise work is not counted. Peak: bf16 matrix products as measured on
the box (an 8192^3 product), or ``PEAK_TFLOPS`` (798, measured on the H100 of the device box).
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


def peak_tflops() -> float:
    """bf16 matrix-product rate of this GPU (an 8192^3 product, median of 10), else the H100 anchor."""
    try:
        import torch

        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ b
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        times = []
        for _ in range(10):
            start.record()
            a @ b
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        times.sort()
        return 2 * 8192**3 / (times[len(times) // 2] / 1000) / 1e12
    except Exception:
        return PEAK_TFLOPS
