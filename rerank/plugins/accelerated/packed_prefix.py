"""The reranker's shared-prefix pass over packed sequences (:mod:`retrieval.plugins.accelerated.packed`), the GPU path.

Same computation as :func:`rerank.prefix.run_shared_prefixes` — each group's prefix (system prompt,
instruction, query with the candidate image) once, then every continuation (a reference) attending to its
group's prefix keys and, causally, to its own — but with no padding and no per-row copy of a prefix: the
prefixes run as one pack whose keys and values each layer keeps, the continuations as another, and each
continuation token's attention is FlashAttention over its own row merged with FlashAttention over its
group's prefix. Cost grows with real tokens only, so merging many searches' shortlists into one call (the
scheduler does) makes eager passes larger, not slower per row; with graphs each shortlist replays its own
(see below).

Memory is bounded by ``max_bytes``: groups are taken while their prefixes' kept keys and values fit a quarter of it,
their rows in packs whose transient memory (:func:`~retrieval.plugins.accelerated.packed.token_bytes`) fits the
rest; a prefix never runs twice (its packs attend to the keys it kept). A chunk small enough (``graph_tokens``: a
shortlist of 50 at 448 px, or 20 photos judged once) runs as one CUDA-graph replay, prefix and packs together
(``LocalConfig.cuda_graphs``; run eagerly, a 50-row shortlist of small images took much longer, in kernel
launches, and a 20-photo one a little longer; on 3 criteria each criterion's 20 photos replay their own graph,
slightly slower than one eager pass of all three: docs/performance.md, "Measurements behind the code"): token
counts, segment counts and image tokens are padded to buckets (at most ~1/8 over) with pad segments that attend only
to pads, so a shortlist of 20 or 50 replays a graph captured once, on the second call of its shape. Shortlists the
scheduler merged from concurrent searches run as one chunk and one replay each: a merged shape rarely comes back, so
merged it would run eagerly or cost a capture. """

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from rubricsearch.rerank.prefix import PREFIX_BATCH_BYTES, Group, group_tokens
from rubricsearch.retrieval.plugins.accelerated.graphed_lm import GraphCache
from rubricsearch.retrieval.plugins.accelerated.packed import (
    Attend,
    Pack,
    Segments,
    bucket,
    build_pack,
    decode,
    kv_bytes,
    merge_attention,
    scale_of,
    sequence_positions,
    token_bytes,
    varlen_attention,
)
from rubricsearch.retrieval.qwen.engine.forward import LMInput, upload
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

Rows = list[tuple[int, LMInput]]  # (group, continuation), in group order


@dataclass
class _Prefix:
    """A chunk's prefix pack: its tensors (``p_*``), segment lengths and the sizes its graph key holds. Every
    continuation pack of the chunk shares it."""

    tensors: dict[str, torch.Tensor]
    lengths: list[int]
    offsets: list[int]  # each group's M-RoPE position after its prefix
    tokens: int
    image_slots: int
    longest: int


@dataclass
class _Call:
    """Host plan of one prefix pack and one continuation pack, as tensors (graph inputs) and static sizes."""

    tensors: dict[str, torch.Tensor]
    key: tuple[int, ...]
    lengths: dict[str, list[int]]  # segment lengths (the CPU attention loops over them)
    rows: int
    prefix: _Prefix


def _levels(groups: Sequence[Group], rows: Rows) -> int:
    return next((p.levels for prefix, _ in groups for p in prefix.packages), 0) or next(
        (p.levels for _, c in rows for p in c.packages), 0)


def _pack_of(loaded: LoadedQwen, seqs: Sequence[LMInput], positions: Sequence[np.ndarray], pad: int, pad_id: int,
             levels: int, *, padded: bool) -> tuple[Pack, int, int]:
    """``seqs`` end to end with ``pad`` pad tokens after them, as device tensors; with the pack's token count
    and its image slots (bucketed for a graph)."""
    total = sum(len(x.ids) for x in seqs)
    ids = np.full(total + pad, pad_id, dtype=np.int64)
    ids[:total] = [t for x in seqs for t in x.ids]
    pos = np.zeros((3, len(ids)), dtype=np.int64)
    pos[:, :total] = np.concatenate(positions, axis=1)
    images = int((ids == loaded.image_token_id).sum())
    slots = bucket(images, 64) if padded and images else images
    pack = build_pack(loaded, ids, pos, [p for x in seqs for p in x.packages], levels, image_slots=slots)
    return pack, len(ids), slots


