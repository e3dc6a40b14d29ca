"""The exact resize alone: Pillow's bicubic arithmetic as the product runs it (each pass one gather and one batched
float64 product, :mod:`retrieval.plugins.accelerated.exact_resize`) beside the per-tap tensor ops it replaced.

    python bench/resize_kernel.py                                   # 12-MP photos, on CUDA when present
    python bench/resize_kernel.py --device cpu --images 3 --repeats 1 --width 900 --height 600 \
        --set models.max_pixels=131072

Random 8-bit RGB images of ``--width`` x ``--height`` (the arithmetic does not depend on the content), resized to
``smart_resize``'s size at the official ``min_pixels`` and the product's ``max_pixels`` (``--set`` changes it), in
calls of as many images as the product's preprocessing groups (``GROUP_PIXELS``: a 12-MP photo goes alone). Printed per
method: median ms per image over ``--repeats`` (synchronised on CUDA), the GPU kernels of one call and its peak
device memory (both on CUDA only); then the ratio, and max |delta| between the two methods and against
``PIL.Image.resize`` for the first image, which must be 0 (else the bench exits 1).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import add_settings_args, product_settings, settings_line
from rubricsearch.retrieval.plugins.accelerated.exact_resize import (
    PRECISION_BITS,
    TILE,
    coefficients,
    horizontal_first,
    resize,
)
from rubricsearch.retrieval.plugins.accelerated.gpu_preprocess import GROUP_PIXELS
from rubricsearch.retrieval.qwen.engine.vision import DEFAULT_MIN_PIXELS

FACTOR = 32  # Qwen3-VL: patch 16 x merge 2, the grid smart_resize rounds to

Resize = Callable[[torch.Tensor, tuple[int, int]], torch.Tensor]


def per_tap(images: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
    """The reference: the former implementation, per pass and per tap an index_select, an int32 cast, a multiply
    and an add over the whole output (same pass order and row crop)."""
    height, width = images.shape[-2:]
    out_h, out_w = size
    if (height, width) == (out_h, out_w):
        return images
    rows, rows_w = _taps(height, out_h, images.device)
    if not horizontal_first(height, width, out_h, out_w):
        x = _tap_pass(images, rows, rows_w, dim=-2)
        return x if width == out_w else _tap_pass(x, *_taps(width, out_w, images.device), dim=-1)
    x = images
    if width != out_w:
        if height != out_h:
            lo, hi = int(rows[0, 0]), int(rows[-1].max()) + 1
            x, rows = x[..., lo:hi, :], rows - lo
        x = _tap_pass(x, *_taps(width, out_w, images.device), dim=-1)
    return x if height == out_h else _tap_pass(x, rows, rows_w, dim=-2)


def _taps(in_size: int, out_size: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    first, count, fixed = coefficients(in_size, out_size)
    taps = np.arange(fixed.shape[1])[None, :]
    index = np.where(taps < count[:, None], first[:, None] + taps, first[:, None])
    return torch.from_numpy(index).to(device), torch.from_numpy(fixed).to(device)


def _tap_pass(x: torch.Tensor, index: torch.Tensor, weights: torch.Tensor, dim: int) -> torch.Tensor:
    shape = list(x.shape)
    shape[dim] = index.shape[0]
    acc = torch.full(shape, 1 << (PRECISION_BITS - 1), dtype=torch.int32, device=x.device)
    for t in range(index.shape[1]):
        w = weights[:, t] if dim == -1 else weights[:, t, None]
        acc += x.index_select(dim, index[:, t]).to(torch.int32) * w
    return (acc >> PRECISION_BITS).clamp_(0, 255).to(torch.uint8)


def run(method: Resize, calls: list[torch.Tensor], size: tuple[int, int], sync: Callable[[], None]) -> float:
    """Seconds for the method over every call, synchronised."""
    sync()
    t0 = time.perf_counter()
    for batch in calls:
        method(batch, size)
    sync()
    return time.perf_counter() - t0


def kernels(method: Resize, batch: torch.Tensor, size: tuple[int, int]) -> str:
    """GPU kernels and copies of one call (CUDA only: the profiler's CPU view counts operators, not work)."""
    if batch.device.type != "cuda":
        return "-"
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            method(batch, size)
            torch.cuda.synchronize()
        return str(sum(1 for e in prof.events() if e.device_type.name == "CUDA"))
    except Exception as exc:  # a box without a working CUPTI still gets the timings
        print(f"(no kernel count: {exc})", flush=True)
        return "?"


def peak_mib(method: Resize, batch: torch.Tensor, size: tuple[int, int]) -> str:
    """Device memory one call allocates at its peak, beyond what was allocated before (CUDA only)."""
    if batch.device.type != "cuda":
        return "-"
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    method(batch, size)
    torch.cuda.synchronize()
    return f"{(torch.cuda.max_memory_allocated() - base) / 2**20:.0f}"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--images", type=int, default=16)
    ap.add_argument("--width", type=int, default=4000)
    ap.add_argument("--height", type=int, default=3000)
    ap.add_argument("--repeats", type=int, default=10)
    add_settings_args(ap)
    args = ap.parse_args()
    settings = product_settings(args)
    from qwen_vl_utils.vision_process import smart_resize

    device = torch.device(args.device)
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    out_h, out_w = (int(v) for v in smart_resize(args.height, args.width, factor=FACTOR,
                                                 min_pixels=DEFAULT_MIN_PIXELS,
                                                 max_pixels=settings.models.max_pixels))
    size = (out_h, out_w)
    per_call = max(1, GROUP_PIXELS // max(args.height * args.width, out_h * out_w))
    gen = torch.Generator(device=device).manual_seed(36)
    images = torch.randint(0, 256, (args.images, 3, args.height, args.width), dtype=torch.uint8, device=device,
                           generator=gen)
    calls = [images[at:at + per_call] for at in range(0, args.images, per_call)]
    print(settings_line(settings, device_in_use=device, torch_version=torch.__version__), flush=True)
    order = "horizontal first" if horizontal_first(args.height, args.width, out_h, out_w) else "vertical first"
    print(f"resize {args.width}x{args.height} -> {out_w}x{out_h} ({order}): {args.images} images, {per_call} per "
          f"call (GROUP_PIXELS), on {device}; tile {TILE}", flush=True)

    methods: dict[str, Resize] = {"per-tap int32 ops (former)": per_tap, "tiled float64 GEMM (product)": resize}
    outputs = {name: [m(batch, size).cpu() for batch in calls] for name, m in methods.items()}  # warm-up too
    old, new = (torch.cat(o) for o in outputs.values())
    delta = int((old.to(torch.int16) - new.to(torch.int16)).abs().max())
    first = images[0].permute(1, 2, 0).cpu().numpy()
    pil = torch.from_numpy(np.array(Image.fromarray(first).resize((out_w, out_h)))).permute(2, 0, 1)
    delta_pil = int((pil.to(torch.int16) - new[0].to(torch.int16)).abs().max())

    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.repeats):  # interleaved, so drift in clocks or load hits both alike
        for name, m in methods.items():
            times[name].append(run(m, calls, size, sync) / args.images)
    ms = {name: statistics.median(t) * 1000 for name, t in times.items()}
    for name, m in methods.items():
        print(f"  {name:<30} {ms[name]:9.3f} ms/image   {kernels(m, calls[0], size):>5} kernels/call   "
              f"peak {peak_mib(m, calls[0], size):>6} MiB/call", flush=True)
    old_ms, new_ms = ms.values()
    print(f"ratio former/product: {old_ms / new_ms:.2f}x   max |delta| former vs product: {delta}   "
          f"product vs PIL (image 0): {delta_pil}", flush=True)
    if delta or delta_pil:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
