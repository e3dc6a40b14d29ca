"""Qwen3-VL-Embedding served by vLLM, behind the same :class:`Embedder` seam as the local backend.

From the outside it is :class:`~retrieval.embedding.local.LocalEmbedder`: the same item shapes, the
official prompt (finished instruction, images then texts, "NULL" when empty, generation prompt), the
same Matryoshka rule (client-side truncate + renormalise in float32) and the same stats keys. Images go
as validated packages or resized raw images (:class:`~retrieval.remote.images.RemoteImages`).

``vision=`` passes a worker in (a :class:`~retrieval.qwen.engine.vision_only.VisionOnly` of this checkpoint's
tower); ``local_vision=True`` builds one when the weights are local. With a worker this model's packages
are made here, and ingestion can build them and embed remotely.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rubricsearch.retrieval.embedding.protocol import matryoshka
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.inputs import parse_embed_items
from rubricsearch.retrieval.packages import ModelPackages, PackageStore, Usage, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    PreprocessMode,
    VisionEncoder,
)
from rubricsearch.retrieval.qwen.model.loading import public_model_id
from rubricsearch.retrieval.qwen.model.prompts import EMBED_DEFAULT_INSTRUCTION, Content, finish_instruction
from rubricsearch.retrieval.remote.images import RemoteImages, checkpoint_revision, conversation_bytes
from rubricsearch.retrieval.remote.vllm_client import (
    Message,
    Part,
    VLLMClient,
    budget_chunks,
    embedding_conversation,
    text_part,
)


class VLLMEmbedder:
    """``embed(items, dimensions)`` through a vLLM ``/v1/embeddings`` server; see the module docstring."""

    def __init__(
        self,
        model_path_or_id: str,
        *,
        base_url: str,
        served_model: str | None = None,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        max_retries: int = 3,
        max_concurrency: int = 4,
        max_batch: int = 32,
        packages: VisualPackages | None = None,
        store: PackageStore | None = None,
        vision: VisionEncoder | None = None,
        role: str = "embedding",
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        device: str | None = None,
        dtype: str | None = None,
        default_instruction: str = EMBED_DEFAULT_INSTRUCTION,
        send_packages: bool = True,
        local_vision: bool = False,
        preprocess: PreprocessMode = "official",
        package_keys: bool = True,
        max_request_bytes: int = 64 << 20,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> None:
        self.max_request_bytes = max_request_bytes
        self.client = VLLMClient.connect(base_url, served_model or str(model_path_or_id), api_key=api_key,
                                         connect_timeout=connect_timeout, read_timeout=read_timeout,
                                         max_retries=max_retries, max_concurrency=max_concurrency,
                                         max_batch=max_batch)
        try:
            if packages is None and store is not None:
                packages = VisualPackages(store)
            self.images = RemoteImages(model_path_or_id, role=role, packages=packages, vision=vision,
                                       min_pixels=min_pixels, max_pixels=max_pixels, device=device, dtype=dtype,
                                       send_packages=send_packages, local_vision=local_vision,
                                       preprocess=preprocess, package_keys=package_keys)
            self.model_id = public_model_id(model_path_or_id)
            self.revision = checkpoint_revision(self.images.root)
            self.default_instruction = default_instruction
            self.image_max_bytes = image_max_bytes
            self.image_max_pixels = image_max_pixels
            self.images.probe_keys(
                lambda part: self.client.embed_messages([embedding_conversation("probe", [part])])[0])
            text_cfg = self.images.config.get("text_config") or {}
            self.dimension = int(text_cfg.get("hidden_size") or 0) or self._probe_dimension()
        except BaseException:
            self.client.close()
            raise
        self._requests = 0
        self._lock = threading.Lock()

    def _probe_dimension(self) -> int:
        """Without a local config, the served model tells its width."""
        return int(self.client.embed_messages([embedding_conversation(self.default_instruction, [])]).shape[1])

    @property
    def packages(self) -> ModelPackages:
        return self.images.view

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.images.stats(), "requests": self._requests}

    def health(self) -> bool:
        return self.client.health()

    def pending(self) -> int:
        """0: the vLLM server queues and schedules its own work (its limits apply there)."""
        return 0

    def close(self) -> None:
        self.client.close()

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
        matryoshka(np.zeros((0, self.dimension), dtype=np.float32), dimensions, self.dimension)  # validate first
        if not contents:
            return np.zeros((0, dimensions or self.dimension), dtype=np.float32)
        embeds = self.images.embeds((img for c in contents for img in c.images), usage)
        raw_cache: dict[str, Part] = {}

        def conversation(content: Content, instruction: str | None, use: bool) -> list[Message]:
            parts = self.images.parts(content.images, embeds, use, raw_cache)
            parts += [text_part(t) for t in content.texts if t]
            return embedding_conversation(finish_instruction(instruction, self.default_instruction), parts)

        uses = [self.images.all_embedded(c.images, embeds) for c in contents]
        vectors = self._embed_batch([conversation(c, i, u) for c, i, u in zip(contents, instructions, uses,
                                                                              strict=True)])
        bad = [int(r) for r in np.flatnonzero(~np.isfinite(vectors).all(axis=1))]
        if bad:  # NaN: the server refused a package key (its file changed after the client's check); raw again
            self.images.server_refused([img for r in bad if uses[r] for img in contents[r].images], embeds, usage)
            vectors[bad] = self._embed_batch([conversation(contents[r], instructions[r], False) for r in bad])
            bad = [int(r) for r in np.flatnonzero(~np.isfinite(vectors).all(axis=1))]
        if bad:
            raise BackendUnavailable("the vLLM embedding server returned non-finite vectors for raw images: a NaN it "
                                     "served for a refused package key stays in its state; restart it",
                                     rows=bad[:16])
        vectors = vectors.astype(np.float32)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # the seam's contract
        return matryoshka(vectors, dimensions, self.dimension)

    def _embed_batch(self, batch: list[list[Message]]) -> np.ndarray:
        """Conversations in requests bounded by bytes and count, sent concurrently."""
        chunks = budget_chunks([conversation_bytes(c) for c in batch], self.max_request_bytes, self.client.max_batch)
        if len(chunks) == 1:
            vectors = self.client.embed_messages(batch)
        else:
            with ThreadPoolExecutor(max_workers=min(self.client.max_concurrency, len(chunks))) as pool:
                vectors = np.concatenate(list(pool.map(lambda r: self.client.embed_messages(batch[r.start:r.stop]),
                                                       chunks)))
        with self._lock:
            self._requests += len(chunks)
        return vectors