def _prefix(loaded: LoadedQwen, groups: Sequence[Group], pad_id: int, levels: int, n_seg: int, *,
            padded: bool) -> _Prefix:
    p_pos = [sequence_positions(loaded, p.ids, p.packages) for p, _ in groups]
    p_len = [len(p.ids) for p, _ in groups]
    p_tot = sum(p_len)
    p_pad = bucket(p_tot + 1, 64) - p_tot if padded else 0  # a pad segment of >= 1 token: pad rows' prefix
    lengths = p_len + ([p_pad] + [0] * (n_seg - len(groups) - 1) if padded else [])
    pack, tokens, slots = _pack_of(loaded, [p for p, _ in groups], p_pos, p_pad, pad_id, levels, padded=padded)
    tensors = {"p_cu": Segments.of(lengths, loaded.device).cu, **{f"p_{f}": v for f, v in vars(pack).items()}}
    return _Prefix(tensors, lengths, [int(pos.max()) + 1 if pos.size else 0 for pos in p_pos], tokens, slots,
                   bucket(max(lengths), 64) if padded else max(lengths))


def _call(loaded: LoadedQwen, groups: Sequence[Group], rows: Rows, pad_id: int, *, padded: bool,
          prefix: _Prefix | None = None) -> _Call:
    """The tensors of a pass over ``rows`` after ``groups``' prefixes; ``prefix`` reuses another pack's (the
    same chunk's) prefix pack instead of building it again."""
    levels = _levels(groups, rows)
    n_seg = bucket(len(groups) + 1, 2) if padded else len(groups)
    prefix = prefix or _prefix(loaded, groups, pad_id, levels, n_seg, padded=padded)
    c_pos = [sequence_positions(loaded, c.ids, c.packages) + prefix.offsets[g] for g, c in rows]
    c_len = [len(c.ids) for _, c in rows]
    # per group: its rows' tokens and its rows, in one pass over the rows (not one pass per group each)
    q_len, g_len = [0] * len(groups), [0] * len(groups)
    for (g, _), n in zip(rows, c_len, strict=True):
        q_len[g] += n
        g_len[g] += 1
    c_tot = sum(c_len)
    c_pad = bucket(c_tot + 1, 64) - c_tot if padded else 0
    n_rows = bucket(len(rows) + 1, 4) if padded else len(rows)
    lengths = {
        "p": prefix.lengths,
        "q": q_len + ([c_pad] + [0] * (n_seg - len(groups) - 1) if padded else []),
        "c": c_len + ([c_pad] + [0] * (n_rows - len(rows) - 1) if padded else []),
        # the final layer's queries, one per row (decode's ``last``): per row, and per group (pad rows: the pad's)
        "l": [1] * n_rows,
        "g": g_len + ([n_rows - len(rows)] + [0] * (n_seg - len(groups) - 1) if padded else []),
    }
    pack, tokens, slots = _pack_of(loaded, [c for _, c in rows], c_pos, c_pad, pad_id, levels, padded=padded)
    last = np.full(n_rows, tokens - 1, dtype=np.int64)  # pad rows read the last (pad) token
    last[: len(rows)] = np.cumsum(c_len) - 1
    device = loaded.device
    longest = {name: (bucket(max(lengths[name]), 64) if padded else max(lengths[name])) for name in "qc"}
    tensors = {**prefix.tensors, "last": upload(torch.from_numpy(last), device),
               **{f"{name}_cu": Segments.of(lengths[name], device).cu for name in "qclg"},
               **{f"c_{f}": v for f, v in vars(pack).items()}}
    key = (prefix.tokens, tokens, n_seg, n_rows, prefix.image_slots, slots, levels, prefix.longest,
           longest["q"], longest["c"])
    return _Call(tensors, key, lengths, len(rows), prefix)


Kept = dict[int, tuple[torch.Tensor, torch.Tensor]]  # each layer's prefix keys and values


