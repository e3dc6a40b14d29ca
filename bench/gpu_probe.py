"""What the GPU box offers for the host-side and attention work of ingestion, measured side by side.

    python3 bench/gpu_probe.py          # on a CUDA box

- JPEG decode of a 12-megapixel photo: PIL (what ingestion does), PIL draft mode, and nvJPEG through
  ``torchvision.io.decode_jpeg(device="cuda")`` (one and a batch).
- The official resize (PIL bicubic to the smart_resize size) vs ``torch.nn.functional.interpolate``
  (bicubic, antialias) on the GPU: time and the largest pixel difference.
- Attention for packed variable-length images: the grouped SDPA the tower uses now vs one varlen
  FlashAttention call (``torch.ops.aten._flash_attention_forward`` with cumulative sequence lengths).
"""

from __future__ import annotations

import io
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def photo(seed: int, w: int = 4032, h: int = 3024) -> bytes:
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (h // 64, w // 64, 3), dtype=np.uint8)
    img = Image.fromarray(small).resize((w, h), Image.BICUBIC)
    arr = np.asarray(img, dtype=np.int16) + rng.integers(-12, 12, (h, w, 3), dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(arr, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def bench(fn: Any, reps: int = 5, cuda: bool = False) -> float:
    fn()
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    if cuda:
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / reps * 1000


def main() -> None:
    import torchvision
    from qwen_vl_utils.vision_process import smart_resize

    print(f"torch {torch.__version__} torchvision {torchvision.__version__} {torch.cuda.get_device_name()}")
    data = [photo(i) for i in range(16)]
    h, w = smart_resize(3024, 4032, factor=32, min_pixels=4096, max_pixels=1843200)
    print(f"12 MP photo -> smart_resize {w}x{h}")

    def pil_decode() -> Image.Image:
        return Image.open(io.BytesIO(data[0])).convert("RGB")

    def pil_draft() -> Image.Image:
        im = Image.open(io.BytesIO(data[0]))
        im.draft("RGB", (w, h))
        return im.convert("RGB")

    full = pil_decode()
    print(f"PIL decode {bench(pil_decode):.1f} ms; draft decode {bench(pil_draft):.1f} ms "
          f"(draft size {pil_draft().size}); PIL resize {bench(lambda: full.resize((w, h))):.1f} ms")
    from torchvision.io import decode_jpeg

    raw = [torch.frombuffer(bytearray(d), dtype=torch.uint8) for d in data]
    try:
        one = bench(lambda: decode_jpeg(raw[0], device="cuda"), cuda=True)
        many = bench(lambda: decode_jpeg(raw, device="cuda"), reps=3, cuda=True)
        print(f"nvJPEG decode: 1 photo {one:.1f} ms; 16 photos {many:.1f} ms ({many / 16:.1f} ms each)")
        gpu = decode_jpeg(raw[0], device="cuda")
        cpu = torch.from_numpy(np.asarray(full)).permute(2, 0, 1)
        print(f"nvJPEG vs PIL decode: max |diff| {int((gpu.cpu().int() - cpu.int()).abs().max())} levels, "
              f"mean {float((gpu.cpu().float() - cpu.float()).abs().mean()):.3f}")

        def gpu_resize() -> torch.Tensor:
            x = gpu.unsqueeze(0).float()
            return torch.nn.functional.interpolate(x, size=(h, w), mode="bicubic", antialias=True,
                                                   align_corners=False).round().clamp(0, 255)

        ref = torch.from_numpy(np.asarray(full.resize((w, h)))).permute(2, 0, 1).float()
        got = gpu_resize()[0].cpu()
        print(f"GPU bicubic+antialias resize {bench(gpu_resize, cuda=True):.2f} ms; vs PIL: max |diff| "
              f"{float((got - ref).abs().max()):.0f} levels, mean {float((got - ref).abs().mean()):.3f}")
    except Exception as exc:  # report, do not stop the probe
        print(f"nvJPEG path failed: {type(exc).__name__}: {exc}")
    attention()


def attention() -> None:
    """Packed images' attention: grouped SDPA (now) vs one varlen FlashAttention call."""
    for lengths in ([1024] * 64, [1024, 784, 576, 1024, 900, 640] * 10):
        attention_case(lengths)


def attention_case(lengths: list[int], heads: int = 16, dim: int = 64) -> None:
    from retrieval.qwen.tower_attention import _sdpa
    from retrieval.qwen.tower_attention import runs_of as _runs

    total = sum(lengths)
    q, k, v = (torch.randn(total, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    runs = _runs(lengths)

    def grouped() -> torch.Tensor:
        outs = []
        for start, length, count in runs:
            def view(t: torch.Tensor, s: int = start, c: int = count, n: int = length) -> Any:
                return t[s:s + c * n].unflatten(0, (c, n)).transpose(1, 2)

            outs.append(_sdpa(view(q), view(k), view(v), 0.0, None).transpose(1, 2).reshape(-1, heads, dim))
        return torch.cat(outs)

    cu = torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32, device="cuda")

    def varlen() -> torch.Tensor:
        out = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, max(lengths), max(lengths), 0.0, False, False)
        return out[0]

    g = bench(grouped, reps=20, cuda=True)
    try:
        vl = bench(varlen, reps=20, cuda=True)
        diff = float((grouped().float() - varlen().float()).abs().max())
        flops = 4 * sum(n * n for n in lengths) * heads * dim
        print(f"attention {len(lengths)} images ({len(runs)} size runs, {total} patches): grouped SDPA "
              f"{g:.2f} ms, varlen flash {vl:.2f} ms ({flops / vl / 1e9:.0f} TFLOP/s), max |diff| {diff:.3g}")
    except Exception as exc:
        print(f"varlen flash attention failed: {type(exc).__name__}: {exc}; grouped SDPA {g:.2f} ms")


if __name__ == "__main__":
    main()
