"""Whether one of our Triton kernels runs right on a device and dtype, tried once each.

Triton compiles its launcher with the host's C compiler, which a slim image may lack, and a GPU or Triton
version may compile a kernel differently: each kernel (``merge_kernel``, ``rope_kernel``) is tried on a small
input against its reference before first use, and a failure keeps the caller's fallback there. The trial never
runs inside a CUDA-graph capture (the fallback serves until an eager call has tried it)."""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch

log = logging.getLogger(__name__)
Key = tuple[torch.device, torch.dtype]


def tried(results: dict[Key, bool], device: torch.device, dtype: torch.dtype,
          trial: Callable[[torch.device, torch.dtype], bool], what: str, fallback: str) -> bool:
    """``results[(device, dtype)]``, filled by ``trial`` on first use; an exception in it counts as a failure,
    logged with ``what`` failed and the ``fallback`` used instead."""
    key = (device, dtype)
    if key not in results:
        if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            return False
        try:
            ok = trial(device, dtype)
        except Exception as exc:  # a missing C compiler, an unsupported GPU: keep the fallback
            log.warning("%s does not run on %s (%s): using %s", what, device, exc, fallback)
            ok = False
        results[key] = ok
    return results[key]
