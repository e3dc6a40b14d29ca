"""The vLLM runtime: Qwen3-VL served by vLLM over HTTP, behind the same seam as the local runtime.

From the task classes' side it is :class:`~retrieval.runtime.local.LocalRuntime`: the official prompt
(finished instruction, images then texts, "NULL" when empty, generation prompt) and the same stats keys
for the package stage. Images go as validated packages, package keys or resized raw images
(:class:`~retrieval.remote.images.RemoteImages`); a NaN the server answers for a refused key is retried raw.

``vision=`` passes a worker in (a :func:`~retrieval.qwen.engine.vision_only.vision_only` of this checkpoint's
tower); ``local_vision`` builds one when the weights are local. With a worker this model's packages
are made here, and ingestion can build them and embed remotely.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.packages import ModelPackages, Usage, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import public_model_id
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.remote.images import RemoteImages, checkpoint_revision, conversation_bytes
from rubricsearch.retrieval.remote.vllm_client import (
    Message,
    Part,
    VLLMClient,
    budget_chunks,
    embedding_conversation,
    text_part,
)
from rubricsearch.retrieval.runtime.config import VisionConfig, VLLMConfig
from rubricsearch.retrieval.runtime.core import Truncation


class VLLMRuntime:
    """The :class:`~retrieval.runtime.seam.Runtime` over a vLLM ``/v1/embeddings`` server."""

    client: VLLMClient

    def __init__(
        self,
        model_path_or_id: str,
        config: VLLMConfig,
        vision_config: VisionConfig,
        *,
        role: str,
        packages: VisualPackages | None = None,
        vision: VisionEncoder | None = None,
    ) -> None:
        self.max_request_bytes = config.max_request_bytes
        self.client = self._connect(model_path_or_id, config)
        try:
            self.images = RemoteImages(model_path_or_id, role=role, packages=packages, vision=vision,
                                       vision_config=vision_config, device=config.device, dtype=config.dtype,
                                       send_packages=config.send_packages, local_vision=config.local_vision,
                                       package_keys=config.package_keys)
            self.model_id = public_model_id(model_path_or_id)
            self.revision = checkpoint_revision(self.images.root)
            self.images.probe_keys(self._probe)
            self.dimension = self._width()
        except BaseException:
            self.client.close()
            raise
        self._lock = threading.Lock()
        self.counters = {"requests": 0}

    def _connect(self, model_path_or_id: str, config: VLLMConfig) -> VLLMClient:
        return VLLMClient.connect(config.base_url, config.served_model or str(model_path_or_id),
                                  api_key=config.api_key, connect_timeout=config.connect_timeout,
                                  read_timeout=config.read_timeout, max_retries=config.max_retries,
                                  max_concurrency=config.max_concurrency, max_batch=config.max_batch)

    def _probe(self, part: Part) -> Any:
        """One request with ``part`` as the only image: the server's answer to a package key."""
        return self.client.embed_messages([embedding_conversation("probe", [part])])[0]

    def _width(self) -> int:
        """The checkpoint's hidden size; without a local config, the served model tells its width."""
        text_cfg = self.images.config.get("text_config") or {}
        return int(text_cfg.get("hidden_size") or 0) or int(
            self.client.embed_messages([embedding_conversation("probe", [])]).shape[1])

    @property
    def packages(self) -> ModelPackages:
        return self.images.view

    def load(self) -> tuple[int, dict[str, int]]:
        """Nothing queued here: the vLLM server queues and schedules its own work (its limits apply there)."""
        with self._lock:
            return 0, {**self.images.stats(), **self.counters}

    def health(self) -> bool:
        return self.client.health()

    def close(self) -> None:
        self.client.close()

    def count_requests(self, n: int) -> None:
        with self._lock:
            self.counters["requests"] += n

    def embed(self, contents: Sequence[Content], instructions: Sequence[str], *, usage: Usage | None,
              truncation: Truncation) -> np.ndarray:
        """The server renders the prompt and applies its own token limit (``truncation`` is the local runtime's)."""
        embeds = self.images.embeds((img for c in contents for img in c.images), usage)
        raw_cache: dict[str, Part] = {}

        def conversation(content: Content, instruction: str, use: bool) -> list[Message]:
            parts = self.images.parts(content.images, embeds, use, raw_cache)
            parts += [text_part(t) for t in content.texts if t]
            return embedding_conversation(instruction, parts)

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
        return vectors

    def _embed_batch(self, batch: list[list[Message]]) -> np.ndarray:
        """Conversations in requests bounded by bytes and count, sent concurrently."""
        chunks = budget_chunks([conversation_bytes(c) for c in batch], self.max_request_bytes, self.client.max_batch)
        if len(chunks) == 1:
            vectors = self.client.embed_messages(batch)
        else:
            with ThreadPoolExecutor(max_workers=min(self.client.max_concurrency, len(chunks))) as pool:
                vectors = np.concatenate(list(pool.map(lambda r: self.client.embed_messages(batch[r.start:r.stop]),
                                                       chunks)))
        self.count_requests(len(chunks))
        return vectors
