"""One Triton kernel for the reranker's attention merge (:func:`retrieval.qwen.packed.merge_attention`).

Each continuation token's attention over its own row and over its group's prefix are merged by their
log-sum-exp: ``out = b + sigmoid(lse_a - lse_b) * (a - b)``. As torch ops that is a subtraction, a sigmoid, a
transposed cast and a broadcast ``lerp``, the last one a non-vectorised element-wise kernel (2.2 of a 50-document
rerank's 66 ms of kernels on an H200, ``bench/kernel_probe.py``). Here one kernel reads both outputs and both
log-sum-exps once and writes the result; the weight stays float32 (torch rounds it to bf16 first), so results
move at bf16 rounding level. Imported only for CUDA tensors (``packed.merge_attention``: Triton comes with torch's
CUDA wheels); ``bench/reverts.py``'s ``merge`` switches it off.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

ENABLED = True


def usable(a: torch.Tensor, b: torch.Tensor) -> bool:
    """The kernel's layout: CUDA, equal contiguous ``[T, heads, D]`` outputs, ``D`` a power of two."""
    d = a.shape[-1]
    return (ENABLED and a.is_cuda and a.dim() == 3 and a.shape == b.shape and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous() and d >= 16 and d & (d - 1) == 0)


def merge(a: torch.Tensor, la: torch.Tensor, b: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """``b + sigmoid(la - lb)[..., None] * (a - b)`` for ``a, b [T, heads, D]`` and ``la, lb [heads, T]`` (any
    row stride: FlashAttention's log-sum-exp sliced to its tokens)."""
    tokens, heads, dim = a.shape
    la, lb = (x if x.stride(1) == 1 else x.contiguous() for x in (la, lb))
    out = torch.empty_like(a)
    hp = triton.next_power_of_2(heads)
    per = max(1, 4096 // (hp * dim))  # tokens per program: ~4k elements
    _merge[(triton.cdiv(tokens, per),)](a, b, la, lb, out, tokens, a.stride(0), a.stride(1), la.stride(0),
                                        lb.stride(0), HEADS=heads, HP=hp, D=dim, TOK=per)
    return out


@triton.jit  # Triton reads the parameters' annotations as specialisation hints: pointers and ints stay bare
def _merge(a, b, la, lb, out, tokens, s_t, s_h, s_la, s_lb,  # type: ignore[no-untyped-def]
           HEADS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, TOK: tl.constexpr):
    t = tl.program_id(0) * TOK + tl.arange(0, TOK)
    h = tl.arange(0, HP)
    d = tl.arange(0, D)
    th = (t[:, None] < tokens) & (h[None, :] < HEADS)
    wa = tl.load(la + h[None, :] * s_la + t[:, None], mask=th, other=0.0)
    wb = tl.load(lb + h[None, :] * s_lb + t[:, None], mask=th, other=0.0)
    w = tl.sigmoid(wa - wb)[:, :, None]
    at = t[:, None, None] * s_t + h[None, :, None] * s_h + d[None, None, :]
    mask = th[:, :, None]
    x = tl.load(a + at, mask=mask, other=0.0).to(tl.float32)
    y = tl.load(b + at, mask=mask, other=0.0).to(tl.float32)
    tl.store(out + at, (y + w * (x - y)).to(out.dtype.element_ty), mask=mask)
