"""Photo-like test files for the benchmarks: JPEGs whose decode cost resembles real uploads."""

from __future__ import annotations

import io
import os
from typing import Any

import numpy as np
from PIL import Image


def jpeg(width: int, height: int, seed: int) -> bytes:
    """A photo-like JPEG (smooth gradients plus noise), so decode cost resembles real uploads."""
    rng = np.random.default_rng(seed)
    x = np.arange(width, dtype=np.int32)[None, :]
    y = np.arange(height, dtype=np.int32)[:, None]
    base = np.empty((height, width, 3), dtype=np.int16)
    base[..., 0] = (x * (1 + seed % 3)) % 256
    base[..., 1] = (y * 2) % 256
    base[..., 2] = (x + y + seed) % 256
    base += rng.integers(-20, 21, base.shape, dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=88)
    return buf.getvalue()


def make_files(n: int, side: int, square: bool, first: int = 0) -> list[tuple[str, bytes]]:
    """``n`` test JPEGs (seeds from ``first``: other values give other images of the same sizes)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, bytes]:
        if square:
            return f"img{i}.jpg", jpeg(side, side, first + i)
        return f"img{i}.jpg", jpeg(side - 37 * (i % 5), side * 3 // 4 - 23 * (i % 4), first + i)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(one, range(n)))


def sync_for(gpu: bool) -> Any:
    """``torch.cuda.synchronize`` on a GPU (timings wait for the device), else a no-op."""
    if not gpu:
        return lambda: None
    import torch

    return torch.cuda.synchronize
