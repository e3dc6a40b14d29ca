"""The tower's rotary kernel (``retrieval/qwen/rope_kernel.py``) under Triton's CPU interpreter: the same values as
transformers' ``apply_rotary_pos_emb_vision`` on a fused qkv product's strided views; ``tests/test_gpu.py`` checks
it to the bit on a GPU, through the function a model loaded with the fused kernels runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROPE_CHECK = """
import torch
from transformers.models.qwen3_vl import modeling_qwen3_vl as modeling
from retrieval.qwen import rope_kernel

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


def test_rope_kernel_under_the_triton_interpreter() -> None:
    """The kernel's arithmetic is the reference's (float32 exact), its output a new contiguous tensor, its trial run
    passes, CPU tensors keep the fallback, and a kernel that cannot launch is remembered as not working."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    root = Path(__file__).resolve().parents[1]
    done = subprocess.run([sys.executable, "-c", ROPE_CHECK], env=env, capture_output=True, text=True, timeout=300,
                          cwd=root)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
