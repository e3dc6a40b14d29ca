"""cuDNN's fused attention for batches of equal-length sequences, where it beats FlashAttention 2 on a Hopper GPU.

Measured on an H200 (``bench/kernel_probe.py``): 16 images of 6,912 patches (the tower on 12-MP photos) 6.8 vs
10.0 ms. cuDNN builds an execution plan per new shape (its variable-length form took 40 ms a call on
shortlist-sized inputs, first call 0.5 s), so only long sequences of one length come here — the tower's runs of
photos of one size, whose shapes repeat — and everything else keeps FlashAttention's variable-length kernel. (The
LM's causal passes over equal 12-MP sequences were 0.43 vs 0.76 ms a layer too, but taking them here changed
nothing measurable in ingestion, `gpu_run.sh final33`: they stay on FlashAttention.) The op is called directly:
SDPA's backend switches are process-wide and other threads run attention meanwhile. Nothing here runs during a
CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_FLASH_ONLY = threading.local()
CUDNN: dict[str, int] = {"calls": 0}  # calls made; "refused:<kind>" once cuDNN refuses a kind; "off" (bench A/B)


def usable(causal: bool, grouped: bool) -> bool:
    """Whether cuDNN may take a call of this kind now (not refused before, no graph capture under way)."""
    return (f"refused:{causal}:{grouped}" not in CUDNN and not CUDNN.get("off")
            and not getattr(_FLASH_ONLY, "on", False)
            and not (torch.cuda.is_initialized() and torch.cuda.is_current_stream_capturing()))


@contextlib.contextmanager
def flash_only() -> Iterator[None]:
    """No cuDNN on this thread inside the block: a CUDA graph's warm-up pass, whose capture right after runs
    FlashAttention (a capture cannot build plans), would otherwise build a plan it never uses."""
    before = getattr(_FLASH_ONLY, "on", False)
    _FLASH_ONLY.on = True
    try:
        yield
    finally:
        _FLASH_ONLY.on = before


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int, scale: float | None, *,
                    causal: bool = False) -> torch.Tensor | None:
    """Attention of equal-length sequences packed as ``q [count * length, heads, dim]`` and ``k, v [count * length,
    kv_heads, dim]``, each sequence over itself (``causal``: a token sees those before it): ``[count * length, heads,
    dim]``, or None where cuDNN refuses (remembered per kind of call: FlashAttention takes those from then on)."""
    heads, kv_heads, dim = q.shape[1], k.shape[1], q.shape[2]
    kind = f"refused:{causal}:{heads != kv_heads}"
    view = [t.view(-1, length, t.shape[1], dim).transpose(1, 2) for t in (q, k, v)]  # [count, heads, length, dim]
    try:
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *view, None, False, 0.0, causal, False, scale=scale)[0]
    except torch.OutOfMemoryError:
        raise  # a full device, not a refusal: the pass fails as any other would
    except RuntimeError:
        CUDNN[kind] = 1
        return None
    CUDNN["calls"] += 1  # a statistic: concurrent threads may lose a count
    return out.transpose(1, 2).reshape(-1, heads, dim)
