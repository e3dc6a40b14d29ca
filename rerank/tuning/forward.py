"""The reranker's forward with gradients: the very passes :meth:`rerank.local.LocalScoringRuntime.score` runs.

Token ids and shared-prefix groups come from :meth:`LocalScoringRuntime.plan`, the groups run through
:func:`rerank.prefix.shared_prefix_states` with the runtime's own passes (packed on a GPU, as its shortlists run)
and the other rows through the plain forward, so a model trained here learns exactly what a shortlist asks it.
Every reranker trainer runs it: the set fine-tune and the demo reranker's (app/demo/train_reranker.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.prefix import shared_prefix_states
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.task import RERANK_MAX_LENGTH
from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import pooled_states
from rubricsearch.retrieval.runtime.core import Truncation


def run_states(runtime: LocalScoringRuntime, pairs: Sequence[Pair], packages: dict[str, VisualPackage], *,
               max_batch: int | None = None, max_bytes: int | None = None) -> tuple[torch.Tensor, list[int]]:
    """float32 last-token states of the pairs in the order the passes ran them (the shared-prefix groups' rows,
    then the plain rows), with gradients where autograd is on, and the pair of each row. ``packages`` by image
    sha256 (the tower does not run). Rows per pass: ``max_batch`` and ``max_bytes``, by default the runtime's."""
    batch = max_batch or runtime.batch_size
    inputs, regular, groups, group_rows = runtime.plan(pairs, packages, Truncation(RERANK_MAX_LENGTH))
    parts: list[torch.Tensor] = []
    order: list[int] = []
    if groups:
        parts += shared_prefix_states(runtime.row_passes(), groups, max_batch=batch,
                                      max_bytes=max_bytes or runtime.prefix_batch_bytes)
        order += [r for rows in group_rows for r in rows]
    for start in range(0, len(regular), batch):
        chunk = regular[start:start + batch]
        parts.append(pooled_states(runtime.loaded, [inputs[r] for r in chunk], runtime.pad_id))
        order += chunk
    return torch.cat([p.to(torch.float32) for p in parts]), order


def last_token_states(runtime: LocalScoringRuntime, pairs: Sequence[Pair], packages: dict[str, VisualPackage], *,
                      max_batch: int | None = None, max_bytes: int | None = None) -> torch.Tensor:
    """float32 ``[len(pairs), H]`` last-token states of the pairs, in their order: :func:`run_states`' rows put back
    in place (a gather, exact)."""
    hidden, order = run_states(runtime, pairs, packages, max_batch=max_batch, max_bytes=max_bytes)
    at = torch.empty(len(order), dtype=torch.long)
    at[torch.tensor(order)] = torch.arange(len(order))
    return hidden[at.to(hidden.device)]
