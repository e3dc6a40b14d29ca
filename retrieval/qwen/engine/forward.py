"""The language-model pass over token ids with cached visual packages injected.

Packages reach ``Qwen3VLModel.forward`` through ``mm_encoder_outputs`` (transformers >= 5.19), so the
vision tower never runs here. M-RoPE positions come from the ids and the packages'
grids, which needs no pixels. Sequences are right-padded and the hidden state of each sequence's last
real token (post final norm) is returned.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen


@dataclass
class LMInput:
    ids: list[int]
    packages: list[VisualPackage]


def upload(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Host -> device without waiting for the GPU: CUDA copies from pageable memory only after draining the
    stream (the queued work of every thread on it), so the small inputs of a pass go through (cached) pinned
    memory and the host prepares the next pass while the GPU runs this one."""
    if device.type != "cuda" or t.device.type != "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def download(t: torch.Tensor) -> torch.Tensor:
    """Device -> host through (cached) pinned memory, then a wait on an event. ``.cpu()`` copies into pageable
    memory, and the driver blocks that call until the stream gets there; meanwhile other threads' CUDA calls
    queue behind it (the package writers' event records wait while the LM's read-back holds the driver)."""
    if t.device.type != "cuda":
        return t
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(t.device))
    done.synchronize()
    return host


def gathered(parts: Sequence[torch.Tensor], device: torch.device, dtype: torch.dtype, dim: int = 0) -> torch.Tensor:
    """``torch.cat`` of the parts in ``dtype`` on ``device``: one concatenation and one cast when the parts
    share a device and dtype (two kernels for a batch of packages, not one cast per package); the values
    are those of casting each part first."""
    if len({(t.device, t.dtype) for t in parts}) == 1:
        return torch.cat(list(parts), dim=dim).to(device, dtype, non_blocking=True)
    return torch.cat([t.to(device, dtype, non_blocking=True) for t in parts], dim=dim)


