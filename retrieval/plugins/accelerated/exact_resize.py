"""Pillow's bicubic resize of 8-bit images, reproduced bit for bit as a few dense tensor ops.

The official preprocessing resizes with ``PIL.Image.resize(size)`` (bicubic). Pillow's result is fully fixed by
its source (src/libImaging/Resample.c): per output pixel a window of input pixels and double-precision filter
weights normalised to sum 1, turned into fixed-point integers of ``PRECISION_BITS`` fraction bits; each pass
sums ``pixel * weight`` in integers from a rounding offset of one half, shifts the fraction away and clips to
0..255. There are two separable passes (each only where that side changes, in Pillow's order:
:func:`horizontal_first`), and the image between them is stored as 8-bit. Here the weight tables are computed on
the host with the same formulas, in the same order of double operations, and each pass runs on the image's device
as one batched float64 matrix product: the outputs are cut into tiles of ``TILE`` pixels whose input windows are
one contiguous range each, gathered once, times a banded ``[tiles, window, TILE]`` table of the integer weights.
Every product and partial sum is an integer multiple of 2^-22 below 2^9 in magnitude (Pillow keeps 2 spare bits
so that the int32 sums cannot overflow), which float64 holds exactly in any order of summation: the pixels are
exactly Pillow's, on a GPU too (its FP64 tensor cores are IEEE), so the packages they make are the official ones
(one fingerprint).
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
PILLOW = tuple(int(part) for part in PIL.__version__.split(".")[:2])  # its pass order is part of the result
# Output pixels per tile: each tile's window is ~TILE * scale + taps inputs, so the dense band wastes a few
# multiplications per tap (cheap on FP64 tensor cores) while the gathered copy stays near the input's size.
TILE = 64
# The shifted rounding offset: one more "pixel" of value 1 per window whose weight is one half.
HALF = 0.5


def bicubic(x: np.ndarray) -> np.ndarray:
    """Pillow's bicubic kernel (a = -0.5), each double operation in Pillow's order so the values agree to the bit."""
    x = np.abs(x)
    a = BICUBIC_A
    inner = ((((a + 2.0) * x) - (a + 3.0)) * x) * x + 1.0
    outer = ((((x - 5.0) * x) + 8.0) * x - 4.0) * a
    return np.where(x < 1.0, inner, np.where(x < 2.0, outer, 0.0))


@functools.lru_cache(maxsize=512)
def coefficients(in_size: int, out_size: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per output pixel the first input pixel of its window (Pillow's ``xmin``), the window's length (``xmax``)
    and its fixed-point weights ``[out, taps]`` (0 past the window's end)."""
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
    return first, count, fixed


