"""One Triton kernel for the reranker's attention merge (:func:`retrieval.plugins.accelerated.packed.merge_attention`).

Each continuation token's attention over its own row and over its group's prefix are merged by their
log-sum-exp: ``out = b + sigmoid(lse_a - lse_b) * (a - b)``. As torch ops that is a subtraction, a sigmoid, a
transposed cast and a broadcast ``lerp``, the last one a non-vectorised element-wise kernel run at every layer of
a rerank. Here one kernel reads both outputs and both
log-sum-exps once and writes the result; the weight stays float32 (torch rounds it to bf16 first), so results
move at bf16 rounding level. Imported only for CUDA tensors (``packed.merge_attention``: Triton comes with torch's
CUDA wheels). Triton compiles its launcher with the host's C compiler, which a slim image may lack, so the kernel
is tried once per device and dtype against the torch ops, outside any graph capture, and a failure keeps the
torch ops there.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from rubricsearch.retrieval.plugins.accelerated.kernels.kernel_trial import tried

_WORKS: dict[tuple[torch.device, torch.dtype], bool] = {}


def usable(a: torch.Tensor, la: torch.Tensor, b: torch.Tensor, lb: torch.Tensor) -> bool:
    """The kernel's layout (CUDA, equal contiguous ``[T, heads, D]`` outputs, ``D`` a power of two, float32
    ``[heads, >= T]`` log-sum-exps), and the kernel proven to work on this device and dtype."""
    if a.dim() != 3:
        return False
    tokens, heads, d = a.shape
    return (a.is_cuda and a.shape == b.shape and a.dtype == b.dtype
            and a.is_contiguous() and b.is_contiguous() and d >= 16 and d & (d - 1) == 0
            and all(x.dtype == torch.float32 and x.dim() == 2 and x.shape[0] == heads and x.shape[1] >= tokens
                    for x in (la, lb))
            and _works(a.device, a.dtype))


def merge(a: torch.Tensor, la: torch.Tensor, b: torch.Tensor, lb: torch.Tensor) -> torch.Tensor:
    """``b + sigmoid(la - lb)[..., None] * (a - b)`` for ``a, b [T, heads, D]`` and ``la, lb [heads, T]`` (any
    row stride: FlashAttention's log-sum-exp sliced to its tokens)."""
    tokens, heads, dim = a.shape
    la, lb = (x if x.stride(1) == 1 else x.contiguous() for x in (la, lb))
    out = torch.empty_like(a)
    hp = triton.next_power_of_2(heads)
    per = max(1, 4096 // (hp * dim))  # tokens per program: ~4k elements
    # Triton launches on the current device, which need not be the tensors' (the CPU: Triton's interpreter, tests)
    with torch.cuda.device(a.device) if a.is_cuda else contextlib.nullcontext():
        _merge[(triton.cdiv(tokens, per),)](a, b, la, lb, out, tokens, a.stride(0), a.stride(1), la.stride(0),
                                            lb.stride(0), HEADS=heads, HP=hp, D=dim, TOK=per)
    return out


def _works(device: torch.device, dtype: torch.dtype) -> bool:
    return tried(_WORKS, device, dtype, _trial, "the Triton attention merge", "torch ops")


def _trial(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    a, b = (torch.randn(5, 3, 16, generator=gen).to(device, dtype) for _ in range(2))
    la, lb = (torch.randn(3, 5, generator=gen).to(device) for _ in range(2))
    want = b.float() + torch.sigmoid(la - lb).T[..., None] * (a.float() - b.float())
    return bool(torch.allclose(merge(a, la, b, lb).float(), want, atol=1e-2, rtol=1e-2))


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
    # lerp's two-sided form, as torch's: exact at either end, no cancellation near w = 1
    merged = tl.where(w < 0.5, y + w * (x - y), x - (1.0 - w) * (x - y))
    tl.store(out + at, merged.to(out.dtype.element_ty), mask=mask)
