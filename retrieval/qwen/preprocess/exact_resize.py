"""Pillow's bicubic resize of 8-bit images, reproduced bit for bit as torch integer arithmetic.

The official preprocessing resizes with ``PIL.Image.resize(size)`` (bicubic). Pillow's result is fully fixed by
its source (src/libImaging/Resample.c): per output pixel a window of input pixels and double-precision filter
weights normalised to sum 1, turned into fixed-point integers of ``PRECISION_BITS`` fraction bits; each pass
sums ``pixel * weight`` in integers from a rounding offset of one half, shifts the fraction away and clips to
0..255. There are two separable passes (each only where that side changes, in Pillow's order:
:func:`horizontal_first`), and the image between them is stored as 8-bit. Here the weight tables are computed on
the host with the same formulas, in the same order of double operations, and the sums run as int32 tensor ops on
the image's device: the pixels are exactly Pillow's on a GPU too, so the packages they make are the official ones
(one fingerprint). The sums cannot overflow int32: Pillow keeps 2 spare bits for that.
"""

from __future__ import annotations

import functools
import math

import numpy as np
import PIL
import torch

# Pillow: 8 bits for the result and 2 spare for sums of negative lobes or above 1.0 in a 32-bit int.
PRECISION_BITS = 32 - 8 - 2
BICUBIC_SUPPORT = 2.0
BICUBIC_A = -0.5
PILLOW_13 = int(PIL.__version__.split(".")[0]) >= 13


def bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic kernel (a = -0.5), each double operation in Pillow's order so the values agree to the bit."""
    x = np.abs(x)
    a = BICUBIC_A
    inner = ((((a + 2.0) * x) - (a + 3.0)) * x) * x + 1.0
    outer = ((((x - 5.0) * x) + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


@functools.lru_cache(maxsize=512)
def coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, int]:
    """Per output pixel the indices of its input window and their fixed-point weights, ``[out, taps]`` each,
    plus the window's length (Pillow's ``ksize``). Taps past a window's end have weight 0 (their index repeats
    the window's first pixel, so every index is valid)."""
    scale = float(in_size) / out_size
    filterscale = max(scale, 1.0)
    support = BICUBIC_SUPPORT * filterscale
    taps = math.ceil(support) * 2 + 1
    center = 0.0 + (np.arange(out_size, dtype=np.float64) + 0.5) * scale
    inv = 1.0 / filterscale
    first = np.maximum(np.trunc(center - support + 0.5).astype(np.int64), 0)
    count = np.minimum(np.trunc(center + support + 0.5).astype(np.int64), in_size) - first
    weights = np.zeros((out_size, taps), dtype=np.float64)
    total = np.zeros(out_size, dtype=np.float64)
    for t in range(taps):  # summed tap by tap, as Pillow's loop does: the sum's rounding is part of the result
        live = t < count
        w = np.where(live, bicubic(((first + t) - center + 0.5) * inv), 0.0)
        weights[:, t] = w
        total = total + w
    weights = np.where(total[:, None] != 0.0, weights / np.where(total == 0.0, 1.0, total)[:, None], weights)
    scaled = weights * float(1 << PRECISION_BITS)
    fixed = np.trunc(np.where(weights < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    index = np.where(np.arange(taps)[None, :] < count[:, None], first[:, None] + np.arange(taps)[None, :],
                     first[:, None])
    return index, fixed, taps


def resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[..., H, W]`` uint8 -> ``[..., h, w]`` uint8, equal to ``PIL.Image.resize((w, h))`` (bicubic) of each
    image; a side that keeps its length is not resampled (as in Pillow)."""
    height, width = images.shape[-2:]
    out_h, out_w = size
    if (height, width) == (out_h, out_w):
        return images
    device = images.device
    rows, rows_w, _ = coefficients(height, out_h)
    if not horizontal_first(height, width, out_h, out_w):
        x = _pass(images, _on(rows, device), _on(rows_w, device), dim=-2)
        return x if width == out_w else _pass(x, *_table(width, out_w, device), dim=-1)
    x = images
    if width != out_w:
        if height != out_h:  # only the rows the vertical pass reads (Pillow: ybox_first..ybox_last)
            lo, hi = int(rows[0, 0]), int(rows[-1].max()) + 1
            x, rows = x[..., lo:hi, :], rows - lo
        x = _pass(x, *_table(width, out_w, device), dim=-1)
    return x if height == out_h else _pass(x, _on(rows, device), _on(rows_w, device), dim=-2)


def horizontal_first(height: int, width: int, out_h: int, out_w: int) -> bool:
    """Pillow's order of the passes: the intermediate image is rounded to 8 bits, so the order is part of the
    result. Pillow 13 runs the vertical pass first when the height shrinks by more than twice what the width
    shrinks by; earlier versions always start with the horizontal one."""
    return not (PILLOW_13 and height - out_h > 0 and height - out_h > (width - out_w) * 2)


def _table(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    index, weights, _ = coefficients(in_size, out_size)
    return _on(index, device), _on(weights, device)


def _on(array: np.ndarray, device: torch.device) -> torch.Tensor:
    return torch.from_numpy(array).to(device, non_blocking=True)


def _pass(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, dim: int) -> torch.Tensor:
    """One separable pass: per output pixel ``sum(pixel * weight)`` over its window, as int32, from Pillow's
    rounding offset; then the fraction bits shifted away (flooring) and clipped to 8 bits."""
    shape = list(x.shape)
    shape[dim] = index.shape[0]
    acc = torch.full(shape, 1 << (PRECISION_BITS - 1), dtype=torch.int32, device=x.device)
    for t in range(index.shape[1]):
        w = weights[:, t] if dim == -1 else weights[:, t, None]
        acc += x.index_select(dim, index[:, t]).to(torch.int32) * w
    return (acc >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)