@functools.lru_cache(maxsize=32)
def band(in_size: int, out_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One pass as a batched matrix product: per tile of ``min(TILE, out)`` outputs the input pixels of its
    window ``[tiles, window]`` (one contiguous range, clamped inside the image) and the weights ``[tiles,
    window + 1, tile]`` as float64, scaled by 2^-22 (exact: a power of two) so the product is the result before
    its floor; the last row is the rounding offset, the weight of a constant-1 pixel. Outputs past ``out`` in the
    last tile have weight 0 and are dropped."""
    first, count, fixed = coefficients(in_size, out_size)
    tile = min(TILE, out_size)
    tiles = -(-out_size // tile)
    starts = first[::tile]
    ends = (first + count)[np.minimum(np.arange(1, tiles + 1) * tile, out_size) - 1]  # both never decrease
    window = min(int((ends - starts).max()), in_size)
    starts = np.minimum(starts, in_size - window)  # the window still covers the tile: its end is <= in_size
    weights = np.zeros((tiles, window + 1, tile), dtype=np.float64)
    out, tap = np.nonzero(np.arange(fixed.shape[1])[None, :] < count[:, None])
    weights[out // tile, first[out] + tap - starts[out // tile], out % tile] = fixed[out, tap] * 2.0 ** -PRECISION_BITS
    weights[:, window] = HALF
    return torch.from_numpy(starts[:, None] + np.arange(window)[None, :]), torch.from_numpy(weights)


def resize(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """``[..., H, W]`` uint8 -> ``[..., h, w]`` uint8, equal to ``PIL.Image.resize((w, h))`` (bicubic) of each
    image; a side that keeps its length is not resampled (as in Pillow)."""
    height, width = images.shape[-2:]
    out_h, out_w = size
    if (height, width) == (out_h, out_w):
        return images
    device = images.device
    if not horizontal_first(height, width, out_h, out_w):
        x = _vertical(images, *_table(height, out_h, device), out_h)
        return x if width == out_w else _horizontal(x, *_table(width, out_w, device), out_w)
    x = images
    cropped = width != out_w and height != out_h
    if cropped:  # the horizontal pass makes only the rows the vertical pass reads (Pillow: ybox_first..ybox_last)
        rows = band(height, out_h)[0]
        x = x[..., int(rows[0, 0]):int(rows[-1, -1]) + 1, :]
    if width != out_w:
        x = _horizontal(x, *_table(width, out_w, device), out_w)
    return x if height == out_h else _vertical(x, *_table(height, out_h, device, cropped), out_h)


def horizontal_first(height: int, width: int, out_h: int, out_w: int, pillow: tuple[int, ...] = PILLOW) -> bool:
    """Pillow's order of the passes: the intermediate image is rounded to 8 bits, so the order is part of the
    result, and it changed twice. Pillow 13 runs the vertical pass first (in C) when the height shrinks by more
    than twice what the width shrinks by; 12.2 and 12.3 do (in ``Image.resize``) when a shrinking height is over
    100 times the width; earlier versions always start with the horizontal one."""
    if pillow >= (13, 0):
        return not (height - out_h > 0 and height - out_h > (width - out_w) * 2)
    if pillow >= (12, 2):
        return not (height > width * 100 and out_h < height)
    return True


def _table(in_size: int, out_size: int, device: torch.device, cropped: bool = False,
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`band` on ``device``, its indices counted from the first row read where ``cropped``. A GPU keeps its
    copy (each use would otherwise wait for ~2 MB to cross the bus), and each use is recorded on the stream that
    makes it: a copy evicted from the cache frees no memory that a queued kernel of another stream still reads."""
    if device.type != "cuda":
        return _counted(in_size, out_size, cropped)
    index, weights = _placed(in_size, out_size, device, cropped)
    stream = torch.cuda.current_stream(device)
    index.record_stream(stream)
    weights.record_stream(stream)
    return index, weights


@functools.lru_cache(maxsize=32)
def _placed(in_size: int, out_size: int, device: torch.device, cropped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    index, weights = _counted(in_size, out_size, cropped)
    return index.to(device), weights.to(device)


def _counted(in_size: int, out_size: int, cropped: bool) -> tuple[torch.Tensor, torch.Tensor]:
    index, weights = band(in_size, out_size)
    return (index - index[0, 0] if cropped else index), weights


def _to_pixels(sums: torch.Tensor) -> torch.Tensor:
    """Pillow's shift and clip of ``sum + offset``, here already divided by 2^22: floor, then clip to 0..255.
    Clipped first, the cast to uint8 that follows truncates, which is the floor of a value >= 0."""
    return sums.clamp_(0.0, 255.0)


def _horizontal(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out_size: int) -> torch.Tensor:
    """The pass along the last axis, ``[..., H, W]`` -> ``[..., H, out]``: one gather and one batched product
    ``[tiles, rows, window + 1] @ [tiles, window + 1, tile]``."""
    tiles, window = index.shape
    tile = weights.shape[-1]
    lead = x.shape[:-1]
    rows = math.prod(lead)
    picked = x.index_select(-1, index.view(-1)).view(rows, tiles, window)
    windows = torch.empty((tiles, rows, window + 1), dtype=torch.float64, device=x.device)
    windows[..., :window].copy_(picked.transpose(0, 1))
    windows[..., window] = 1.0
    sums = _to_pixels(torch.bmm(windows, weights))
    out = torch.empty((rows, tiles * tile), dtype=torch.uint8, device=x.device)
    out.view(rows, tiles, tile).copy_(sums.transpose(0, 1))
    return out[:, :out_size].view(*lead, out_size)


def _vertical(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, out_size: int) -> torch.Tensor:
    """The pass along the second-last axis, ``[..., H, W]`` -> ``[..., out, W]``: one gather of whole rows and one
    batched product ``[tiles, tile, window + 1] @ [tiles, window + 1, planes * W]``."""
    tiles, window = index.shape
    tile = weights.shape[-1]
    lead, width = x.shape[:-2], x.shape[-1]
    planes = math.prod(lead)
    picked = x.index_select(-2, index.view(-1)).view(planes, tiles, window, width)
    windows = torch.empty((tiles, window + 1, planes, width), dtype=torch.float64, device=x.device)
    windows[:, :window].copy_(picked.permute(1, 2, 0, 3))
    windows[:, window] = 1.0
    sums = _to_pixels(torch.bmm(weights.transpose(1, 2), windows.view(tiles, window + 1, planes * width)))
    out = torch.empty((planes, tiles * tile, width), dtype=torch.uint8, device=x.device)
    out.view(planes, tiles, tile, width).copy_(sums.view(tiles, tile, planes, width).permute(2, 0, 1, 3))
    return out[:, :out_size].view(*lead, out_size, width)
