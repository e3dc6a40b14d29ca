"""The shortlist's passes with gradients over packed sequences (:class:`rerank.prefix.RowPasses`, the GPU path):
what the reranker's trainers and the evidence's gradient maps run where the shortlists run packed.

The prefixes run as one pack whose keys and values every layer keeps; the continuation rows as another, each row's
attention one FlashAttention call over its group's prefix keys followed by its own (causal, aligned at the end).
The inference pass (:mod:`.packed_prefix`) attends to the two key sets apart and merges them by their log-sum-exp,
which FlashAttention returns without a gradient; here each row's keys are gathered into one segment instead, so
the attention is a single differentiable kernel. The gather copies a prefix's keys once per row and layer, which a
backward keeps: a row costs ``kv_bytes`` per prefix token more than in the inference pass. No padding, no attention
mask and no host synchronisation inside a pass (the padded transformers pass stops the host at every image
scatter).

The evidence's passes (:meth:`PackedRows.gradients`: the rows' logits and their gradients with respect to the
rows' packages) run the prefixes, the rows and the backward as one function of device tensors, laid out at
bucketed sizes as the shortlist's graphed passes are (:func:`.packed_prefix._call`), so that with CUDA graphs
it is one replay: eagerly, launching the forward's and the backward's kernels one by one from Python took the host
longer than the GPU took to run them (docs/performance.md).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import accumulate

import numpy as np
import torch

from rubricsearch.rerank.plugins.accelerated.packed_prefix import _call, _pack_of, _segments, prefix_pass
from rubricsearch.rerank.prefix import RowGradients, row_gradients
from rubricsearch.retrieval.plugins.accelerated.graphed_lm import GraphCache
from rubricsearch.retrieval.plugins.accelerated.packed import (
    Attend,
    Pack,
    Segments,
    bucket,
    decode,
    scale_of,
    sequence_positions,
    varlen_attention,
)
from rubricsearch.retrieval.qwen.engine.forward import LMInput, upload
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

# The most row tokens an evidence pass is captured as a graph for: the graph's memory pool keeps the backward's
# activations (about 2 MB a token on the 2B models) for as long as it lives. The top 5 hits x 3 criteria at 448 px
# are ~3,100; photos (~1,850 tokens a row) run eagerly, where the GPU, not the host, is the limit.
GRAPH_TOKENS = 4096


@dataclass(frozen=True)
class KeptPrefixes:
    """Prefixes run as one pack: every layer's keys and values ``[tokens, kv_heads, D]``, and where each prefix
    lies in them and ends in M-RoPE positions."""

    layers: dict[int, tuple[torch.Tensor, torch.Tensor]]
    starts: list[int]
    lengths: list[int]
    offsets: list[int]  # each prefix's next M-RoPE position
    levels: int  # DeepStack levels of the packages


def _levels(seqs: Sequence[LMInput]) -> int:
    return next((p.levels for x in seqs for p in x.packages), 0)


@dataclass
class PackedRows:
    """:class:`rerank.prefix.RowPasses` over packed sequences (module docstring). On a CPU the attention is
    :func:`~retrieval.plugins.accelerated.packed.varlen_attention`'s reference loop (the congruence tests run it)."""

    loaded: LoadedQwen
    graphs: GraphCache | None = None  # the evidence's graphs (the runtime's, kept between calls)
    lock: threading.Lock = field(default_factory=threading.Lock)  # a graph's static tensors serve one call at a time

    def prefixes(self, prefixes: Sequence[LMInput]) -> KeptPrefixes:
        loaded = self.loaded
        text = loaded.model.language_model
        positions = [sequence_positions(loaded, p.ids, p.packages) for p in prefixes]
        levels, lengths = _levels(prefixes), [len(p.ids) for p in prefixes]
        pack, _, _ = _pack_of(loaded, prefixes, positions, 0, 0, levels, padded=False)
        segments, scale = Segments.of(lengths, loaded.device), scale_of(text)
        layers: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

        def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            layers[layer] = (k, v)
            return varlen_attention(q, k, v, segments, segments, causal=True, scale=scale)[0]

        decode(text, pack, attend)
        return KeptPrefixes(layers, [0, *accumulate(lengths)][:-1], lengths,
                            [int(p.max()) + 1 if p.size else 0 for p in positions], levels)

    def rows(self, prefixes: KeptPrefixes, rows: Sequence[tuple[int, LMInput]]) -> torch.Tensor:
        loaded = self.loaded
        text = loaded.model.language_model
        conts = [c for _, c in rows]
        positions = [sequence_positions(loaded, c.ids, c.packages) + prefixes.offsets[g] for g, c in rows]
        lengths = [len(c.ids) for c in conts]
        pack, _, _ = _pack_of(loaded, conts, positions, 0, 0, prefixes.levels or _levels(conts), padded=False)
        device, scale = loaded.device, scale_of(text)
        index, key_lengths = joined_keys(prefixes.starts, prefixes.lengths, [g for g, _ in rows], lengths)
        joined = upload(torch.from_numpy(index), device)
        queries, keys = Segments.of(lengths, device), Segments.of(key_lengths, device)
        ones = Segments.of([1] * len(rows), device)
        last = upload(torch.tensor(list(accumulate(lengths)), dtype=torch.long) - 1, device)
        states = decode(text, pack, joined_attention(prefixes.layers, joined, queries, keys, scale), last,
                        joined_attention(prefixes.layers, joined, ones, keys, scale))
        return states.to(torch.float32)


    def gradients(self, prefixes: Sequence[LMInput], rows: Sequence[tuple[int, LMInput]], weight: torch.Tensor, *,
                  max_batch: int, max_tokens: int) -> RowGradients:
        """:meth:`rerank.prefix.RowPasses.gradients`. Rows that fit one pass of at most :data:`GRAPH_TOKENS` run
        as one function of device tensors (:func:`gradient_pass`), a graph replay where the runtime keeps graphs:
        sizes are bucketed as the shortlist's graphed passes bucket theirs, and the rows' keys joined with pad keys
        up to a bucket too, so evidence of the same image sizes replays one graph. Larger ones run
        :meth:`prefixes` and :meth:`rows` (:func:`rerank.prefix.row_gradients`)."""
        tokens = sum(len(c.ids) for _, c in rows)
        if len(rows) > max_batch or tokens > min(max_tokens, GRAPH_TOKENS):
            return row_gradients(self, prefixes, rows, weight, max_batch=max_batch, max_tokens=max_tokens)
        loaded = self.loaded
        order = sorted(range(len(rows)), key=lambda i: rows[i][0])  # the packed layout wants rows in group order
        ordered = [rows[i] for i in order]
        # pad tokens (id 0) attend only to pads, and no real row reads them
        call = _call(loaded, [(p, []) for p in prefixes], ordered, 0, padded=True)
        p_lengths, c_lengths = call.lengths["p"], call.lengths["c"]
        groups: list[int | None] = [g for g, _ in ordered]
        index, k_lengths = joined_keys(list(accumulate([0, *p_lengths]))[:-1], p_lengths,
                                       groups + [None] * (len(c_lengths) - len(ordered)), c_lengths)
        filler = bucket(len(index), 64) - len(index)  # more keys for the first pad row (the rest have no tokens)
        index = np.concatenate([index, np.full(filler, sum(p_lengths) + sum(c_lengths) - 1, dtype=np.int64)])
        k_lengths[len(ordered)] += filler
        device = loaded.device
        mask = torch.zeros(len(c_lengths), dtype=torch.float32)
        mask[: len(ordered)] = 1
        tensors = {**call.tensors, "k_cu": Segments.of(k_lengths, device).cu, "row_mask": upload(mask, device),
                   "joined": upload(torch.from_numpy(index), device),
                   "weight": weight.to(device, torch.float32)}
        key = (*call.key, len(index), bucket(max(k_lengths), 64))
        lengths = {**call.lengths, "k": k_lengths}
        text = loaded.model.language_model

        def run(t: dict[str, torch.Tensor]) -> torch.Tensor:
            return gradient_pass(text, t, key, lengths)

        if self.graphs is None:
            out = run(tensors)
        else:
            with self.lock:
                out = self.graphs.run(key, tensors, run).clone()
        n_rows, slots, hidden = len(c_lengths), call.key[5], loaded.hidden_size
        embeds = out[n_rows:n_rows + slots * hidden].view(slots, hidden)
        deepstack = out[n_rows + slots * hidden:].view(-1, slots, hidden)
        per_row: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in rows]
        start = 0
        for i, (_, c) in zip(order, ordered, strict=True):
            for p in c.packages:
                n = int(p.embeds.shape[0])
                per_row[i].append((embeds[start:start + n], deepstack[:, start:start + n]))
                start += n
        logits = torch.empty(len(rows), dtype=torch.float32)
        logits[order] = out[: len(ordered)].cpu()
        return logits, per_row


