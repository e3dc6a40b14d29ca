"""CUDA-graph replays of small LM passes (``RUBRICSEARCH_CUDA_GRAPHS``).

A search's candidate, an instruction list or a short ``/v1/embeddings`` call is an LM pass of a few hundred
tokens: on an H100 its kernels take about 6 ms, but launching them from the transformers decoder (about 1,400
kernels through Python) takes about 55 ms (``bench/pass_profile.py``). Such passes are captured once per
shape as a CUDA graph and replayed: the host then launches one graph instead of 1,400 kernels.

The captured function is the text decoder of ``Qwen3VLModel`` as ``forward.pooled_states`` runs it, written
without its data-dependent steps so that it can be captured: image-token positions come from the ids on the
host (``masked_scatter`` and the DeepStack boolean masks make the GPU report a count back, which a graph
cannot), and sequences are right-padded, so causal attention alone keeps every real token from seeing pads
(the padding mask the eager path builds changes nothing for them). Shapes are bucketed (rows to a power of
two, width to a multiple of 32, image tokens exact) and graphs kept in a small LRU sharing one memory pool.
Results agree with the eager pass at rounding level (other GEMM tilings for the padded shapes), checked on a
GPU in ``tests/test_gpu.py``; on the CPU the same function runs eagerly in ``tests/test_graphed_lm.py``.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from retrieval.qwen.forward import LMInput, mrope_positions
from retrieval.qwen.loading import LoadedQwen

WIDTH_STEP = 32
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shape:
    rows: int
    width: int
    image_tokens: int
    levels: int


@dataclass
class Batch:
    """The tensors of one pass, padded to its :class:`Shape` (what a graph's static inputs hold)."""

    ids: torch.Tensor  # [rows, width]
    positions: torch.Tensor  # [3, rows, width] M-RoPE positions
    image_rows: torch.Tensor  # [image_tokens] row of each image token
    image_cols: torch.Tensor  # [image_tokens] column of each image token
    image_embeds: torch.Tensor  # [image_tokens, hidden]
    deepstack: torch.Tensor  # [levels, image_tokens, hidden]
    last: torch.Tensor  # [rows] column of each row's last real token


def _bucket_rows(n: int) -> int:
    return 1 << (n - 1).bit_length()


def shape_of(loaded: LoadedQwen, batch: Sequence[LMInput]) -> Shape:
    packages = [p for item in batch for p in item.packages]
    width = max(len(x.ids) for x in batch)
    return Shape(rows=_bucket_rows(len(batch)), width=-(-width // WIDTH_STEP) * WIDTH_STEP,
                 image_tokens=sum(int(p.embeds.shape[0]) for p in packages),
                 levels=packages[0].levels if packages else 0)


def prepare(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int, shape: Shape) -> Batch:
    """Host-side work of a pass: padded ids, M-RoPE positions, image-token coordinates, packages stacked."""
    ids = torch.full((shape.rows, shape.width), pad_id, dtype=torch.long)
    mask = torch.zeros((shape.rows, shape.width), dtype=torch.long)
    for row, item in enumerate(batch):
        ids[row, : len(item.ids)] = torch.tensor(item.ids, dtype=torch.long)
        mask[row, : len(item.ids)] = 1
    packages = [p for item in batch for p in item.packages]
    merge = int(loaded.model.config.vision_config.spatial_merge_size)
    positions = torch.zeros((3, shape.rows, shape.width), dtype=torch.long)  # pad rows: all zeros
    n = len(batch)
    positions[:, :n] = mrope_positions(ids[:n], mask[:n], [p.grid_thw for p in packages], loaded.image_token_id,
                                       merge)
    rows, cols = np.nonzero((ids == loaded.image_token_id).numpy() & mask.numpy().astype(bool))
    device, dtype, hidden = loaded.device, loaded.dtype, loaded.hidden_size
    if packages:
        embeds = torch.cat([p.embeds.to(device, dtype, non_blocking=True) for p in packages])
        deepstack = torch.cat([p.deepstack.to(device, dtype, non_blocking=True) for p in packages], dim=1)
    else:
        embeds = torch.zeros((0, hidden), dtype=dtype, device=device)
        deepstack = torch.zeros((0, 0, hidden), dtype=dtype, device=device)
    last = torch.zeros(shape.rows, dtype=torch.long)
    last[: len(batch)] = mask[: len(batch)].sum(dim=1) - 1
    return Batch(ids=ids.to(device), positions=positions.to(device), image_rows=torch.from_numpy(rows).to(device),
                 image_cols=torch.from_numpy(cols).to(device), image_embeds=embeds, deepstack=deepstack,
                 last=last.to(device))


def decoder_pass(model: Any, b: Batch) -> torch.Tensor:
    """``[rows, hidden]`` final-norm hidden state of each row's last real token, with no host sync."""
    text = model.language_model
    hidden = text.embed_tokens(b.ids)
    if b.image_embeds.shape[0]:
        hidden[b.image_rows, b.image_cols] = b.image_embeds
    position_embeddings = text.rotary_emb(hidden, b.positions)
    for index, layer in enumerate(text.layers):
        hidden = layer(hidden, attention_mask=None, position_ids=None, past_key_values=None,
                       position_embeddings=position_embeddings)
        if index < b.deepstack.shape[0]:  # DeepStack: the tower's intermediate features join the first layers
            hidden = hidden.clone()
            hidden[b.image_rows, b.image_cols] = hidden[b.image_rows, b.image_cols] + b.deepstack[index]
    hidden = text.norm(hidden)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), b.last]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: Batch
    output: torch.Tensor


