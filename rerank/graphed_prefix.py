"""The shared-prefix reranker pass as a CUDA-graph replay (``RUBRICSEARCH_CUDA_GRAPHS``).

A search's shortlist is one or a few groups (a prefix: instruction, criteria and candidate image; its
continuations: the references). :func:`rerank.prefix.run_shared_prefixes` runs them as two transformers passes
whose ~2,800 kernel launches from Python cost far more than their GPU time on an H100. Here the same
computation — prefixes once, each continuation row attending to its own group's prefix keys and values — is
written with explicit boolean attention masks and host-computed image positions (no host syncs), captured
once per bucketed shape and replayed (:class:`retrieval.qwen.graphed_lm.GraphCache`). Groups and rows are
padded to powers of two and widths to multiples of 32; pad keys are masked, so real rows see exactly the
keys the eager pass gives them (results agree at rounding level: ``tests/test_graphed_prefix.py`` on the CPU,
``tests/test_gpu.py`` replayed). Shortlists too large for the token budget take the eager path.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from rerank.prefix import PREFIX_BATCH_BYTES, Group, row_bytes, run_shared_prefixes
from retrieval.packages import VisualPackage
from retrieval.qwen.forward import mrope_positions, right_pad
from retrieval.qwen.graphed_lm import GraphCache, bucket_rows, embed, image_inputs, round_width, run_layers
from retrieval.qwen.loading import LoadedQwen


class _Record:
    """KV-cache stand-in for the prefix pass: keeps each layer's keys and values."""

    def __init__(self) -> None:
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.keys[layer], self.values[layer] = keys, values
        return keys, values