def gradient_pass(text: object, t: dict[str, torch.Tensor], key: tuple[int, ...], lengths: dict[str, list[int]]
                  ) -> torch.Tensor:
    """The prefixes' pass without gradients (:func:`.packed_prefix.prefix_pass`), the rows' with their image
    embeddings and DeepStack features as leaves, each row's keys its group's prefix joined to its own, and the
    gradient of the real rows' logits (``row_mask``) with respect to those leaves. Returns, flat and float32, the
    logits ``[rows]``, the embeddings' gradient ``[slots, H]`` and the DeepStack's ``[levels, slots, H]``. No host
    sync on a GPU (a CUDA graph holds it)."""
    with torch.inference_mode(False):
        with torch.no_grad():
            kept = prefix_pass(text, t, key[:-2], lengths)
        seg, scale = _segments(t, key[:-2], lengths), scale_of(text)
        keys = Segments(t["k_cu"], lengths["k"], key[-1])
        with torch.enable_grad():
            # copies: the inputs may be inference tensors (built under the caller's inference mode)
            embeds = t["c_image_embeds"].clone().requires_grad_(True)
            deepstack = t["c_deepstack"].clone().requires_grad_(True)
            pack = Pack(ids=t["c_ids"], positions=t["c_positions"], image_index=t["c_image_index"],
                        image_embeds=embeds, deepstack=deepstack)
            states = decode(text, pack, joined_attention(kept, t["joined"], seg["c"], keys, scale), t["last"],
                            joined_attention(kept, t["joined"], seg["l"], keys, scale))
            logits = states.to(torch.float32) @ t["weight"]
            grads = torch.autograd.grad((logits * t["row_mask"]).sum(), [embeds, deepstack])
    return torch.cat([logits.detach(), *(g.to(torch.float32).flatten() for g in grads)])


