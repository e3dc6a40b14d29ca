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


def png(side: int, seed: int) -> bytes:
    """A noise PNG (its CPU decode dominates a small image's cold call: the worst case for decoding)."""
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def photo(seed: int, long_side: int = 4032) -> bytes:
    """A 12-megapixel 4:3 (or 3:4) photo-like JPEG, as phones take them."""
    w, h = (long_side, long_side * 3 // 4) if seed % 2 else (long_side * 3 // 4, long_side)
    return jpeg(w, h, seed)


KINDS = ("square", "mixed", "photo")


def image(kind: str, side: int, seed: int, i: int = 0) -> bytes:
    """One bench image: ``square`` side x side, ``mixed`` one of 20 sizes up to ``side`` (4:3-ish; at 640 px:
    492-640 x 411-480), ``photo`` 12 MP; JPEGs, whose decode cost resembles real uploads."""
    if kind == "photo":
        return photo(seed)
    if kind == "square":
        return jpeg(side, side, seed)
    return jpeg(side - side * 37 // 640 * (i % 5), side * 3 // 4 - side * 23 // 640 * (i % 4), seed)


def make_files(n: int, side: int, kind: str, first: int = 0) -> list[tuple[str, bytes]]:
    """``n`` test images of one :data:`KINDS` (seeds from ``first``: other values give other images of the same
    sizes)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(i: int) -> tuple[str, bytes]:
        return f"img{i}.jpg", image(kind, side, first + i, i)

    with ThreadPoolExecutor(max_workers=min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(one, range(n)))


def sync_for(gpu: bool) -> Any:
    """``torch.cuda.synchronize`` on a GPU (timings wait for the device), else a no-op."""
    if not gpu:
        return lambda: None
    import torch

    return torch.cuda.synchronize


def stream_sync_for(gpu: bool) -> Any:
    """Waits for the calling thread's current CUDA stream only (safe while another thread captures a graph)."""
    if not gpu:
        return lambda: None
    import torch

    return lambda: torch.cuda.current_stream().synchronize()
