"""Float8 matrix products for the ingestion passes, measured before anything of it goes into the product.

Issue 12's 400 images/s at 448 px is past what today's passes allow on an H100: tower 89.2 ms + LM 88.0 ms per 64
images (``bench/gpu_run.sh mfu66``) cap the GPU at ~361 images/s. Hopper multiplies float8 e4m3 at twice the bf16
rate, so this bench swaps every linear layer of the tower's blocks and of the LM's layers for one that quantizes
its input per token and its weight per output channel and multiplies with ``torch._scaled_mm`` (rowwise scales,
bf16 out), then prints, side by side in one run: each pass's time in bf16 and in float8 (the quantization kernels
included, as separate kernels and fused into one by torch.compile), and how far the embeddings move (cosine
against bf16, same images, same texts). Measured on an H100 (``bench/gpu_run.sh fp8_77``, README): slower in every
arm and cosine 0.962 on the 2B architecture, so the product's passes stay bf16.

    python3 bench/fp8_passes.py --checkpoint CKPT             # on a CUDA box (2B, 64 images of 448 px)
    .venv/bin/python bench/fp8_passes.py --images 4            # the CPU: a tiny model, numerics only
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.compile_check import timed, tower_inputs
from bench.fp8_packages import photo
from retrieval.embedding.local import LocalEmbedder
from retrieval.images import DecodedImage, decode_image
from retrieval.packages import PackageStore, VisualPackages
from retrieval.packages.storage_form import _fp8_rows as fp8_rows
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.loading import LoadedQwen, load_qwen
from retrieval.qwen.prompts import Content

Quantiser = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def eager_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per token, float32 scales, as separate kernels (abs, amax, divide, clamp, cast)."""
    return fp8_rows(x.float())


class Fp8Linear(torch.nn.Module):
    """``linear``'s product in float8 e4m3: the weight quantized once per output channel (the package store's
    per-row quantiser), the input per token at every call by ``quantise``, the output in the input's dtype."""

    def __init__(self, linear: torch.nn.Linear, quantise: Quantiser) -> None:
        super().__init__()
        self.quantise = quantise
        weight, scale = fp8_rows(linear.weight.detach().float())  # [out, in] row-major, [out, 1]
        self.register_buffer("weight_q", weight)
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, out]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        quantized, scale = self.quantise(x.reshape(-1, x.shape[-1]))  # per token: [tokens, 1] float32 scales
        out = torch._scaled_mm(quantized, self.weight_q.t(), scale_a=scale, scale_b=self.weight_scale,
                               out_dtype=x.dtype)
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], out.shape[-1])


def to_fp8(loaded: LoadedQwen, quantise: Quantiser) -> int:
    """Swap the linear layers of the tower's blocks and the LM's layers (not the embeddings, mergers or head)."""
    swapped = 0
    for stack in (loaded.model.visual.blocks, loaded.model.language_model.layers):
        for module in list(stack.modules()):
            for name, child in list(module.named_children()):
                if isinstance(child, torch.nn.Linear) and child.in_features % 16 == 0 and child.out_features % 16 == 0:
                    setattr(module, name, Fp8Linear(child, quantise))
                    swapped += 1
    return swapped


def passes(emb: LocalEmbedder, images: list[DecodedImage], text: str, device: str
           ) -> tuple[float, float, torch.Tensor]:
    """Milliseconds of one tower pass and one LM pass (from cached packages) over ``images`` with ``text``, and
    the vectors."""
    _, pixels, grids, shas = tower_inputs(emb, images)  # the packages made once here
    with torch.inference_mode():
        tower, _ = timed(partial(emb.vision._run_tower, pixels, grids, shas), 3, device)
    contents = [Content(texts=[text], images=[im]) for im in images]
    lm, vectors = timed(partial(emb.embed_contents, contents, [None] * len(contents)), 3, device)
    return tower, lm, torch.as_tensor(vectors)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint", help="default: a random one (2B in bf16 on a GPU, tiny in float32 here)")
    ap.add_argument("--images", type=int, default=64)
    ap.add_argument("--side", type=int, default=448)
    ap.add_argument("--fused", action="store_true", help="RUBRICSEARCH_FUSED_KERNELS on (every arm)")
    ap.add_argument("--no-compile", action="store_true", help="leave out the torch.compile'd quantiser's arm")
    args = ap.parse_args()
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = "bfloat16" if device == "cuda" else "float32"
    ckpt = args.checkpoint or str(make_test_model(Path(tempfile.mkdtemp()) / "ckpt", "embedding",
                                                  size="2b" if device == "cuda" else "tiny", dtype=dtype))
    images = [decode_image(photo(7000 + i, args.side, args.side)) for i in range(args.images)]
    results = {}
    # the quantiser as separate kernels, and as one kernel that torch.compile fuses (amax, scale, cast)
    quantisers: dict[str, Quantiser] = {"fp8": eager_rows}
    if device == "cuda" and not args.no_compile:
        quantisers["fp8 compiled"] = torch.compile(eager_rows, dynamic=True)
    for arm in ("base", *quantisers):
        loaded = load_qwen(ckpt, device=device, dtype=dtype, fused_kernels=args.fused)
        if arm != "base":
            print(f"{arm}: float8 linear layers: {to_fp8(loaded, quantisers[arm])}")
        store = PackageStore(storage_dtype=dtype)  # one per arm: the fp8 arm makes its own packages
        emb = LocalEmbedder(loaded, packages=VisualPackages(store))
        results[arm] = passes(emb, images, "short fur, triangular ears, dark forehead stripes", device)
        del emb, loaded
        if device == "cuda":
            torch.cuda.empty_cache()
    tb, lb, vb = results.pop("base")
    print(f"{device}, {args.images} images of {args.side} px, fused kernels {args.fused}")
    for arm, (tf, lf, vf) in results.items():
        cos = torch.nn.functional.cosine_similarity(vb.float(), vf.float(), dim=-1)
        print(f"[{arm}]")
        print(f"  tower pass  {dtype} {tb:8.1f} ms   float8 {tf:8.1f} ms   {tb / tf:.2f}x")
        print(f"  LM pass     {dtype} {lb:8.1f} ms   float8 {lf:8.1f} ms   {lb / lf:.2f}x")
        print(f"  embedding cosine float8 vs {dtype}: min {float(cos.min()):.5f}, mean {float(cos.mean()):.5f}")


if __name__ == "__main__":
    main()
