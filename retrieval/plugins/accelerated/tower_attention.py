"""Attention for the vision tower over a batch of packed images: each image attends only to itself.

transformers' SDPA path for the Qwen3-VL tower loops over images (one call per image). Registered as an
attention implementation whose name contains "flash" (so the tower passes ``cu_seqlens``), this module
runs the whole batch at once instead:

- on CUDA in half precision, one variable-length FlashAttention call over all images
  (``aten._flash_attention_forward`` with the cumulative image lengths), an order of magnitude faster than
  per-size SDPA calls for a mixed-size batch;
- there, runs of equal images of at least :data:`CUDNN_MIN_TOKENS` patches (photos near max_pixels) instead take
  cuDNN's fused attention as one dense batch per run, faster than FlashAttention on long equal sequences, where
  attention is about half the tower's FLOPs (:mod:`.kernels.cudnn_attention` says why smaller images keep
  FlashAttention);
- elsewhere, one SDPA call per run of equal-length images (same-size images side by side).

Both equal the per-image path up to the rounding of batched kernels.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from rubricsearch.retrieval.plugins.accelerated.kernels.cudnn_attention import dense_attention, usable
from rubricsearch.retrieval.qwen.engine.forward import upload

GROUPED_ATTENTION = "rubricsearch_grouped_flash"  # "flash" in the name makes the tower pass cu_seqlens
RUNS = threading.local()  # (start, length, count) runs of equal-length segments, set around a tower pass
CUDNN_MIN_TOKENS = 4096  # runs of images with at least this many patches take cuDNN (module docstring)
SEEN: set[int] = set()  # photo lengths met before (cudnn_blocks); a size first met keeps FlashAttention once
SEEN_MAX = 4096  # lengths remembered; a process that met more keeps new sizes on FlashAttention


def runs_of(lengths: Sequence[int]) -> list[tuple[int, int, int]]:
    """Consecutive equal lengths as (start, length, count)."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for n in lengths:
        if runs and runs[-1][1] == n:
            s, length, count = runs[-1]
            runs[-1] = (s, length, count + 1)
        else:
            runs.append((start, n, 1))
        start += n
    return runs


@torch.compiler.disable
def grouped_attention(module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      attention_mask: Any = None, scaling: float | None = None, dropout: float = 0.0,
                      **kwargs: Any) -> tuple[torch.Tensor, None]:
    """Block-diagonal attention over packed ``[1, heads, tokens, dim]`` inputs (see the module docstring).

    Never traced by ``torch.compile`` (``LocalConfig.compile``): its image lengths are Python ints,
    which
    dynamo would guard on, recompiling the block for every new mix of image sizes in a batch."""
    cu: torch.Tensor | None = kwargs.get("cu_seq_lens_q")
    runs = getattr(RUNS, "runs", None)
    if runs is None:
        assert cu is not None, "grouped attention needs RUNS or the tower's cu_seqlens"
        runs = runs_of((cu[1:] - cu[:-1]).tolist())
    q, k, v = query[0], key[0], value[0]  # [heads, tokens, dim]
    if _flash_ok(q, dropout):
        qt, kt, vt = q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1)  # [tokens, heads, dim]
        blocks = cudnn_blocks(runs, seen=SEEN) if usable() else [(False, runs)]
        out = _varlen(qt, kt, vt, runs, scaling, cu) if len(blocks) == 1 and not blocks[0][0] \
            else _blocks(qt, kt, vt, blocks, scaling)
        if out is not None:
            return out.unsqueeze(0), None
    heads, dim = q.shape[0], q.shape[-1]
    outs = []
    for start, length, count in runs:
        end = start + length * count

        def view(t: torch.Tensor, start: int = start, end: int = end, count: int = count,
                 length: int = length) -> torch.Tensor:
            return t[:, start:end].unflatten(1, (count, length)).transpose(0, 1)  # [count, heads, length, dim]

        o = _sdpa(view(q), view(k), view(v), dropout, scaling)
        outs.append(o.transpose(1, 2).reshape(count * length, heads, dim))
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).unsqueeze(0), None


