"""cuDNN's fused attention for batches of equal-length sequences, where it beats FlashAttention 2 on a Hopper GPU.

cuDNN builds an execution plan per new shape (its variable-length form pays that on every new shortlist size), so
only long sequences of one length come here — the tower's runs of photos of one size, whose shapes repeat — and
everything else keeps FlashAttention's variable-length kernel. The LM's causal passes stay on FlashAttention: the
tower's photo attention is where the time goes. The op is called directly: SDPA's backend switches are
process-wide and other threads run attention meanwhile. Nothing here runs during a CUDA-graph capture.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch

_FLASH_ONLY = threading.local()
CUDNN = {"calls": 0, "refused": 0}  # calls made (a statistic: concurrent threads may lose a count); refused: 1
# once cuDNN refused a call (no cuDNN attention on this GPU or build): FlashAttention from then on


def usable() -> bool:
    """Whether cuDNN may take a call now (not refused before, no graph capture under way)."""
    return (not CUDNN["refused"] and not getattr(_FLASH_ONLY, "on", False)
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


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, length: int,
                    scale: float | None) -> torch.Tensor | None:
    """Non-causal attention of equal-length sequences packed as ``[count * length, heads, dim]``, each sequence over
    itself: ``[count * length, heads, dim]``, or None where cuDNN refuses (remembered: see :data:`CUDNN`)."""
    heads, dim = q.shape[1], q.shape[2]
    view = [t.view(-1, length, heads, dim).transpose(1, 2) for t in (q, k, v)]  # [count, heads, length, dim]
    try:
        out: torch.Tensor = torch.ops.aten._scaled_dot_product_cudnn_attention(
            *view, None, False, 0.0, False, False, scale=scale)[0]
    except torch.OutOfMemoryError:
        raise  # a full device, not a refusal: the pass fails as any other would
    except RuntimeError:
        CUDNN["refused"] = 1
        return None
    CUDNN["calls"] += 1
    return out.transpose(1, 2).reshape(-1, heads, dim)
