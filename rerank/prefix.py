"""The reranker's shared-prefix forward: a shortlist's common prompt runs once, its documents many times.

Every pair of a shortlist shares the system prompt, the instruction and the query (with the candidate
image) up to ``<Document>:``; only the documents differ. The prefix's KV cache is computed once and
reused for every document row.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from retrieval.qwen.forward import LMInput, mm_kwargs, mrope_positions
from retrieval.qwen.loading import LoadedQwen


@torch.inference_mode()
def run_shared_prefix(
    loaded: LoadedQwen,
    prefix: LMInput,
    continuations: Sequence[LMInput],
    pad_id: int,
    *,
    max_batch: int,
) -> torch.Tensor:
    """Last-token states of ``prefix + c`` for every continuation, running the prefix only once.

    The prefix's KV cache (its images' deepstack features already applied) is repeated across a batch of
    continuations; M-RoPE positions are those of the full sequences, sliced after the prefix. Used by the
    reranker, whose system prompt, instruction and query (with the candidate image) are shared by every
    document of a shortlist.
    """
    import copy

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
    prefix_cache = out.past_key_values
    result = torch.empty((len(continuations), loaded.hidden_size), dtype=torch.float32, device=device)
    order = sorted(range(len(continuations)), key=lambda i: len(continuations[i].ids))
    for start in range(0, len(order), max_batch):
        rows = order[start:start + max_batch]
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
        cont_ids = full[:, n_prefix:]
        cont_type = full_type[:, n_prefix:]
        cache = copy.deepcopy(prefix_cache)
        cache.batch_repeat_interleave(len(batch))
        packages = [p for c in batch for p in c.packages]
        hidden = model(
            input_ids=cont_ids.to(device),
            attention_mask=mask.to(device),
            position_ids=pos[:, :, n_prefix:].to(device),
            past_key_values=cache,
            use_cache=True,
            **mm_kwargs(loaded, packages, cont_type),
        ).last_hidden_state
        last = torch.tensor([len(c.ids) - 1 for c in batch], device=hidden.device)
        states = hidden[torch.arange(len(batch), device=hidden.device), last].to(torch.float32)
        result[torch.tensor(rows, device=device)] = states
    return result
