"""How many cores one torch op may use in the server process.

torch splits every CPU op across all cores. That pays for a wide model, whose ops are large, and costs for a
narrow one: a 128-wide model's ops are too small to split, and a loaded server already keeps the cores busy
with concurrent passes (one LM worker per core, ``retrieval.qwen.engine.batching``) while the split ops' threads wait
on each other; from a width of about 512 on, an op is large enough that splitting it wins again
(``bench/load_search.py`` measures both). So each op gets one thread on a CPU when the embedder is narrower than
``NARROW``, and torch's default otherwise (and on any accelerator, where host threads only launch kernels).
"""

from __future__ import annotations

import logging

import torch

from rubricsearch.retrieval.qwen.model.loading import resolve_device

log = logging.getLogger("rubricsearch.app")

NARROW = 512  # widths below this ran faster with one thread per op (see above)


def op_threads(*, device: str, width: int | None) -> int | None:
    """The threads per op to set (None: keep torch's default)."""
    if resolve_device(device).type == "cpu" and width is not None and width < NARROW:
        return 1
    return None


def apply_op_threads(*, device: str, width: int | None) -> None:
    threads = op_threads(device=device, width=width)
    if threads is not None and threads != torch.get_num_threads():
        torch.set_num_threads(threads)
        log.info("torch ops use %d CPU thread(s) each (narrow embedder on a CPU)", threads)
