"""The reranker's shared-prefix forward: a shortlist's common prompt runs once, its documents many times.

Every pair of a shortlist shares the system prompt, the instruction and the query (with the candidate
image) up to ``<Document>:``; only the documents differ. The prefix's keys and values are computed once
and shared by every document row without a copy per row: each layer expands them (a view) and joins
them to the rows' own keys and values for that layer's attention only (:class:`SharedPrefixLayer`). A
photo-sized candidate's prefix is ~1,850 tokens, about 0.2 GB of keys and values per row on the 2B
models, so deep copies for a batch of 64 documents would cost 13 GB; here the extra memory of a batch is
bounded by ``max_bytes`` (rows per batch follow from it).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
from transformers.cache_utils import Cache, DynamicLayer

from retrieval.qwen.forward import LMInput, mm_kwargs, mrope_positions
from retrieval.qwen.loading import LoadedQwen

PREFIX_BATCH_BYTES = 1 << 30  # extra memory one batch of document rows may take beyond the weights


class SharedPrefixLayer(DynamicLayer):
    """One layer's prefix keys and values ``[1, kv_heads, P, D]``, shared by every row of a batch.

    ``update`` returns the prefix (expanded: a view, no copy) joined to the rows' new keys and values for
    this layer's attention, and stores nothing, so no per-row copy of the prefix outlives the layer.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.prefix = (keys, values)
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        rows = key_states.shape[0]
        keys, values = self.prefix
        return (torch.cat([keys.expand(rows, -1, -1, -1), key_states], dim=-2),
                torch.cat([values.expand(rows, -1, -1, -1), value_states], dim=-2))


def row_bytes(loaded: LoadedQwen, prefix_tokens: int, tokens: int) -> int:
    """Transient memory of one document row in a shared-prefix forward (bf16 on the GPU): one layer's
    expanded keys and values, its attention scores, and the MLP activations of the row's own tokens."""
    text = loaded.config.text_config
    itemsize = torch.finfo(loaded.dtype).bits // 8
    head_dim = int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)
    kv = 2 * int(text.num_key_value_heads) * (prefix_tokens + tokens) * head_dim * itemsize
    scores = int(text.num_attention_heads) * tokens * (prefix_tokens + tokens) * 4
    mlp = 3 * tokens * int(text.intermediate_size) * itemsize
    return kv + scores + mlp


@torch.inference_mode()
def run_shared_prefix(
    loaded: LoadedQwen,
    prefix: LMInput,
    continuations: Sequence[LMInput],
    pad_id: int,
    *,
    max_batch: int,
    max_bytes: int = PREFIX_BATCH_BYTES,
) -> torch.Tensor:
    """Last-token states of ``prefix + c`` for every continuation, running the prefix only once.

    Rows are batched by length, at most ``max_batch`` and at most ``max_bytes`` of transient memory
    (:func:`row_bytes`) per batch; M-RoPE positions are those of the full sequences, sliced after the
    prefix. Used by the reranker, whose system prompt, instruction and query (with the candidate image) are
    shared by every document of a shortlist.
    """
    model = loaded.model
    device = loaded.device
    n_prefix = len(prefix.ids)
    p_ids = torch.tensor([prefix.ids], dtype=torch.long)
    p_type = (p_ids == loaded.image_token_id).to(torch.int32)
    merge = int(model.config.vision_config.spatial_merge_size)
    p_pos = mrope_positions(p_ids, torch.ones_like(p_ids), [p.grid_thw for p in prefix.packages],
                            loaded.image_token_id, merge)
    out = model(input_ids=p_ids.to(device), attention_mask=torch.ones_like(p_ids).to(device),
                position_ids=p_pos.to(device), use_cache=True, **mm_kwargs(loaded, prefix.packages, p_type))
    shared = Cache(layers=[SharedPrefixLayer(layer.keys, layer.values) for layer in out.past_key_values.layers])
    del out
    result = torch.empty((len(continuations), loaded.hidden_size), dtype=torch.float32, device=device)
    order = sorted(range(len(continuations)), key=lambda i: len(continuations[i].ids))
    for rows in _batches(order, continuations, max_batch,
                         lambda tokens: row_bytes(loaded, n_prefix, tokens), max_bytes):
        batch = [continuations[i] for i in rows]
        width = max(len(c.ids) for c in batch)
        full = torch.full((len(batch), n_prefix + width), pad_id, dtype=torch.long)
        mask = torch.zeros_like(full)
        for r, c in enumerate(batch):
            full[r, : n_prefix + len(c.ids)] = torch.tensor(prefix.ids + c.ids, dtype=torch.long)
            mask[r, : n_prefix + len(c.ids)] = 1
        full_type = (full == loaded.image_token_id).to(torch.int32)
        grids = [p.grid_thw for c in batch for p in (*prefix.packages, *c.packages)]
        pos = mrope_positions(full, mask, grids, loaded.image_token_id, merge)
        packages = [p for c in batch for p in c.packages]
        hidden = model(
            input_ids=full[:, n_prefix:].to(device),
            attention_mask=mask.to(device),
            position_ids=pos[:, :, n_prefix:].to(device),
            past_key_values=shared,
            use_cache=True,
            **mm_kwargs(loaded, packages, full_type[:, n_prefix:]),
        ).last_hidden_state
        last = torch.tensor([len(c.ids) - 1 for c in batch], device=hidden.device)
        states = hidden[torch.arange(len(batch), device=hidden.device), last].to(torch.float32)
        result[torch.tensor(rows, device=device)] = states
    return result


def _batches(order: list[int], continuations: Sequence[LMInput], max_batch: int, cost: Callable[[int], int],
             max_bytes: int) -> list[list[int]]:
    """Consecutive rows (ordered by length) while the batch's padded cost stays within ``max_bytes``."""
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        width = len(continuations[i].ids)  # the longest so far: rows come shortest first
        if current and (len(current) >= max_batch or (len(current) + 1) * cost(width) > max_bytes):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches
