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
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from itertools import accumulate

import numpy as np
import torch

from rubricsearch.rerank.plugins.accelerated.packed_prefix import _pack_of
from rubricsearch.retrieval.plugins.accelerated.packed import (
    Attend,
    Segments,
    decode,
    scale_of,
    sequence_positions,
    varlen_attention,
)
from rubricsearch.retrieval.qwen.engine.forward import LMInput, upload
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen


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
        index, key_lengths = joined_keys(prefixes, [g for g, _ in rows], lengths)
        joined = upload(torch.from_numpy(index), device)
        queries, keys = Segments.of(lengths, device), Segments.of(key_lengths, device)
        ones = Segments.of([1] * len(rows), device)

        def attention(q_segments: Segments) -> Attend:
            def attend(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
                pk, pv = prefixes.layers[layer]
                kk, vv = (torch.cat([p, own]).index_select(0, joined) for p, own in ((pk, k), (pv, v)))
                return varlen_attention(q, kk, vv, q_segments, keys, causal=True, scale=scale)[0]
            return attend

        last = upload(torch.tensor(list(accumulate(lengths)), dtype=torch.long) - 1, device)
        states = decode(text, pack, attention(queries), last, attention(ones))
        return states.to(torch.float32)


def joined_keys(prefixes: KeptPrefixes, groups: Sequence[int], lengths: Sequence[int]) -> tuple[np.ndarray, list[int]]:
    """Where each row's keys come from in the prefixes' keys followed by the rows' own (each row: its group's
    prefix, then its own tokens), and each row's key count."""
    total = sum(prefixes.lengths)
    starts = [0, *accumulate(lengths)][:-1]
    index = np.concatenate([np.r_[prefixes.starts[g]:prefixes.starts[g] + prefixes.lengths[g],
                                  total + start:total + start + n]
                            for g, start, n in zip(groups, starts, lengths, strict=True)])
    return index.astype(np.int64), [prefixes.lengths[g] + n for g, n in zip(groups, lengths, strict=True)]