def right_pad(seqs: Sequence[Sequence[int]], pad_id: int, *, rows: int | None = None, width: int | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[rows, width]`` token ids right-padded with ``pad_id`` and their 0/1 mask; ``rows`` and ``width``
    default to the number of sequences and the longest one (extra rows are all padding).

    Built in numpy with one scatter: a row at a time took three torch calls per row, and each torch call lets
    go of the GIL and waits to get it back, which under a busy ingestion stalls the LM thread on every row."""
    lengths = np.fromiter(map(len, seqs), dtype=np.int64, count=len(seqs))
    width = int(lengths.max()) if width is None else width
    if len(seqs) and int(lengths.max()) > width:
        raise ValueError(f"a sequence of {int(lengths.max())} tokens does not fit a width of {width}")
    ids = np.full((len(seqs) if rows is None else rows, width), pad_id, dtype=np.int64)
    mask = np.zeros_like(ids)
    valid = np.arange(width) < lengths[:, None]  # row-major order: the sequences one after another
    ids[: len(seqs)][valid] = np.fromiter(itertools.chain.from_iterable(seqs), dtype=np.int64, count=int(lengths.sum()))
    mask[: len(seqs)] = valid
    return torch.from_numpy(ids), torch.from_numpy(mask)


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


def mrope_positions(
    ids: torch.Tensor, mask: torch.Tensor, grids: Sequence[tuple[int, int, int]], image_token_id: int, merge: int
) -> torch.Tensor:
    """``[3, B, L]`` M-RoPE positions, equal to ``Qwen3VLModel.get_rope_index`` for image inputs.

    Works per run of image tokens instead of per token (the transformers loop is per token in Python),
    which matters when a shortlist of 50 pairs is scored at once; a row's positions depend only on where its
    image runs are, their grids and its length, so rows of one layout (an ingestion batch of one image size)
    are computed once per call (not across calls: shortlist rows rarely repeat, and would only fill memory).
    """
    batch, width = ids.shape
    out = np.zeros((3, batch, width), dtype=np.int64)
    ids_np, mask_np = ids.numpy(), mask.numpy().astype(bool)
    grid_iter = iter(grids)
    layouts: dict[tuple[tuple[int, ...], tuple[tuple[int, int, int], ...], int], np.ndarray] = {}
    for row in range(batch):
        valid = np.flatnonzero(mask_np[row])
        is_img = ids_np[row, valid] == image_token_id
        edges = np.flatnonzero(np.diff(np.concatenate(([0], is_img.view(np.int8), [0]))))
        row_grids = tuple((int(t), int(h), int(w)) for t, h, w in itertools.islice(grid_iter, len(edges) // 2))
        key = (tuple(edges.tolist()), row_grids, len(valid))
        if key not in layouts:
            layouts[key] = _row_positions(*key, merge)
        out[:, row, valid] = layouts[key]
    return torch.from_numpy(out)


def _row_positions(edges: tuple[int, ...], grids: tuple[tuple[int, int, int], ...], length: int, merge: int,
                   ) -> np.ndarray:
    """``[3, length]`` positions of one row whose image runs start and end at ``edges``."""
    if 2 * len(grids) != len(edges):
        raise ValueError("the image token runs and the images' grids do not match")
    pieces: list[np.ndarray] = []
    pos, cursor = 0, 0
    for start, end, (t, h, w) in zip(edges[0::2], edges[1::2], grids, strict=True):
        if start > cursor:
            pieces.append(np.broadcast_to(np.arange(pos, pos + start - cursor), (3, start - cursor)))
            pos += start - cursor
        gh, gw = h // merge, w // merge
        if t * gh * gw != end - start:
            raise ValueError("image token run does not match its grid")
        tt, hh, ww = np.meshgrid(np.arange(t), np.arange(gh), np.arange(gw), indexing="ij")
        pieces.append(np.stack([tt.ravel() + pos, hh.ravel() + pos, ww.ravel() + pos]))
        pos += max(gh, gw)
        cursor = end
    if cursor < length:
        pieces.append(np.broadcast_to(np.arange(pos, pos + length - cursor), (3, length - cursor)))
    return np.concatenate(pieces, axis=1) if pieces else np.zeros((3, 0), dtype=np.int64)


@torch.inference_mode()
def last_hidden_states(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int) -> torch.Tensor:
    """``[B, H]`` hidden state of the last real token of each input (one forward pass)."""
    return pooled_states(loaded, batch, pad_id)


def pooled_states(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int) -> torch.Tensor:
    """:func:`last_hidden_states` without ``inference_mode``: the demo models (``app/demo``) train through
    this very forward, with packages whose tensors carry gradients, so what they learn is what inference runs."""
    model = loaded.model
    device = loaded.device
    ids, mask = right_pad([x.ids for x in batch], pad_id)
    image_type = (ids == loaded.image_token_id).to(torch.int32)
    packages = [pkg for item in batch for pkg in item.packages]
    merge = int(model.config.vision_config.spatial_merge_size)
    position_ids = mrope_positions(ids, mask, [p.grid_thw for p in packages], loaded.image_token_id, merge)
    out = model(
        input_ids=ids.to(device),
        attention_mask=mask.to(device),
        position_ids=position_ids.to(device),
        use_cache=False,
        **mm_kwargs(loaded, packages, image_type),
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


def mm_kwargs(loaded: LoadedQwen, packages: Sequence[VisualPackage], image_type: torch.Tensor) -> dict[str, Any]:
    """The cached packages as ``Qwen3VLModel.forward`` takes precomputed vision outputs (per-image tuples,
    exactly what ``get_image_features`` hands to forward() on the uncached path)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import BaseModelOutputWithDeepstackFeatures

    if not packages:
        return {}
    device = loaded.device
    embeds: Any = tuple(p.embeds.to(device, loaded.dtype, non_blocking=True) for p in packages)
    deepstack: Any = [
        tuple(p.deepstack[level].to(device, loaded.dtype, non_blocking=True) for p in packages)
        for level in range(packages[0].levels)
    ]
    return {
        "mm_encoder_outputs": {
            "image": BaseModelOutputWithDeepstackFeatures(pooler_output=embeds, deepstack_features=deepstack)
        },
        "image_grid_thw": torch.tensor([list(p.grid_thw) for p in packages], dtype=torch.long, device=device),
        "mm_token_type_ids": image_type.to(device),
    }
