"""The GPU's Triton kernels under Triton's CPU interpreter, each in a subprocess with ``TRITON_INTERPRET=1``: the
reranker's attention merge (``merge_kernel.py`` in retrieval/plugins/accelerated/kernels/) and the
tower's rotary (``rope_kernel.py`` there).
``tests/test_gpu.py`` checks both on a GPU: the merge against the torch ops, the rotary to the bit through the
function a model loaded with the fused kernels runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

MERGE_CHECK = """
import torch
from rubricsearch.retrieval.plugins.accelerated.kernels import merge_kernel
gen = torch.Generator().manual_seed(5)
T, H, D = 45, 12, 64  # heads not a power of two, tokens not a multiple of the block
for dtype, ulps in ((torch.bfloat16, 2.0), (torch.float32, 0.0)):
    a, b = (torch.randn(T, H, D, generator=gen).to(dtype) for _ in range(2))
    la = (torch.randn(H, T + 7, generator=gen) * 3)[:, :T]  # FlashAttention's padded rows, sliced
    lb = torch.randn(H, T, generator=gen) * 3
    la[2, 9] = float("inf")  # a pad row's empty key set: weight 1 on a
    got = merge_kernel.merge(a, la, b, lb).float()
    want = b.float() + torch.sigmoid(la - lb).T[..., None] * (a.float() - b.float())
    eps = torch.finfo(dtype).eps * want.abs().clamp_min(1.0)
    assert torch.isfinite(got).all() and torch.allclose(got[9, 2], a[9, 2].float(), atol=1e-6, rtol=2 ** -7)
    assert ((got - want).abs() <= ulps * eps + 1e-6).all(), (dtype, (got - want).abs().max())
cpu = torch.device("cpu")
assert merge_kernel._works(cpu, torch.bfloat16)  # the trial run passes


def broken(*args):
    raise RuntimeError("Failed to find C compiler")


merge_kernel.merge = broken  # a host that cannot build Triton's launcher: the torch ops stay
assert not merge_kernel._works(cpu, torch.float16) and merge_kernel._WORKS[(cpu, torch.float16)] is False
print("ok")
"""


ROPE_CHECK = """
import torch
from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling
from rubricsearch.retrieval.plugins.accelerated.kernels import rope_kernel

gen = torch.Generator().manual_seed(5)
T, H = 45, 12  # heads not a power of two, tokens not a multiple of the block
for dtype, ulps, D in ((torch.float32, 0, 64), (torch.bfloat16, 1, 64), (torch.float32, 0, 72)):  # 72: the 8B tower
    qkv = torch.randn(T, 3, H, D, generator=gen).to(dtype) * 4
    wide = torch.randn(T, 2 * D, generator=gen) * 30
    q, k, cos, sin = qkv[:, 0], qkv[:, 1], wide.cos()[:, :D], wide.sin()[:, :D]  # angles with a token stride
    want = modeling.apply_rotary_pos_emb_vision(q, k, cos, sin)
    assert all(torch.equal(a, b) for a, b in zip(rope_kernel.reference(q, k, cos, sin), want))
    for x, w in zip((q, k), want):
        got = rope_kernel.rotate(x, cos, sin)
        assert got.shape == x.shape and got.dtype == dtype and got.is_contiguous()
        # float32 exact; bf16 within one unit in the last place: the interpreter truncates where the GPU rounds
        step = torch.finfo(dtype).eps * w.float().abs()
        assert ((got.float() - w.float()).abs() <= ulps * step).all(), (dtype, (got.float() - w.float()).abs().max())
assert not torch.equal(rope_kernel.rotate(q, cos, sin), q)  # it does rotate
cpu = torch.device("cpu")
assert rope_kernel._works(cpu, torch.bfloat16)  # the trial run passes
assert not rope_kernel.usable(q, k, cos, sin)  # CPU tensors keep the fallback


def fallback(q, k, cos, sin):
    return "fallback"


assert rope_kernel.rotary_vision(q, k, cos, sin, fallback=fallback) == "fallback"
rope_kernel.rotate = lambda *args: (_ for _ in ()).throw(RuntimeError("Failed to find C compiler"))
assert not rope_kernel._works(cpu, torch.float16) and rope_kernel._WORKS[(cpu, torch.float16)] is False
print("ok")
"""


def _interpreted(code: str) -> None:
    """Run ``code`` (which prints "ok" at its end) with Triton's interpreter in a fresh process: the flag is read at
    import."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300, cwd=root)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def test_merge_kernel_under_the_triton_interpreter() -> None:
    """The GPU's merge kernel (``retrieval/plugins/accelerated/kernels/merge_kernel.py``), by Triton's CPU
    interpreter: the merge
    within bf16 rounding (2 ulps: the interpreter truncates where the GPU rounds) and float32 exact, a strided
    log-sum-exp and an empty key set included; its trial run passes, and a kernel that cannot launch is remembered as
    not working. ``tests/test_gpu.py`` checks it on a GPU against the torch ops."""
    _interpreted(MERGE_CHECK)


def test_rope_kernel_under_the_triton_interpreter() -> None:
    """The kernel's arithmetic is the reference's (float32 exact, at 64 and 72 values per head), its output a new
    contiguous tensor, its trial run passes, CPU tensors keep the fallback, and a kernel that cannot launch is
    remembered as not working."""
    _interpreted(ROPE_CHECK)
