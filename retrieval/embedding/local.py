"""Local (transformers) Qwen3-VL-Embedding, faithful to the official ``Qwen3VLEmbedder``.

Differences from the official class are deliberate and output-neutral: images go through the package
stage (vision tower at most once per image, tower and settings), inputs are batched by length, and the
same image used by several items in one call is encoded once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from rubricsearch.retrieval.embedding.protocol import matryoshka
from rubricsearch.retrieval.errors import InputTooLong, InvalidInput
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.inputs import parse_embed_items
from rubricsearch.retrieval.packages import ModelPackages, PackageStore, Usage, VisualPackages
from rubricsearch.retrieval.qwen.engine.batching import LMScheduler
from rubricsearch.retrieval.qwen.engine.forward import LMInput, download
from rubricsearch.retrieval.qwen.engine.graphed_lm import BULK_TOKENS, GraphedLM
from rubricsearch.retrieval.qwen.engine.vision import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    PreprocessMode,
    VisionEncoder,
)
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.qwen.model.prompts import EMBED_DEFAULT_INSTRUCTION, Content, Tokenizer, embed_conversation


class LocalEmbedder:
    """``embed(items, dimensions)`` over a loaded checkpoint; see :func:`retrieval.load_embedder`."""

    def __init__(
        self,
        loaded: LoadedQwen,
        *,
        packages: VisualPackages | None = None,
        store: PackageStore | None = None,
        vision: VisionEncoder | None = None,
        preprocess: PreprocessMode = "official",
        role: str = "embedding",
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        default_instruction: str = EMBED_DEFAULT_INSTRUCTION,
        max_length: int = 8192,
        batch_size: int | None = None,
        lm_workers: int | None = None,
        max_batch_tokens: int | None = None,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
        cuda_graphs: bool = False,
        bulk_graphs: bool = False,
    ) -> None:
        self.loaded = loaded
        self.vision = vision or VisionEncoder(loaded, min_pixels=min_pixels, max_pixels=max_pixels,
                                              preprocess=preprocess, cuda_graphs=cuda_graphs,
                                              bulk_graphs=bulk_graphs)
        service = packages or VisualPackages(store or PackageStore(storage_dtype=_dtype_name(loaded.dtype)))
        self._packages = service.register(role, self.vision.fingerprint, self.vision)
        self.model_id = loaded.model_id
        self.revision = loaded.revision
        self.dimension = loaded.hidden_size
        self.default_instruction = default_instruction
        self.max_length = max_length
        self.batch_size = batch_size or (64 if loaded.device.type == "cuda" else 16)
        self.max_batch_tokens = max_batch_tokens or (65536 if loaded.device.type == "cuda" else 16384)
        self.image_max_bytes = image_max_bytes
        self.image_max_pixels = image_max_pixels
        self.tokenizer = Tokenizer(loaded.processor, loaded.image_token_id)
        self.pad_id = int(loaded.processor.tokenizer.pad_token_id or 0)
        # Every forward pass of this model goes through one scheduler, merged with other requests' passes.
        # On a GPU, small passes (a search's candidate, an instruction list) replay CUDA graphs.
        self.cuda_graphs = cuda_graphs and loaded.device.type == "cuda"
        # With bulk_graphs, ingestion's large passes too, once their bucketed key comes a third time.
        graphs = GraphedLM(loaded, self.pad_id, bulk_tokens=BULK_TOKENS if bulk_graphs else 0) \
            if self.cuda_graphs else None
        self.scheduler = LMScheduler(loaded, self.pad_id, max_batch=self.batch_size, max_tokens=self.max_batch_tokens,
                                     graphs=graphs, workers=lm_workers)
        self._lock = threading.Lock()  # the counters only
        self.counters = {"embedded_items": 0, "lm_tokens": 0}

    @property
    def packages(self) -> ModelPackages:
        return self._packages

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self._packages.stats(), **self.counters, **self.scheduler.stats}

    def pending(self) -> int:
        """Work waiting for the device (admission control reads it)."""
        return self.scheduler.depth()

    def health(self) -> bool:
        return True

    def close(self) -> None:
        """Nothing to release (the weights go with the object)."""

    def embed(self, items: Sequence[Any], dimensions: int | None = None, *, truncate: bool = True,
              usage: Usage | None = None) -> np.ndarray:
        contents, instructions = parse_embed_items(items, max_bytes=self.image_max_bytes,
                                                   max_pixels=self.image_max_pixels)
        return self.embed_contents(contents, instructions, dimensions, truncate=truncate, usage=usage)

    def embed_contents(
        self,
        contents: Sequence[Content],
        instructions: Sequence[str | None],
        dimensions: int | None = None,
        *,
        usage: Usage | None = None,
        truncate: bool = True,
    ) -> np.ndarray:
        """Embed already-parsed content (the search service calls this with decoded images)."""
        if len(contents) != len(instructions):
            raise InvalidInput("one instruction (or None) per item is required")
        if not contents:
            return np.zeros((0, dimensions or self.dimension), dtype=np.float32)
        inputs = self._prepare(contents, instructions, usage, truncate)
        hidden = self.scheduler.run(inputs)
        vectors = download(torch.nn.functional.normalize(hidden, p=2, dim=-1)).numpy().astype(np.float32)
        with self._lock:
            self.counters["embedded_items"] += len(inputs)
            self.counters["lm_tokens"] += sum(len(x.ids) for x in inputs)
        if usage is not None:
            usage.add_tokens(sum(len(x.ids) for x in inputs))
        return matryoshka(vectors, dimensions, self.dimension)

    def _prepare(self, contents: Sequence[Content], instructions: Sequence[str | None],
                 usage: Usage | None, truncate: bool = True) -> list[LMInput]:
        all_images = [img for c in contents for img in c.images]
        packages = iter(self._packages.get_or_encode(all_images, usage=usage))
        inputs = []
        for content, instruction in zip(contents, instructions, strict=True):
            conversation = embed_conversation(content, instruction, self.default_instruction)
            prompt = self.tokenizer.render(conversation, content.images)
            pkgs = [next(packages) for _ in content.images]
            ids = self.tokenizer.ids(prompt, pkgs)
            if len(ids) > self.max_length:
                if not truncate:
                    raise InputTooLong(f"input is {len(ids)} tokens; the limit is {self.max_length} (ask for "
                                       "truncation to cut it)", tokens=len(ids), limit=self.max_length)
                if pkgs:
                    raise InvalidInput(
                        f"input is {len(ids)} tokens with its images; the limit is {self.max_length} "
                        "(lower max_pixels or shorten the text)"
                    )
                ids = ids[: self.max_length]  # the official processor truncates text the same way
            inputs.append(LMInput(ids=ids, packages=pkgs))
        return inputs


def _dtype_name(dtype: torch.dtype) -> Any:
    name = str(dtype).removeprefix("torch.")
    return name if name in ("float32", "bfloat16") else "float32"
