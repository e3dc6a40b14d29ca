"""CUDA-graph replays of small LM passes (``LocalConfig.cuda_graphs``) and of ingestion's (:class:`GraphedLM`).

A search's candidate, an instruction list or a short ``/v1/embeddings`` call is an LM pass of a few hundred
tokens: on a fast GPU its kernels take a few milliseconds, but launching them from the transformers decoder (about
1,400 kernels through Python) takes many times that. Such passes are captured once per
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
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.plugins.accelerated.kernels.cudnn_attention import flash_only
from rubricsearch.retrieval.plugins.accelerated.packed import (
    flash_varlen_works,
    last_token_inputs,
    last_token_pass,
    pack_key,
)
from rubricsearch.retrieval.qwen.engine.forward import LMInput, gathered, mrope_positions, right_pad, upload
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen

WIDTH_STEP = 32
log = logging.getLogger(__name__)
# One capture at a time in the process: the tower's, the LM's and the reranker's caches capture from their own
# threads, and concurrent captures corrupt results under load (NaN and zero vectors, none with captures
# serialised).
_CAPTURE_LOCK = threading.Lock()


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


def round_width(n: int) -> int:
    return -(-n // WIDTH_STEP) * WIDTH_STEP


def bucket_rows(n: int) -> int:
    """Powers of two up to 16, then multiples of 16: few shapes, little padding for shortlists."""
    return 1 << (n - 1).bit_length() if n <= 16 else -(-n // 16) * 16


def shape_of(loaded: LoadedQwen, batch: Sequence[LMInput]) -> Shape:
    """The padded shape of a small pass (rows and width bucketed)."""
    packages = [p for item in batch for p in item.packages]
    width = max(len(x.ids) for x in batch)
    return Shape(rows=bucket_rows(len(batch)), width=round_width(width),
                 image_tokens=sum(int(p.embeds.shape[0]) for p in packages),
                 levels=packages[0].levels if packages else 0)


def prepare(loaded: LoadedQwen, batch: Sequence[LMInput], pad_id: int, shape: Shape) -> Batch:
    """Host-side work of a pass: padded ids, M-RoPE positions, image-token coordinates, packages stacked."""
    ids, mask = right_pad([x.ids for x in batch], pad_id, rows=shape.rows, width=shape.width)
    packages = [p for item in batch for p in item.packages]
    merge = int(loaded.model.config.vision_config.spatial_merge_size)
    positions = torch.zeros((3, shape.rows, shape.width), dtype=torch.long)  # pad rows: all zeros
    n = len(batch)
    positions[:, :n] = mrope_positions(ids[:n], mask[:n], [p.grid_thw for p in packages], loaded.image_token_id,
                                       merge)
    rows, cols, embeds, deepstack = image_inputs(loaded, ids, mask.numpy().astype(bool), packages, shape.levels)
    last = torch.zeros(shape.rows, dtype=torch.long)
    last[:n] = mask[:n].sum(dim=1) - 1
    device = loaded.device
    return Batch(ids=upload(ids, device), positions=upload(positions, device), image_rows=rows, image_cols=cols,
                 image_embeds=embeds, deepstack=deepstack, last=upload(last, device))


def image_inputs(loaded: LoadedQwen, ids: torch.Tensor, valid: np.ndarray, packages: Sequence[VisualPackage],
                 levels: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """On the device: row and column of every real image token, the packages' embeddings in that order and
    their DeepStack features ``[levels, tokens, hidden]``."""
    rows, cols = np.nonzero((ids == loaded.image_token_id).numpy() & valid)
    device, dtype, hidden = loaded.device, loaded.dtype, loaded.hidden_size
    if packages:
        embeds = gathered([p.embeds for p in packages], device, dtype)
        deepstack = gathered([p.deepstack for p in packages], device, dtype, dim=1)
    else:
        embeds = torch.zeros((0, hidden), dtype=dtype, device=device)
        deepstack = torch.zeros((levels, 0, hidden), dtype=dtype, device=device)
    return upload(torch.from_numpy(rows), device), upload(torch.from_numpy(cols), device), embeds, deepstack


def embed(text: Any, ids: torch.Tensor, image_rows: torch.Tensor, image_cols: torch.Tensor,
          image_embeds: torch.Tensor) -> torch.Tensor:
    """Token embeddings with the packages' image embeddings at the image-token positions (what
    ``masked_scatter`` does in ``Qwen3VLModel.forward``, from coordinates known on the host)."""
    hidden = text.embed_tokens(ids)
    if image_embeds.shape[0]:
        hidden[image_rows, image_cols] = image_embeds
    return hidden


def run_layers(text: Any, hidden: torch.Tensor, positions: torch.Tensor, image_rows: torch.Tensor,
               image_cols: torch.Tensor, deepstack: torch.Tensor, *, attention_mask: torch.Tensor | None = None,
               cache: Any = None) -> torch.Tensor:
    """The decoder layers and the final norm, as ``Qwen3VLTextModel.forward`` runs them, DeepStack included.
    ``attention_mask`` None means causal attention; ``cache`` is anything with the ``update`` of a KV cache."""
    position_embeddings = text.rotary_emb(hidden, positions)
    for index, layer in enumerate(text.layers):
        hidden = layer(hidden, attention_mask=attention_mask, position_ids=None, past_key_values=cache,
                       position_embeddings=position_embeddings)
        if index < deepstack.shape[0]:  # DeepStack: the tower's intermediate features join the first layers
            hidden = hidden.clone()
            hidden[image_rows, image_cols] = hidden[image_rows, image_cols] + deepstack[index]
    return text.norm(hidden)


def decoder_pass(model: Any, b: Batch) -> torch.Tensor:
    """``[rows, hidden]`` final-norm hidden state of each row's last real token, with no host sync."""
    text = model.language_model
    hidden = embed(text, b.ids, b.image_rows, b.image_cols, b.image_embeds)
    hidden = run_layers(text, hidden, b.positions, b.image_rows, b.image_cols, b.deepstack)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), b.last]


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    inputs: dict[str, torch.Tensor]
    output: torch.Tensor