def joined_attention(kept: dict[int, tuple[torch.Tensor, torch.Tensor]], joined: torch.Tensor, queries: Segments,
                     keys: Segments, scale: float) -> Attend:
    """Each row's queries over its group's kept prefix keys and values joined to its own (``joined``:
    :func:`joined_keys`, into the prefixes' keys followed by the rows'), causal and aligned at the end."""
    def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        pk, pv = kept[layer]
        kk, vv = (torch.cat([p, own]).index_select(0, joined) for p, own in ((pk, k), (pv, v)))
        return varlen_attention(q, kk, vv, queries, keys, causal=True, scale=scale)[0]
    return attend


def joined_keys(starts: Sequence[int], lengths: Sequence[int], groups: Sequence[int | None],
                row_lengths: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """Where each row's keys come from in the prefixes' keys (prefix ``g`` at ``starts[g]``, ``lengths[g]`` long)
    followed by the rows' own (each row: its group's prefix, then its own tokens; a row of group None, a pad row,
    its own tokens only), and each row's key count."""
    total = sum(lengths)
    own = [0, *accumulate(row_lengths)][:-1]
    index = np.concatenate([np.r_[(np.r_[starts[g]:starts[g] + lengths[g]] if g is not None else []),
                                  total + start:total + start + n]
                            for g, start, n in zip(groups, own, row_lengths, strict=True)] or [np.zeros(0)])
    return index.astype(np.int64), [(lengths[g] if g is not None else 0) + n
                                    for g, n in zip(groups, row_lengths, strict=True)]