def cudnn_blocks(runs: Sequence[tuple[int, int, int]], min_tokens: int | None = None, seen: set[int] | None = None
                 ) -> list[tuple[bool, list[tuple[int, int, int]]]]:
    """The runs in order as blocks: each run of at least ``min_tokens`` (default :data:`CUDNN_MIN_TOKENS`) patches
    per image for cuDNN (``True``), cut into power-of-two image counts (13 images: 8, 4, 1) so that photos of one
    size need at most a handful of cuDNN execution plans whatever mix a batch holds; consecutive shorter runs
    together, for one FlashAttention call. With ``seen``, a length met for the first time is added to it and
    stays with FlashAttention this once: a plan is slow to build (docs/performance.md, "Measurements
    behind the code") and pays for itself only on a size that comes back, and a
    set of photos all of different sizes would otherwise build one per image."""
    limit = CUDNN_MIN_TOKENS if min_tokens is None else min_tokens
    blocks: list[tuple[bool, list[tuple[int, int, int]]]] = []
    for start, length, count in runs:
        new = seen is not None and length >= limit and length not in seen
        if new and seen is not None and len(seen) < SEEN_MAX:  # (seen is set when new: for mypy)
            seen.add(length)
        if length >= limit and not new:
            while count:
                part = 1 << (count.bit_length() - 1)
                blocks.append((True, [(start, length, part)]))
                start, count = start + part * length, count - part
        elif blocks and not blocks[-1][0]:
            blocks[-1][1].append((start, length, count))
        else:
            blocks.append((False, [(start, length, count)]))
    return blocks


def _blocks(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
            blocks: list[tuple[bool, list[tuple[int, int, int]]]], scale: float | None) -> torch.Tensor | None:
    """:func:`cudnn_blocks`' blocks over ``[tokens, heads, dim]``: cuDNN per long run, FlashAttention per block of
    shorter ones (``_varlen`` reads only the runs' lengths); outputs in token order."""
    outs = []
    for dense, runs in blocks:
        start, end = runs[0][0], runs[-1][0] + runs[-1][1] * runs[-1][2]
        qb, kb, vb = q[start:end], k[start:end], v[start:end]
        out = dense_attention(qb, kb, vb, runs[0][1], scale) if dense and usable() else None
        if out is None:
            out = _varlen(qb, kb, vb, runs, scale)
        if out is None:
            return None
        outs.append(out)
    return outs[0] if len(outs) == 1 else torch.cat(outs)


def _flash_ok(q: torch.Tensor, dropout: float) -> bool:
    return q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256 and dropout == 0.0


def _varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[tuple[int, int, int]],
            scale: float | None, cu: torch.Tensor | None = None) -> torch.Tensor | None:
    """One FlashAttention call over ``[tokens, heads, dim]`` with every image as its own sequence.

    ``cu``: the tower's cumulative lengths (equal to the runs'), used where already on the device as int32: then
    nothing is copied from the host, which a CUDA-graph capture forbids (``graphed_tower``). The longest image
    comes from the host-side runs, so nothing waits for the GPU either."""
    lengths = [length for _, length, count in runs for _ in range(count)]
    if not (isinstance(cu, torch.Tensor) and cu.device == q.device and cu.dtype == torch.int32
            and cu.shape[0] == len(lengths) + 1):
        host = torch.zeros(len(lengths) + 1, dtype=torch.int32)
        host[1:] = torch.tensor(lengths, dtype=torch.int32).cumsum(0)
        cu = upload(host, q.device)  # pinned: a pageable copy would wait for the stream, once per layer
    longest = max(lengths)
    try:
        out: torch.Tensor = torch.ops.aten._flash_attention_forward(
            q, k, v, cu, cu, longest, longest, 0.0, False, False, scale=scale)[0]
    except RuntimeError:  # e.g. a GPU without FlashAttention: per-run SDPA instead
        return None
    return out


def _sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout: float, scale: float | None) -> torch.Tensor:
    """Non-causal attention without a mask. On CUDA in half precision this is PyTorch's FlashAttention
    kernel: SDPA's default there (cuDNN on Hopper) builds a new execution plan for every new
    (images, tokens) shape, which costs more CPU time than the attention itself when sizes vary."""
    if _flash_ok(q, dropout):
        try:
            out: torch.Tensor = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, scale=scale)[0]
            return out
        except RuntimeError:  # e.g. a GPU without FlashAttention support
            pass
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scale)


def register() -> bool:
    """Make :func:`grouped_attention` available to transformers under :data:`GROUPED_ATTENTION`."""
    try:
        from transformers import AttentionInterface

        AttentionInterface.register(GROUPED_ATTENTION, grouped_attention)
    except Exception:  # an older transformers: keep its per-image attention
        return False
    return True