def _segments(t: dict[str, torch.Tensor], key: tuple[int, ...], lengths: dict[str, list[int]]) -> dict[str, Segments]:
    longest = {**dict(zip("pqc", key[-3:], strict=True)), "l": 1, "g": key[3]}  # key[3]: rows, pad rows included
    return {name: Segments(t[f"{name}_cu"], lengths.get(name, []), longest[name]) for name in "pqclg"
            if f"{name}_cu" in t}


def _pack(t: dict[str, torch.Tensor], name: str) -> Pack:
    return Pack(**{f: t[f"{name}_{f}"] for f in ("ids", "positions", "image_index", "image_embeds", "deepstack")})


def prefix_pass(text: object, t: dict[str, torch.Tensor], key: tuple[int, ...],
                lengths: dict[str, list[int]]) -> Kept:
    """The prefixes' pass: every layer's keys and values, for the continuation passes to attend to."""
    seg, scale = _segments(t, key, lengths), scale_of(text)
    kept: Kept = {}

    def prefix(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        kept[layer] = (k, v)
        return varlen_attention(q, k, v, seg["p"], seg["p"], causal=True, scale=scale)[0]

    decode(text, _pack(t, "p"), prefix)
    return kept


def continuation_pass(text: object, t: dict[str, torch.Tensor], key: tuple[int, ...],
                      lengths: dict[str, list[int]], kept: Kept) -> torch.Tensor:
    """Last-token states ``[rows, H]`` of every (padded) continuation row, each attending causally to itself
    and to its group's kept prefix; no host sync on a GPU."""
    seg, scale = _segments(t, key, lengths), scale_of(text)

    def attend(queries: str, groups: str) -> Attend:
        def continuation(layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
            own = varlen_attention(q, k, v, seg[queries], seg["c"], causal=True, scale=scale)
            pk, pv = kept[layer]
            shared = varlen_attention(q, pk, pv, seg[groups], seg["p"], causal=False, scale=scale)
            return merge_attention(own, shared)
        return continuation

    # every token through the layers, then the final layer for each row's last token only (its query alone
    # sees the whole row: causal segments align at their ends)
    return decode(text, _pack(t, "c"), attend("c", "q"), t["last"], attend("l", "g"))


def chunk_pass(text: object, calls: Sequence[tuple[dict[str, torch.Tensor], tuple[int, ...], dict[str, list[int]]]]
               ) -> torch.Tensor:
    """A chunk's prefixes once, then each of its continuation packs: the (padded) last-token states of all the
    packs' rows, pack after pack. ``calls`` are (tensors, key, lengths) of :func:`_call` for each pack of one
    chunk (their prefix tensors are the same). What a graph captures; no host sync on a GPU."""
    kept = prefix_pass(text, *calls[0])
    states = [continuation_pass(text, t, key, lengths, kept) for t, key, lengths in calls]
    return states[0] if len(states) == 1 else torch.cat(states)


def _by_group(rows: Rows, states: torch.Tensor) -> tuple[list[int], list[torch.Tensor]]:
    """A pack's states split into its groups' runs (rows come in group order): one copy per group."""
    groups: list[int] = []
    counts: list[int] = []
    for g, _ in rows:
        if groups and groups[-1] == g:
            counts[-1] += 1
        else:
            groups.append(g)
            counts.append(1)
    return groups, list(torch.split(states, counts))


class PackedPrefixes:
    """``run(groups)`` as :func:`rerank.prefix.run_shared_prefixes` returns it (float32 states per group),
    through packed passes; see the module docstring."""

    def __init__(self, loaded: LoadedQwen, pad_id: int, *, max_bytes: int = PREFIX_BATCH_BYTES,
                 cuda_graphs: bool = False, graph_tokens: int = 65536, max_graphs: int = 32) -> None:
        self.loaded, self.pad_id, self.max_bytes = loaded, pad_id, max_bytes
        self.graph_tokens = graph_tokens
        # A shape is captured when it comes back: one search's shortlist does, a merged one rarely does.
        self.graphs = GraphCache(loaded.device, max_graphs=max_graphs, capture_after=2) if cuda_graphs else None
        self.counters = {"packed_calls": 0, "packed_passes": 0, "packed_prefix_passes": 0, "packed_tokens": 0}

    @property
    def stats(self) -> dict[str, int]:
        """Packed calls, passes and tokens, and the shortlist graphs' counters (``prefix_graph_*``)."""
        graphs = self.graphs.counters if self.graphs is not None else {}
        return {**self.counters, **{f"prefix_{name}": n for name, n in graphs.items()}}

    def chunks(self, groups: Sequence[Group]) -> list[tuple[list[Group], list[Rows]]]:
        """Groups whose kept prefixes fit a quarter of ``max_bytes``, each with its rows in packs fitting the
        rest (a row longer than that still gets a pack of its own)."""
        kv, per_token = kv_bytes(self.loaded), token_bytes(self.loaded)
        out: list[tuple[list[Group], list[Rows]]] = []
        taken: list[Group] = []
        for group in groups:
            prefix_tokens = sum(len(p.ids) for p, _ in taken) + len(group[0].ids)
            if taken and (prefix_tokens * kv > self.max_bytes // 4 or self._alone(group) or self._alone(taken[-1])):
                out.append((taken, []))
                taken = []
            taken.append(group)
        out.append((taken, []))
        for chunk, packs in out:
            rows: Rows = []
            tokens = 0
            for g, (_, conts) in enumerate(chunk):
                for c in conts:
                    if rows and (tokens + len(c.ids)) * per_token > self.max_bytes * 3 // 4:
                        packs.append(rows)
                        rows, tokens = [], 0
                    rows.append((g, c))
                    tokens += len(c.ids)
            packs.append(rows)
        return out

    def _alone(self, group: Group) -> bool:
        """Whether the group runs as a chunk of its own: with graphs, one that fits a graph does (module docstring)."""
        return self.graphs is not None and group_tokens(group) <= self.graph_tokens

    @torch.inference_mode()
    def run(self, groups: Sequence[Group]) -> list[torch.Tensor]:
        results = [torch.empty((len(conts), self.loaded.hidden_size), dtype=torch.float32, device=self.loaded.device)
                   for _, conts in groups]
        done = [0] * len(groups)
        start = 0
        self.counters["packed_calls"] += 1
        for chunk, packs in self.chunks(groups):
            self.counters["packed_prefix_passes"] += 1  # a chunk's prefixes run once, for all its packs
            for rows, states in zip(packs, self._chunk(chunk, packs), strict=True):
                for g, part in zip(*_by_group(rows, states.to(torch.float32)), strict=True):
                    results[start + g][done[start + g]:done[start + g] + len(part)] = part
                    done[start + g] += len(part)
                self.counters["packed_passes"] += 1
                self.counters["packed_tokens"] += sum(len(c.ids) for _, c in rows)
            start += len(chunk)
        return results

    def _chunk(self, groups: list[Group], packs: list[Rows]) -> list[torch.Tensor]:
        """Each pack's states: one graph replay for the whole chunk when it is small enough, else eager."""
        text = self.loaded.model.language_model
        tokens = sum(len(p.ids) for p, _ in groups) + sum(len(c.ids) for rows in packs for _, c in rows)
        padded = self.graphs is not None and tokens <= self.graph_tokens
        first = _call(self.loaded, groups, packs[0], self.pad_id, padded=padded)
        calls = [first] + [_call(self.loaded, groups, rows, self.pad_id, padded=padded, prefix=first.prefix)
                           for rows in packs[1:]]
        statics = [(c.key, c.lengths) for c in calls]
        if self.graphs is None or not padded:
            out = chunk_pass(text, [(c.tensors, c.key, c.lengths) for c in calls])
        else:  # graph inputs: the shared prefix tensors once, each pack's own under its index
            inputs = {**first.prefix.tensors, **{f"{i}.{name}": t for i, c in enumerate(calls)
                                                 for name, t in c.tensors.items() if name not in first.prefix.tensors}}

            def captured(t: dict[str, torch.Tensor]) -> torch.Tensor:
                shared = {name: v for name, v in t.items() if name.startswith("p_")}
                return chunk_pass(text, [({**shared, **{name.split(".", 1)[1]: v for name, v in t.items()
                                                       if name.startswith(f"{i}.")}}, key, lengths)
                                         for i, (key, lengths) in enumerate(statics)])

            out = self.graphs.run(tuple(key for key, _ in statics), inputs, captured)
        sizes = [c.key[3] if padded else c.rows for c in calls]  # rows per pack in the output (padded: bucketed)
        return [part[: c.rows].clone() if padded else part
                for part, c in zip(torch.split(out, sizes), calls, strict=True)]