class _Join:
    """KV-cache stand-in for the continuation pass: each row's group prefix joined to its own keys/values."""

    def __init__(self, prefix: _Record, groups: torch.Tensor) -> None:
        self.prefix, self.groups = prefix, groups

    def update(self, keys: torch.Tensor, values: torch.Tensor, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (torch.cat([self.prefix.keys[layer][self.groups], keys], dim=-2),
                torch.cat([self.prefix.values[layer][self.groups], values], dim=-2))


def _images(loaded: LoadedQwen, ids: torch.Tensor, valid: torch.Tensor, packages: list[VisualPackage],
            levels: int) -> dict[str, torch.Tensor]:
    rows, cols, embeds, deep = image_inputs(loaded, ids, valid.numpy(), packages, levels)
    return {"rows": rows, "cols": cols, "embeds": embeds, "deep": deep}


def prepare(loaded: LoadedQwen, groups: Sequence[Group], pad_id: int) -> tuple[tuple[int, ...], dict[str, Any]]:
    """The padded tensors of one graphed pass and its shape key."""
    merge = int(loaded.model.config.vision_config.spatial_merge_size)
    n_groups, width = bucket_rows(len(groups)), round_width(max(len(p.ids) for p, _ in groups))
    p_ids, p_real = right_pad([p.ids for p, _ in groups], pad_id, rows=n_groups, width=width)
    p_len = p_real.sum(dim=1).clamp(min=1)  # pad groups: one pad token, attending to itself
    p_valid = torch.arange(width)[None, :] < p_len[:, None]
    p_pkgs = [pkg for prefix, _ in groups for pkg in prefix.packages]
    rows = [(g, c) for g, (_, conts) in enumerate(groups) for c in conts]
    n_rows, c_width = bucket_rows(len(rows)), round_width(max(len(c.ids) for _, c in rows))
    c_ids, c_real = right_pad([c.ids for _, c in rows], pad_id, rows=n_rows, width=c_width)
    c_len = c_real.sum(dim=1).clamp(min=1)
    c_group = torch.zeros(n_rows, dtype=torch.long)  # pad rows read group 0's prefix
    c_group[: len(rows)] = torch.tensor([g for g, _ in rows], dtype=torch.long)
    c_pkgs = [pkg for _, c in rows for pkg in c.packages]
    levels = (p_pkgs or c_pkgs)[0].levels if (p_pkgs or c_pkgs) else 0
    n = len(groups)
    p_pos = torch.zeros((3, n_groups, width), dtype=torch.long)
    p_pos[:, :n] = mrope_positions(p_ids[:n], p_valid[:n].long(), [p.grid_thw for p in p_pkgs],
                                   loaded.image_token_id, merge)
    # continuation positions are those of the whole sequence (prefix padding skipped), after the prefix
    c_valid = torch.arange(c_width)[None, :] < c_len[:, None]
    full_ids = torch.cat([p_ids[c_group], c_ids], dim=1)[: len(rows)]
    full_mask = torch.cat([p_valid[c_group], c_valid], dim=1)[: len(rows)].long()
    grids = [p.grid_thw for g, c in rows for p in (*groups[g][0].packages, *c.packages)]
    c_pos = torch.zeros((3, n_rows, c_width), dtype=torch.long)
    c_pos[:, : len(rows)] = mrope_positions(full_ids, full_mask, grids, loaded.image_token_id, merge)[:, :, width:]
    # boolean masks, True = attend: causal within the prefix over its real keys; a row sees its group's
    # real prefix keys and, causally, its own
    p_mask = torch.ones((width, width), dtype=torch.bool).tril()[None] & p_valid[:, None, :]
    own = torch.ones((c_width, c_width), dtype=torch.bool).tril()[None].expand(n_rows, -1, -1)
    c_mask = torch.cat([p_valid[c_group][:, None, :].expand(-1, c_width, -1), own], dim=2)
    p_img = _images(loaded, p_ids, p_valid, p_pkgs, levels)
    c_img = _images(loaded, c_ids, c_valid, c_pkgs, levels)
    dev = loaded.device
    tensors = {"p_ids": p_ids.to(dev), "p_pos": p_pos.to(dev), "p_mask": p_mask[:, None].to(dev),
               "c_ids": c_ids.to(dev), "c_pos": c_pos.to(dev), "c_mask": c_mask[:, None].to(dev),
               "c_group": c_group.to(dev), "c_last": (c_len - 1).to(dev),
               **{f"p_{k}": v for k, v in p_img.items()}, **{f"c_{k}": v for k, v in c_img.items()}}
    key = (n_groups, width, n_rows, c_width, int(p_img["rows"].shape[0]), int(c_img["rows"].shape[0]), levels)
    return key, tensors


def shared_prefix_pass(model: Any, t: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[rows, hidden]`` last-token states of every (padded) continuation row, with no host sync."""
    text = model.language_model
    record = _Record()
    hidden = embed(text, t["p_ids"], t["p_rows"], t["p_cols"], t["p_embeds"])
    run_layers(text, hidden, t["p_pos"], t["p_rows"], t["p_cols"], t["p_deep"], attention_mask=t["p_mask"],
               cache=record)
    hidden = embed(text, t["c_ids"], t["c_rows"], t["c_cols"], t["c_embeds"])
    hidden = run_layers(text, hidden, t["c_pos"], t["c_rows"], t["c_cols"], t["c_deep"], attention_mask=t["c_mask"],
                        cache=_Join(record, t["c_group"]))
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), t["c_last"]]


class GraphedPrefixes:
    """``run(groups)`` as :func:`run_shared_prefixes` returns it: one graph replay for the whole call when
    all its rows fit ``graph_bytes`` of transient memory (:func:`rerank.prefix.row_bytes`, the estimate the
    eager path batches by) and ``max_rows``; the eager path, in batches of ``max_bytes``, otherwise. A search
    on 448 px references (overall and per-criterion groups of 20 rows, ~13 MB a row on the 2B models) fits;
    a shortlist of photos (~1,850-token prefixes) runs eagerly."""

    def __init__(self, loaded: LoadedQwen, pad_id: int, *, max_batch: int, max_bytes: int = PREFIX_BATCH_BYTES,
                 graph_bytes: int = 2 * PREFIX_BATCH_BYTES, max_rows: int = 128, max_graphs: int = 32) -> None:
        self.loaded, self.pad_id, self.max_batch, self.max_bytes = loaded, pad_id, max_batch, max_bytes
        self.graph_bytes, self.max_rows = graph_bytes, max_rows
        self.graphs = GraphCache(loaded.device, max_graphs=max_graphs)

    def fits(self, groups: Sequence[Group]) -> bool:
        width = round_width(max(len(p.ids) for p, _ in groups))
        rows = [c for _, conts in groups for c in conts]
        n_rows = bucket_rows(len(rows))
        per_row = row_bytes(self.loaded, width, round_width(max(len(c.ids) for c in rows)))
        return n_rows <= self.max_rows and n_rows * per_row <= self.graph_bytes

    @torch.inference_mode()
    def run(self, groups: Sequence[Group]) -> list[torch.Tensor]:
        if not self.fits(groups):
            return run_shared_prefixes(self.loaded, groups, self.pad_id, max_batch=self.max_batch,
                                       max_bytes=self.max_bytes)
        key, tensors = prepare(self.loaded, groups, self.pad_id)
        model = self.loaded.model
        states = self.graphs.run(key, tensors, lambda t: shared_prefix_pass(model, t)).to(torch.float32)
        out, start = [], 0
        for _, conts in groups:
            out.append(states[start:start + len(conts)].clone())
            start += len(conts)
        return out
