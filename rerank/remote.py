"""Qwen3-VL-Reranker served by vLLM (yes/no classifier conversion), behind the :class:`Reranker` seam.

The server runs ``--runner pooling`` with the ``Qwen3VLForSequenceClassification`` overrides and
rerank/templates/qwen3_vl_reranker.jinja (docs/vllm-notes.md); ``/rerank`` then returns
sigmoid(logit_yes - logit_no) of the official prompt, as the local backend computes it.

Images follow the embedder's rule (:class:`retrieval.remote.images.RemoteImages`): packages of this
checkpoint's tower go as validated ``image_embeds``, other images raw. vLLM refuses a pair whose query
and document mix the two forms, so a pair is all-packages or all-raw (a pair without images joins the
packages call); pairs are grouped by (query, instruction, form) into one ``/rerank`` call each, and the
calls run concurrently.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rubricsearch.rerank.protocol import Pair, official_pairs
from rubricsearch.rerank.vllm_client import RerankInput, VLLMRerankClient, rerank_input
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.packages import ModelPackages, PackageStore, Usage, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    PreprocessMode,
    VisionEncoder,
)
from rubricsearch.retrieval.qwen.model.loading import public_model_id
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.remote.images import RemoteImages, checkpoint_revision, part_bytes, refused_key
from rubricsearch.retrieval.remote.vllm_client import Part, budget_chunks

QueryKey = tuple[tuple[str, ...], tuple[str, ...], str | None]
GroupKey = tuple[tuple[str, ...], tuple[str, ...], str | None, bool]


class VLLMReranker:
    """``score(query, documents, instruction)`` through a vLLM ``/rerank`` server."""

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
        role: str = "reranker",
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        device: str | None = None,
        dtype: str | None = None,
        send_packages: bool = True,
        local_vision: bool = False,
        preprocess: PreprocessMode = "official",
        package_keys: bool = True,
        max_request_bytes: int = 64 << 20,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> None:
        self.max_request_bytes = max_request_bytes
        self.client = VLLMRerankClient.connect(base_url, served_model or str(model_path_or_id), api_key=api_key,
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
            self.images.probe_keys(lambda part: self.client.rerank("probe", [rerank_input([part], [])], None)[0])
        except BaseException:
            self.client.close()
            raise
        self.model_id = public_model_id(model_path_or_id)
        self.revision = checkpoint_revision(self.images.root)
        self.image_max_bytes = image_max_bytes
        self.image_max_pixels = image_max_pixels
        self._lock = threading.Lock()
        self.counters = {"requests": 0, "scored_pairs": 0}

    @property
    def packages(self) -> ModelPackages:
        return self.images.view

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.images.stats(), **self.counters}

    def health(self) -> bool:
        return self.client.health()

    def pending(self) -> int:
        """0: the vLLM server queues and schedules its own work (its limits apply there)."""
        return 0

    def close(self) -> None:
        self.client.close()

    def score(self, query: Any, documents: Sequence[Any], instruction: str | None = None, *,
              truncate: bool = True, usage: Usage | None = None) -> list[float]:
        return self.score_pairs(official_pairs(query, documents, instruction, max_bytes=self.image_max_bytes,
                                               max_pixels=self.image_max_pixels), truncate=truncate, usage=usage)

    def score_pairs(self, pairs: Sequence[Pair], *, usage: Usage | None = None,
                    truncate: bool = True) -> list[float]:
        if not pairs:
            return []
        embeds = self.images.embeds((img for p in pairs for img in (*p.query.images, *p.document.images)), usage)
        groups: dict[GroupKey, list[int]] = {}
        for key, rows in self._by_query(pairs).items():
            forms = {r: self._form(pairs[r], embeds) for r in rows}
            neutral = any(f is True for f in forms.values())  # image-free pairs join the packages call
            for r in rows:
                use = neutral if forms[r] is None else bool(forms[r])
                groups.setdefault((*key, use), []).append(r)
        raw_cache: dict[str, Part] = {}
        calls: list[tuple[RerankInput, list[RerankInput], str | None, list[int]]] = []
        for (_, _, instruction, use), rows in groups.items():
            query = self._side(pairs[rows[0]].query, embeds, use, raw_cache)
            docs = [self._side(pairs[r].document, embeds, use, raw_cache) for r in rows]
            budget = self.max_request_bytes - input_bytes(query)
            for chunk in budget_chunks([input_bytes(d) for d in docs], budget, self.client.max_batch):
                calls.append((query, docs[chunk.start:chunk.stop], instruction, rows[chunk.start:chunk.stop]))
        scores: list[float] = [0.0] * len(pairs)

        def ask(query: RerankInput, docs: list[RerankInput], instruction: str | None) -> list[float]:
            try:
                return self.client.rerank(query, docs, instruction)
            except InvalidInput as exc:  # /rerank cannot write NaN into JSON: it says so with a 400
                if not refused_key(exc):
                    raise
                return [math.nan] * len(docs)

        def run(call: tuple[RerankInput, list[RerankInput], str | None, list[int]]) -> None:
            query, docs, instruction, rows = call
            got = ask(query, docs, instruction)
            if not all(map(math.isfinite, got)):  # the server refused a key (its file changed after the check)
                self.images.server_refused((img for r in rows for img in (*pairs[r].query.images,
                                                                           *pairs[r].document.images)), embeds, usage)
                query = self._side(pairs[rows[0]].query, embeds, False, raw_cache)
                got = ask(query, [self._side(pairs[r].document, embeds, False, raw_cache) for r in rows], instruction)
                if not all(map(math.isfinite, got)):
                    raise BackendUnavailable("the vLLM reranker returned non-finite scores for raw images: a NaN it "
                                             "served for a refused package key stays in its state; restart it")
            for r, s in zip(rows, got, strict=True):
                scores[r] = s

        if len(calls) == 1:
            run(calls[0])
        else:
            with ThreadPoolExecutor(max_workers=min(self.client.max_concurrency, len(calls))) as pool:
                list(pool.map(run, calls))
        with self._lock:
            self.counters["requests"] += len(calls)
            self.counters["scored_pairs"] += len(pairs)
        return scores

    @staticmethod
    def _by_query(pairs: Sequence[Pair]) -> dict[QueryKey, list[int]]:
        groups: dict[QueryKey, list[int]] = {}
        for i, p in enumerate(pairs):
            key = (tuple(p.query.texts), tuple(img.sha256 for img in p.query.images), p.instruction)
            groups.setdefault(key, []).append(i)
        return groups

    def _form(self, pair: Pair, embeds: dict[str, Part]) -> bool | None:
        """True: all the pair's images go as packages; False: all raw; None: the pair has no image."""
        images = [*pair.query.images, *pair.document.images]
        return self.images.all_embedded(images, embeds) if images else None

    def _side(self, content: Content, embeds: dict[str, Part], use: bool, cache: dict[str, Part]) -> RerankInput:
        return rerank_input(self.images.parts(content.images, embeds, use, cache), content.texts)


def input_bytes(side: RerankInput) -> int:
    """Approximate request bytes of one query or document."""
    if isinstance(side, str):
        return len(side) + 32
    return sum(part_bytes(p) for p in side["content"])