class GraphedLM:
    """Runs LM passes of at most ``max_tokens`` padded tokens as CUDA-graph replays, one graph per shape."""

    def __init__(self, loaded: LoadedQwen, pad_id: int, *, max_tokens: int = 4096, max_graphs: int = 48) -> None:
        self.loaded, self.pad_id = loaded, pad_id
        self.max_tokens, self.max_graphs = max_tokens, max_graphs
        self._graphs: OrderedDict[Shape, _Graph] = OrderedDict()
        self._uncapturable: set[Shape] = set()
        self._pool: Any = None
        self.counters = {"graph_replays": 0, "graph_captures": 0, "graph_capture_failures": 0}

    def fits(self, batch: Sequence[LMInput]) -> bool:
        width = -(-max(len(x.ids) for x in batch) // WIDTH_STEP) * WIDTH_STEP
        return _bucket_rows(len(batch)) * width <= self.max_tokens

    def run(self, batch: Sequence[LMInput]) -> torch.Tensor:
        """``[len(batch), hidden]`` last-token states (model dtype), as :func:`forward.last_hidden_states`."""
        shape = shape_of(self.loaded, batch)
        inputs = prepare(self.loaded, batch, self.pad_id, shape)
        entry = self._graphs.get(shape)
        if entry is None and shape not in self._uncapturable:
            try:
                entry = self._capture(shape, inputs)
            except RuntimeError as exc:  # a capture that fails costs this shape its graph, never the request
                log.warning("CUDA graph capture failed for %s, running it eagerly: %s", shape, exc)
                self._uncapturable.add(shape)
                self.counters["graph_capture_failures"] += 1
        if entry is None:
            return decoder_pass(self.loaded.model, inputs)[: len(batch)]
        self._graphs.move_to_end(shape)
        if entry.inputs is not inputs:  # a fresh capture holds these very tensors
            for name in Batch.__dataclass_fields__:
                getattr(entry.inputs, name).copy_(getattr(inputs, name), non_blocking=True)
        entry.graph.replay()
        self.counters["graph_replays"] += 1
        return entry.output[: len(batch)].clone()

    def _capture(self, shape: Shape, inputs: Batch) -> _Graph:
        model = self.loaded.model
        side = torch.cuda.Stream(self.loaded.device)
        side.wait_stream(torch.cuda.current_stream(self.loaded.device))
        with torch.cuda.stream(side):  # warm-up off the capture: cuBLAS workspaces, Triton autotuning
            decoder_pass(model, inputs)
        torch.cuda.current_stream(self.loaded.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the tower and the other model keep launching work from their threads meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            output = decoder_pass(model, inputs)
        entry = _Graph(graph, inputs, output)
        self._graphs[shape] = entry
        self.counters["graph_captures"] += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry
