"""The reranker's shared-prefix forward: a shortlist's common prompt runs once, its documents many times.

Every pair of a shortlist shares the system prompt, the instruction and the query (with the candidate
image) up to ``<Document>:``; only the documents differ. A *group* is such a prefix and its continuations.
:func:`run_shared_prefixes` runs several groups together (one search's overall and per-criterion
judgements, and other searches' groups merged by the scheduler): all prefixes in one pass, then all
continuation rows in a few passes, each row attending to its own group's prefix.

The prefixes' keys and values are never copied per row into a cache: each layer gathers the rows'
prefixes (:class:`SharedPrefixLayer`) and joins them to the rows' own keys and values for that layer's
attention only. A photo-sized candidate's prefix is ~1,850 tokens, about 0.2 GB of keys and values per row
on the 2B models, so per-row copies kept for a batch of 64 documents would cost 13 GB; here the transient
memory of a batch is bounded by ``max_bytes`` (rows per batch follow from it, :func:`row_bytes`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import Any, Protocol

import torch
from transformers.cache_utils import Cache, DynamicLayer

from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import LMInput, mm_kwargs, mrope_positions, plan_batches, right_pad
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

PREFIX_BATCH_BYTES = 1 << 30  # extra memory one batch of document rows may take beyond the weights (the CPU: 1/4)
Group = tuple[LMInput, Sequence[LMInput]]  # (prefix, continuations)


def batch_bytes(device: torch.device) -> int:
    """Transient memory one shared-prefix batch may take on ``device``. On a GPU, 1/16 of its memory up to 4 GiB:
    a 20-photo shortlist (~37k tokens) then runs as one or two packs instead of five, whose extra launches
    left the GPU idle for much of the rerank (the measurement: docs/performance.md, "Measurements behind the
    code")."""
    if device.type != "cuda":
        return PREFIX_BATCH_BYTES // 4
    return min(4 * PREFIX_BATCH_BYTES, torch.cuda.get_device_properties(device).total_memory // 16)


def group_tokens(group: Group) -> int:
    """Tokens a group's pass computes: its prefix once, then each continuation."""
    return len(group[0].ids) + sum(len(c.ids) for c in group[1])


class SharedPrefixLayer(DynamicLayer):
    """One layer's prefix keys and values ``[G, kv_heads, P, D]`` of ``G`` groups, shared by the rows.

    ``update`` returns each row's group prefix (an expanded view for one group, a gather for several)
    joined to the rows' new keys and values for this layer's attention, and stores nothing, so no per-row
    copy of a prefix outlives the layer.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, rows: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values = keys, values
        self.prefix = (keys, values)
        self.rows = rows  # the group of each row
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object,
               **kwargs: object) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.prefix
        if keys.shape[0] == 1:
            keys, values = (t.expand(key_states.shape[0], -1, -1, -1) for t in (keys, values))
        else:
            keys, values = keys[self.rows], values[self.rows]
        return torch.cat([keys, key_states], dim=-2), torch.cat([values, value_states], dim=-2)


def row_bytes(loaded: LoadedQwen, prefix_tokens: int, tokens: int) -> int:
    """Transient memory of one document row in a shared-prefix forward: one layer's keys and values
    (prefix joined), the boolean attention mask, and the MLP activations of the row's own tokens. The
    attention kernels (memory-efficient SDPA) never hold the scores; the CPU's math kernel does, per head."""
    text = loaded.config.text_config
    itemsize = torch.finfo(loaded.dtype).bits // 8
    kv = 2 * int(text.num_key_value_heads) * (prefix_tokens + tokens) * loaded.head_dim * itemsize
    heads = 1 if loaded.device.type == "cuda" else int(text.num_attention_heads)
    scores = (heads * 4 + 1) * tokens * (prefix_tokens + tokens)
    mlp = 3 * tokens * int(text.intermediate_size) * itemsize
    return kv + scores + mlp


def run_shared_prefix(loaded: LoadedQwen, prefix: LMInput, continuations: Sequence[LMInput], pad_id: int, *,
                      max_batch: int, max_bytes: int = PREFIX_BATCH_BYTES) -> torch.Tensor:
    """Last-token states of ``prefix + c`` for every continuation (one group)."""
    return run_shared_prefixes(loaded, [(prefix, continuations)], pad_id, max_batch=max_batch,
                               max_bytes=max_bytes)[0]


@torch.inference_mode()
def run_shared_prefixes(loaded: LoadedQwen, groups: Sequence[Group], pad_id: int, *, max_batch: int,
                        max_bytes: int = PREFIX_BATCH_BYTES) -> list[torch.Tensor]:
    """For each group, float32 ``[len(continuations), H]``: last-token states of ``prefix + c``.

    The prefixes run once, together (right-padded); continuation rows of all groups are batched by
    length, at most ``max_batch`` rows and ``max_bytes`` of transient memory per pass. M-RoPE positions are
    those of each full sequence (padding skipped), sliced after the prefix.
    """
    return shared_prefix_states(PaddedRows(loaded, pad_id), groups, max_batch=max_batch, max_bytes=max_bytes)


RowGradients = tuple[torch.Tensor, list[list[tuple[torch.Tensor, torch.Tensor]]]]
"""Float32 logits ``[rows]`` and, per row and package, the gradients of embeds and deepstack (float32)."""


class RowPasses(Protocol):
    """A shortlist's two passes with gradients wherever autograd records them: :meth:`prefixes` runs prefixes
    (system prompt, instruction, query) together and keeps every layer's keys and values; :meth:`rows` runs
    continuation rows ``(g, continuation)``, each attending to prefix ``g`` and causally to itself, and returns
    their float32 last-token states ``[len(rows), H]``. The reranker's trainers and the evidence's gradient maps
    run them. :class:`PaddedRows` pads the rows through the transformers model; the accelerated plug-in packs them
    (FlashAttention, as its shortlists run)."""

    loaded: LoadedQwen

    def prefixes(self, prefixes: Sequence[LMInput]) -> Any: ...

    def rows(self, prefixes: Any, rows: Sequence[tuple[int, LMInput]]) -> torch.Tensor: ...

    def gradients(self, prefixes: Sequence[LMInput], rows: Sequence[tuple[int, LMInput]], weight: torch.Tensor, *,
                  max_batch: int, max_tokens: int) -> RowGradients:
        """Each row's logit ``h_last · weight`` and its gradient with respect to the row's own packages (the
        evidence's maps): the prefixes run once and take none, no weight gets one, and the rows run forward and
        backward in passes of at most ``max_batch`` rows and ``max_tokens`` tokens."""
        ...


@dataclass
class PaddedRows:
    """:class:`RowPasses` through the transformers model, rows right-padded (:func:`prefix_cache`,
    :func:`continuation_states`)."""

    loaded: LoadedQwen
    pad_id: int

    def prefixes(self, prefixes: Sequence[LMInput]) -> PrefixCache:
        return prefix_cache(self.loaded, prefixes, self.pad_id)

    def rows(self, prefixes: PrefixCache, rows: Sequence[tuple[int, LMInput]]) -> torch.Tensor:
        return continuation_states(self.loaded, prefixes, rows, self.pad_id)

    def gradients(self, prefixes: Sequence[LMInput], rows: Sequence[tuple[int, LMInput]], weight: torch.Tensor, *,
                  max_batch: int, max_tokens: int) -> RowGradients:
        return row_gradients(self, prefixes, rows, weight, max_batch=max_batch, max_tokens=max_tokens)


def row_gradients(passes: RowPasses, prefixes: Sequence[LMInput], rows: Sequence[tuple[int, LMInput]],
                  weight: torch.Tensor, *, max_batch: int, max_tokens: int) -> RowGradients:
    """:meth:`RowPasses.gradients` through ``passes``' two passes: the prefixes without an autograd graph, then
    the rows with their packages as leaves (float32). The rows of a pass are independent, so the gradient of the
    sum of its logits with respect to a row's leaves is that row's own."""
    logits = torch.empty(len(rows), dtype=torch.float32)
    grads: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
    with torch.inference_mode(False):
        with torch.no_grad():
            cache = passes.prefixes(prefixes)
        for batch in plan_batches([c for _, c in rows], max_batch, max_tokens):
            with torch.enable_grad():
                leaves = [[replace(p, embeds=p.embeds.to(torch.float32, copy=True).requires_grad_(True),
                                   deepstack=p.deepstack.to(torch.float32, copy=True).requires_grad_(True))
                           for p in rows[r][1].packages] for r in batch]
                states = passes.rows(cache, [(rows[r][0], replace(rows[r][1], packages=row))
                                             for r, row in zip(batch, leaves, strict=True)])
                row_logits = states @ weight.to(states.device, torch.float32)
                flat = iter(torch.autograd.grad(row_logits.sum(), [t for row in leaves for p in row
                                                                   for t in (p.embeds, p.deepstack)]))
            logits[batch] = row_logits.detach().cpu()
            for r, row in zip(batch, leaves, strict=True):
                grads[r] = [(next(flat), next(flat)) for _ in row]
    return logits, grads


def shared_prefix_states(passes: RowPasses, groups: Sequence[Group], *, max_batch: int,
                         max_bytes: int = PREFIX_BATCH_BYTES) -> list[torch.Tensor]:
    """:func:`run_shared_prefixes` through ``passes``, without ``inference_mode``: the reranker's trainers run
    this very forward (with the runtime's passes), so what a model learns is what a shortlist runs."""
    loaded = passes.loaded
    cache = passes.prefixes([prefix for prefix, _ in groups])
    results = [torch.empty((len(conts), loaded.hidden_size), dtype=torch.float32, device=loaded.device)
               for _, conts in groups]
    rows = sorted(((g, j) for g, (_, conts) in enumerate(groups) for j in range(len(conts))),
                  key=lambda r: len(groups[r[0]][1][r[1]].ids))
    cost = partial(row_bytes, loaded, max(len(prefix.ids) for prefix, _ in groups))
    for batch in _batches(rows, groups, max_batch, cost, max_bytes):
        states = passes.rows(cache, [(g, groups[g][1][j]) for g, j in batch])
        for (g, j), state in zip(batch, states, strict=True):
            results[g][j] = state
    return results


@dataclass(frozen=True)
class PrefixCache:
    """The keys and values of ``G`` prefixes run together (right-padded to ``width``), per layer
    ``[G, kv_heads, width, D]``, and what their continuations' positions and masks need."""

    ids: torch.Tensor  # [G, width]
    mask: torch.Tensor  # [G, width]
    packages: list[list[VisualPackage]]  # per prefix
    layers: list[tuple[torch.Tensor, torch.Tensor]]

    @property
    def width(self) -> int:
        return int(self.ids.shape[1])


def prefix_cache(loaded: LoadedQwen, prefixes: Sequence[LMInput], pad_id: int) -> PrefixCache:
    """One forward of all ``prefixes`` (right-padded), keeping every layer's keys and values. It records a
    graph only where the caller enables one: the evidence's maps of later tokens run it without."""
    model, device = loaded.model, loaded.device
    merge = int(model.config.vision_config.spatial_merge_size)
    p_ids, p_mask = right_pad([p.ids for p in prefixes], pad_id)
    p_type = (p_ids == loaded.image_token_id).to(torch.int32)
    p_packages = [pkg for prefix in prefixes for pkg in prefix.packages]
    p_pos = mrope_positions(p_ids, p_mask, [p.grid_thw for p in p_packages], loaded.image_token_id, merge)
    out = model(input_ids=p_ids.to(device), attention_mask=p_mask.to(device), position_ids=p_pos.to(device),
                use_cache=True, **mm_kwargs(loaded, p_packages, p_type))
    layers = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    return PrefixCache(p_ids, p_mask, [list(p.packages) for p in prefixes], layers)


def continuation_states(loaded: LoadedQwen, cache: PrefixCache, rows: Sequence[tuple[int, LMInput]], pad_id: int
                        ) -> torch.Tensor:
    """Float32 ``[len(rows), H]``: the last-token state of each row ``(g, continuation)``, the continuation run
    after prefix ``g`` of ``cache`` (one forward; its M-RoPE positions are those of the full sequence, padding
    skipped, sliced after the prefix). A gradient reaches the rows' packages, never the prefixes'."""
    model, device = loaded.model, loaded.device
    merge = int(model.config.vision_config.spatial_merge_size)
    conts = [c for _, c in rows]
    gidx = torch.tensor([g for g, _ in rows], dtype=torch.long)
    c_ids, c_mask = right_pad([c.ids for c in conts], pad_id)
    full_ids = torch.cat([cache.ids[gidx], c_ids], dim=1)
    full_mask = torch.cat([cache.mask[gidx], c_mask], dim=1)
    grids = [p.grid_thw for g, c in rows for p in (*cache.packages[g], *c.packages)]
    pos = mrope_positions(full_ids, full_mask, grids, loaded.image_token_id, merge)
    on_device = gidx.to(device)
    past = Cache(layers=[SharedPrefixLayer(k, v, on_device) for k, v in cache.layers])
    c_type = (c_ids == loaded.image_token_id).to(torch.int32)
    hidden = model(input_ids=c_ids.to(device), attention_mask=full_mask.to(device),
                   position_ids=pos[:, :, cache.width:].to(device), past_key_values=past, use_cache=True,
                   **mm_kwargs(loaded, [p for c in conts for p in c.packages], c_type)).last_hidden_state
    last = torch.tensor([len(c.ids) - 1 for c in conts], device=hidden.device)
    return hidden[torch.arange(len(rows), device=hidden.device), last].to(torch.float32)


def _batches(rows: list[tuple[int, int]], groups: Sequence[Group], max_batch: int, cost: Callable[[int], int],
             max_bytes: int) -> list[list[tuple[int, int]]]:
    """Consecutive rows (ordered by length) while the batch's padded cost stays within ``max_bytes``."""
    batches: list[list[tuple[int, int]]] = []
    current: list[tuple[int, int]] = []
    for g, j in rows:
        width = len(groups[g][1][j].ids)  # the longest so far: rows come shortest first
        if current and (len(current) >= max_batch or (len(current) + 1) * cost(width) > max_bytes):
            batches.append(current)
            current = []
        current.append((g, j))
    if current:
        batches.append(current)
    return batches