class GraphCache:
    """Captured CUDA graphs of one function, one per shape key, in an LRU sharing one memory pool.

    ``run`` copies the inputs into the graph's static ones and replays; a shape whose capture fails runs
    eagerly from then on (logged), so a graph never costs a request. Replays happen on one thread at a time
    (each model's scheduler worker), which is what sharing the pool needs; outputs are cloned by callers."""

    def __init__(self, device: torch.device, *, max_graphs: int = 48, capture_after: int = 1,
                 check_finite: bool = False) -> None:
        """``capture_after``: a shape is captured on its n-th run, before that it runs eagerly — for callers
        whose shapes often come once (the reranker's merged shortlists under load), where capturing every
        new shape cost more host time than it saved. ``check_finite``: a capture whose first output is not
        finite is dropped and its shape runs eagerly (one host sync per capture; the bulk caches)."""
        self.device, self.max_graphs, self.capture_after = device, max_graphs, capture_after
        self.check_finite = check_finite
        self._graphs: OrderedDict[Hashable, _Graph] = OrderedDict()
        self._uses: OrderedDict[Hashable, int] = OrderedDict()  # runs of shapes not captured yet (bounded)
        self._uncapturable: set[Hashable] = set()
        self._pool: Any = None
        self.counters = {"graph_replays": 0, "graph_captures": 0, "graph_capture_failures": 0, "graph_cold_runs": 0}

    def ready(self, key: Hashable, after: int) -> bool:
        """Counts one sighting of ``key`` and says whether it should run through the cache now: it has a graph,
        or this is at least its ``after``-th sighting (and it can be captured). For callers that run shapes
        seen once another way (ingestion's large passes: a mixed set's rarely repeat, a square set's always do)."""
        if key in self._graphs:
            return True
        return key not in self._uncapturable and self._sighted(key, after)

    def _sighted(self, key: Hashable, needed: int) -> bool:
        """Counts a run of a shape with no graph; True from its ``needed``-th on."""
        uses = self._uses.pop(key, 0) + 1
        self._uses[key] = uses  # most recent last: the oldest counts go first
        while len(self._uses) > 16 * self.max_graphs:
            self._uses.popitem(last=False)
        return uses >= needed

    def run(self, key: Hashable, inputs: dict[str, torch.Tensor],
            fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> torch.Tensor:
        entry = self._graphs.get(key)
        if (entry is None and self.capture_after > 1 and key not in self._uncapturable
                and not self._sighted(key, self.capture_after)):
            self.counters["graph_cold_runs"] += 1
            return fn(inputs)
        captured = False
        if entry is None and key not in self._uncapturable:
            try:
                entry = self._capture(key, inputs, fn)
                captured = True
            except RuntimeError as exc:
                log.warning("CUDA graph capture failed for %s, running it eagerly: %s", key, exc)
                self._uncapturable.add(key)
                self.counters["graph_capture_failures"] += 1
        if entry is None:
            return fn(inputs)
        self._graphs.move_to_end(key)
        if entry.inputs is not inputs:  # a fresh capture (or a caller's static inputs) holds these very tensors
            for name, tensor in inputs.items():
                entry.inputs[name].copy_(tensor, non_blocking=True)
        entry.graph.replay()
        self.counters["graph_replays"] += 1
        if captured and self.check_finite and not bool(torch.isfinite(entry.output).all()):
            log.warning("CUDA graph for %s gave non-finite values on its first replay; running it eagerly", key)
            del self._graphs[key]
            self._uncapturable.add(key)
            self.counters["graph_capture_failures"] += 1
            return fn(inputs)
        return entry.output

    def _capture(self, key: Hashable, inputs: dict[str, torch.Tensor],
                 fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> _Graph:
        with _CAPTURE_LOCK:
            return self._capture_alone(key, inputs, fn)

    def _capture_alone(self, key: Hashable, inputs: dict[str, torch.Tensor],
                       fn: Callable[[dict[str, torch.Tensor]], torch.Tensor]) -> _Graph:
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side), flash_only():  # warm-up off the capture: cuBLAS workspaces, Triton autotuning
            fn(inputs)
        torch.cuda.current_stream(self.device).wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        # thread_local: the tower and the other model keep launching work from their threads meanwhile
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"), flash_only():
            output = fn(inputs)
        entry = _Graph(graph, inputs, output)
        self._graphs[key] = entry
        self._uses.pop(key, None)  # counts are for shapes not captured yet
        self.counters["graph_captures"] += 1
        while len(self._graphs) > self.max_graphs:
            self._graphs.popitem(last=False)
        return entry


BULK_TOKENS = 32768  # 64 rows of up to 512 tokens: an ingestion batch of images up to 512 x 512 px


class GraphedLM:
    """Runs LM passes as CUDA-graph replays: any pass of at most ``max_tokens`` padded tokens (a search's), one
    graph per padded shape, and, when ``bulk_tokens`` is set (``LocalConfig.bulk_graphs``),
    larger ones up to it
    as packed passes (``packed.last_token_pass``, the eager ingestion pass) whose sizes are bucketed
    (``packed.pack_key``: at most 1/16 over), once their key comes back (``bulk_after`` sightings), where FlashAttention
    runs (half precision on a GPU: it reads the segments from the device). Why: launching a pass's ~1,400 kernels from
    Python competes for the GIL with the decoding, preprocessing and writing threads (in the ingestion pipeline, longer
    than the pass's own time), and an ingestion batch of same-size images is one key batch after batch, as are most
    batches of a mixed-size set (padded graphs keyed by exact shape seldom come back on it). A capture costs two passes
    (a warm-up and the replay), so a key is captured on its third sighting; photos stay eager (``bulk_width``, see
    ``graphed_tower``). The bulk cache keeps ``bulk_graphs`` graphs, four: a job's first claim of 8 and its batches of
    64 take two, a mixed set's one or two more; each holds its static packages (64 images at 448 px: ~200 MiB)."""

    def __init__(self, loaded: LoadedQwen, pad_id: int, *, max_tokens: int = 4096, max_graphs: int = 48,
                 bulk_tokens: int = 0, bulk_width: int = 1024, bulk_after: int = 3, bulk_graphs: int = 4) -> None:
        """``bulk_tokens`` 0: no bulk graphs (``LocalConfig.bulk_graphs`` sets :data:`BULK_TOKENS`); passes
        with a sequence longer than ``bulk_width`` (photos: ~1,830 tokens at 12 MP) stay eager, as in the tower."""
        self.loaded, self.pad_id, self.max_tokens = loaded, pad_id, max_tokens
        self.bulk_tokens, self.bulk_width, self.bulk_after = bulk_tokens, bulk_width, bulk_after
        self.graphs = GraphCache(loaded.device, max_graphs=max_graphs)
        self.bulk = GraphCache(loaded.device, max_graphs=bulk_graphs, check_finite=True)
        # Only FlashAttention reads the segments from the device: the loop that stands in for it elsewhere
        # (float32) copies masks from the host, which a capture refuses, and would keep the captured lengths.
        self._bulk = bool(bulk_tokens) and flash_varlen_works(loaded)

    @property
    def counters(self) -> dict[str, int]:
        return {**self.graphs.counters, **{f"bulk_{k}": v for k, v in self.bulk.counters.items()}}

    def _tokens(self, batch: Sequence[LMInput]) -> int:
        return bucket_rows(len(batch)) * round_width(max(len(x.ids) for x in batch))

    def fits(self, batch: Sequence[LMInput]) -> bool:
        """Whether :meth:`run` should take this pass (else the caller's eager, packed one): small passes
        always, large ones whose bucketed key has come ``bulk_after`` times (a sighting is counted here)."""
        if self._tokens(batch) <= self.max_tokens:
            return True
        if not self._bulk or max(len(x.ids) for x in batch) > self.bulk_width:
            return False
        key = pack_key(batch, bucketed=True)
        return key.tokens <= self.bulk_tokens and self.bulk.ready(key, self.bulk_after)

    def run(self, batch: Sequence[LMInput]) -> torch.Tensor:
        """``[len(batch), hidden]`` last-token states (model dtype), as :func:`forward.last_hidden_states`."""
        text = self.loaded.model.language_model
        if self._tokens(batch) > self.max_tokens:
            key = pack_key(batch, bucketed=True)
            tensors, segments = last_token_inputs(self.loaded, batch, self.pad_id, key)
            out = self.bulk.run(key, tensors, lambda t: last_token_pass(text, t, key, segments))
            return out[: len(batch)].clone()
        shape = shape_of(self.loaded, batch)
        inputs = prepare(self.loaded, batch, self.pad_id, shape)
        out = self.graphs.run(shape, vars(inputs), lambda t: decoder_pass(self.loaded.model, Batch(**t)))
        return out[: len(batch)].clone()
