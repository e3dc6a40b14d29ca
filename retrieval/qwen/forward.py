"""The language-model pass over token ids with cached visual packages injected.

Packages reach ``Qwen3VLModel.forward`` through ``mm_encoder_outputs`` (transformers >= 5.19), so the
vision tower never runs here. M-RoPE positions come from ``get_rope_index`` on the ids and the packages'
grids, which needs no pixels. Sequences are right-padded and the hidden state of each sequence's last
real token (post final norm) is returned.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from retrieval.packages import VisualPackage
from retrieval.qwen.loading import LoadedQwen


@dataclass
class LMInput:
    ids: list[int]
    packages: list[VisualPackage]


def plan_batches(inputs: Sequence[LMInput], max_batch: int, max_tokens: int) -> list[list[int]]:
    """Group indices by length (less padding) under a batch-size and padded-token budget."""
    order = sorted(range(len(inputs)), key=lambda i: len(inputs[i].ids))
    batches: list[list[int]] = []
    current: list[int] = []
    longest = 0
    for i in order:
        n = len(inputs[i].ids)
        if current and (len(current) >= max_batch or max(longest, n) * (len(current) + 1) > max_tokens):
            batches.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        batches.append(current)
    return batches


@torch.inference_mode()
def last_hidden_states(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int) -> torch.Tensor:
    """``[B, H]`` hidden state of the last real token of each input (one forward pass)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    model = loaded.model
    device = loaded.device
    width = max(len(x.ids) for x in batch)
    ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(batch), width), dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : len(item.ids)] = torch.tensor(item.ids, dtype=torch.long)
        mask[row, : len(item.ids)] = 1
    image_type = (ids == loaded.image_token_id).to(torch.int32)
    packages = [pkg for item in batch for pkg in item.packages]
    kwargs: dict[str, Any] = {}
    grid = None
    if packages:
        grid = torch.tensor([list(p.grid_thw) for p in packages], dtype=torch.long)
        levels = packages[0].levels
        # Per-image tuples, exactly what get_image_features hands to forward() on the uncached path.
        embeds: Any = tuple(p.embeds.to(device, loaded.dtype, non_blocking=True) for p in packages)
        deepstack: Any = [
            tuple(p.deepstack[level].to(device, loaded.dtype, non_blocking=True) for p in packages)
            for level in range(levels)
        ]
        kwargs["mm_encoder_outputs"] = {
            "image": BaseModelOutputWithDeepstackFeatures(pooler_output=embeds, deepstack_features=deepstack)
        }
        kwargs["image_grid_thw"] = grid.to(device)
        kwargs["mm_token_type_ids"] = image_type.to(device)
    position_ids, _ = model.get_rope_index(
        ids, mm_token_type_ids=image_type, image_grid_thw=grid, attention_mask=mask
    )
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
        **kwargs,
    )
    hidden = out.last_hidden_state
    last = mask.sum(dim=1) - 1
    return hidden[torch.arange(len(batch), device=hidden.device), last.to(hidden.device)]


def run_batched(
    loaded: LoadedQwen,
    inputs: Sequence[LMInput],
    pad_id: int,
    *,
    max_batch: int,
    max_tokens: int,
) -> torch.Tensor:
    """Last-token hidden states for all inputs, float32 ``[N, H]`` on the model device, in input order."""
    out = torch.empty((len(inputs), loaded.hidden_size), dtype=torch.float32, device=loaded.device)
    for batch in plan_batches(inputs, max_batch, max_tokens):
        states = last_hidden_states(loaded, [inputs[i] for i in batch], pad_id)
        out[torch.tensor(batch, device=loaded.device)] = states.to(torch.float32)
    return out
