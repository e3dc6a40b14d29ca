"""The vision tower's rotary embedding as one Triton kernel per tensor, bit-identical to transformers' function.

transformers' ``apply_rotary_pos_emb_vision`` (and Liger's) casts the query and key to float32, rotates them and
casts them back: hundreds of copies a tower pass, a sizeable share of its time. Here one kernel reads a query (or
key) in its own dtype straight from the strided view of the fused qkv product, rotates it in float32 and writes it
back rounded once: 4 bytes per value moved instead of ~20. The arithmetic is the reference's, operation by operation
(``q * cos``, ``rotate_half(q) * sin``, their sum, each rounded to float32, no fused multiply-add), so the result is
the same to the bit (``tests/test_gpu.py``). Imported only for CUDA tensors; tried once per device and dtype outside
any graph capture (:mod:`.kernel_trial`, as :mod:`.merge_kernel` is), and a failure
keeps the ``fallback``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from functools import partial

import torch
import triton
import triton.language as tl

from rubricsearch.retrieval.plugins.accelerated.kernels.kernel_trial import tried

_WORKS: dict[tuple[torch.device, torch.dtype], bool] = {}
Rope = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def reference(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' ``apply_rotary_pos_emb_vision`` (Qwen3-VL), restated for the kernel's trial and tests."""
    def rotate_half(x: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        return torch.cat((-x[..., half:], x[..., :half]), dim=-1)

    c, s = cos.unsqueeze(-2).float(), sin.unsqueeze(-2).float()
    return tuple((x.float() * c + rotate_half(x.float()) * s).to(x.dtype)  # type: ignore[return-value]
                 for x in (q, k))


def rotary_vision(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, *,
                  fallback: Rope) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary_pos_emb_vision``: ``q, k [tokens, heads, D]`` (any token and head strides), ``cos, sin
    [tokens, D]``; through the kernel where it applies and works, else ``fallback``."""
    if usable(q, k, cos, sin):
        return rotate(q, cos, sin), rotate(k, cos, sin)
    return fallback(q, k, cos, sin)


def usable(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> bool:
    """The kernel's layout (CUDA; ``[T, heads, D]`` with the last dimension contiguous and ``D`` even, 64 for the 2B
    tower and 72 for the 8B's; ``[T, D]`` angles), no gradient wanted (its output is a new tensor outside autograd;
    Liger's keeps one), and the kernel proven to work on this device and dtype."""
    if q.dim() != 3 or k.shape != q.shape or cos.dim() != 2:
        return False
    tokens, _, dim = q.shape
    return (q.is_cuda and k.device == q.device and k.dtype == q.dtype
            and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad))
            and q.dtype in (torch.bfloat16, torch.float16, torch.float32) and dim >= 2 and dim % 2 == 0
            and q.stride(-1) == 1 and k.stride(-1) == 1
            and all(x.shape == (tokens, dim) and x.stride(-1) == 1 and x.device == q.device for x in (cos, sin))
            and _works(q.device, q.dtype))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """One tensor rotated: a new contiguous ``[T, heads, D]`` of ``x``'s dtype."""
    tokens, heads, dim = x.shape
    out = torch.empty((tokens, heads, dim), dtype=x.dtype, device=x.device)
    hp, dp = triton.next_power_of_2(heads), triton.next_power_of_2(dim)
    per = max(1, 4096 // (hp * dp))  # tokens per program: ~4k values
    # Triton launches on the current device, which need not be the tensors' (the CPU: Triton's interpreter, tests)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        # no fused multiply-add: the reference rounds each product before the sum
        _rope[(triton.cdiv(tokens, per),)](x, cos, sin, out, tokens, x.stride(0), x.stride(1), cos.stride(0),
                                           sin.stride(0), HEADS=heads, HP=hp, D=dim, DP=dp, TOK=per,
                                           enable_fp_fusion=False)
    return out


def _works(device: torch.device, dtype: torch.dtype) -> bool:
    return tried(_WORKS, device, dtype, _trial, "the Triton vision rotary", "the fallback")


def _trial(device: torch.device, dtype: torch.dtype) -> bool:
    gen = torch.Generator(device="cpu").manual_seed(0)
    qkv = torch.randn(7, 3, 3, 16, generator=gen).to(device, dtype)  # a fused product's strided views
    angles = torch.randn(7, 16, generator=gen).to(device)
    q, k, cos, sin = qkv[:, 0], qkv[:, 1], angles.cos(), angles.sin()
    want = reference(q, k, cos, sin)
    got = (rotate(q, cos, sin), rotate(k, cos, sin))
    # the same to the bit on a GPU (a Triton that fused the products anyway keeps the fallback); the CPU
    # interpreter (tests) truncates its casts where a GPU rounds
    same = torch.equal if device.type == "cuda" else partial(torch.allclose, atol=1e-2, rtol=1e-2)
    return all(same(g, w) for g, w in zip(got, want, strict=True))


@triton.jit  # Triton reads the parameters' annotations as specialisation hints: pointers and ints stay bare
def _rope(x, cos, sin, out, tokens, s_t, s_h, s_cos, s_sin,  # type: ignore[no-untyped-def]
          HEADS: tl.constexpr, HP: tl.constexpr, D: tl.constexpr, DP: tl.constexpr, TOK: tl.constexpr):
    t = (tl.program_id(0) * TOK + tl.arange(0, TOK)).to(tl.int64)  # offsets past 2**31 at ~700k patches
    h = tl.arange(0, HP)
    d = tl.arange(0, DP)  # D padded to a power of two (72 -> 128), the padding masked
    half: tl.constexpr = D // 2
    partner = (d + half) % D  # rotate_half: the other half's value, negated for the first half
    mask = ((t[:, None] < tokens) & (h[None, :] < HEADS))[:, :, None] & (d < D)[None, None, :]
    row = t[:, None, None] * s_t + h[None, :, None] * s_h
    value = tl.load(x + row + d[None, None, :], mask=mask, other=0.0).to(tl.float32)
    other = tl.load(x + row + partner[None, None, :], mask=mask, other=0.0).to(tl.float32)
    rotated = tl.where(d[None, None, :] < half, -other, other)
    tmask = (t[:, None] < tokens) & (d < D)[None, :]
    c = tl.load(cos + t[:, None] * s_cos + d[None, :], mask=tmask, other=0.0).to(tl.float32)[:, None, :]
    s = tl.load(sin + t[:, None] * s_sin + d[None, :], mask=tmask, other=0.0).to(tl.float32)[:, None, :]
    result = value * c + rotated * s
    at = t[:, None, None] * (HEADS * D) + h[None, :, None] * D + d[None, None, :]
    tl.store(out + at, result.to(out.dtype.element_ty), mask=mask)
