"""Qwen3-VL-Embedding served by vLLM, behind the same :class:`Embedder` seam as the local backend.

From the outside it is :class:`~retrieval.embedding.local.LocalEmbedder`: the same item shapes, the
official prompt (finished instruction, images then texts, "NULL" when empty, generation prompt), the
same Matryoshka rule (client-side truncate + renormalise in float32) and the same stats keys.

Images travel in one of two forms, never mixed within one message (vLLM refuses that with a 400):
- ``image_embeds``: the image's visual package from the local :class:`PackageStore`, looked up under the
  fingerprint of THIS checkpoint's vision tower (computed from the weights by the vision-only worker,
  never guessed). With a vision-only worker a missing package is computed once, stored and sent. So the
  server runs no vision for a cached image. Every package passes ``mm_embeds`` validation first: a bad
  shape would kill the vLLM engine, so a refused package falls back to the raw image.
- ``image_url``: the image resized the official way (``qwen_vl_utils.fetch_image``), sent as PNG.

``vision=`` passes a worker in (one :class:`~retrieval.qwen.vision_only.VisionOnly` of this checkpoint);
``local_vision=True`` builds one when the weights are local. With a worker the backend exposes it as
``.vision``, like the local backend, so ingestion can make packages here and embed remotely.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np

from retrieval.embedding.protocol import matryoshka
from retrieval.errors import BackendUnavailable, ImageError, InvalidInput, PackageMismatch
from retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS, ImageLike
from retrieval.inputs import parse_embed_items
from retrieval.packages import Fingerprint, PackageStore
from retrieval.qwen.prompts import EMBED_DEFAULT_INSTRUCTION, Content, finish_instruction
from retrieval.qwen.vision import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VisionEncoder
from retrieval.remote.mm_embeds import ServedVisionSpec, image_embeds_part, payload_bytes, resized_image_part
from retrieval.remote.vllm_client import Message, Part, VLLMClient, embedding_conversation, text_part

log = logging.getLogger("rubricsearch.remote")


def local_checkpoint(path_or_id: str) -> Path | None:
    """The checkpoint's local directory (a path, or a hub id in the HF cache), else None."""
    from retrieval.qwen.vision_only import checkpoint_dir

    try:
        return checkpoint_dir(path_or_id)
    except BackendUnavailable:
        return None


def checkpoint_revision(root: Path | None) -> str:
    """As ``load_qwen`` reports it: test-checkpoint card, hub snapshot commit, else "local"."""
    from retrieval.qwen.loading import _revision

    if root is None:
        return "remote"
    commit = root.name if root.parent.name == "snapshots" else None
    return _revision(str(root), SimpleNamespace(_commit_hash=commit))


class RemoteImages:
    """Images -> vLLM content parts (validated packages or resized raw images), with the counters.

    Shared by the vLLM embedder and reranker: the rule for when a package may be sent lives here once.
    """

    def __init__(
        self,
        model_path_or_id: str,
        *,
        store: PackageStore | None,
        vision: VisionEncoder | None,
        min_pixels: int,
        max_pixels: int,
        device: str | None,
        dtype: str | None,
        send_packages: bool,
        local_vision: bool = False,
    ) -> None:
        if min_pixels > max_pixels:
            raise ValueError("min_pixels must not exceed max_pixels")
        self.root = local_checkpoint(model_path_or_id)
        self.config: dict[str, Any] = json.loads((self.root / "config.json").read_text()) if self.root else {}
        vision_cfg = self.config.get("vision_config") or {}
        self.patch_size = int(vision_cfg.get("patch_size", 16))
        self.min_pixels, self.max_pixels = min_pixels, max_pixels
        self.send_packages = send_packages
        self.spec = ServedVisionSpec.from_config(self.config) if self.config else None
        if vision is None and local_vision and send_packages and self.root is not None:
            from retrieval.qwen.loading import resolve_device, resolve_dtype
            from retrieval.qwen.vision_only import VisionOnly

            compute = str(resolve_dtype(dtype, resolve_device(device))).removeprefix("torch.")
            store = store or PackageStore(storage_dtype="bfloat16" if compute == "bfloat16" else "float32")
            vision = VisionOnly(self.root, store, device=device, dtype=dtype,
                                min_pixels=min_pixels, max_pixels=max_pixels)
        if vision is not None:
            self._check_vision(vision, model_path_or_id)
            if store is not None and store is not vision.store:
                raise ValueError("give the vision worker the same PackageStore as the backend")
            store = vision.store
        self.vision = vision
        self.store = store
        self.fingerprint: Fingerprint | None = None
        if send_packages and store is not None and self.spec is not None:
            if vision is not None:
                self.fingerprint = vision.fingerprint
            else:  # read-only use of the store: the key still comes from the real tower weights
                from retrieval.qwen.vision_only import vision_fingerprint

                assert self.root is not None
                self.fingerprint = vision_fingerprint(self.root, device=device, dtype=dtype,
                                                      min_pixels=min_pixels, max_pixels=max_pixels)
        elif send_packages and (store is not None or local_vision):
            log.warning("checkpoint %s is not available locally: images are sent raw to vLLM", model_path_or_id)
        self._lock = threading.Lock()
        self.counters = {"vision_encodes": 0, "package_hits": 0, "package_misses": 0, "packages_refused": 0,
                         "remote_images_raw": 0, "remote_images_embeds": 0}

    def _check_vision(self, vision: VisionEncoder, model_path_or_id: str) -> None:
        """Packages must come from this checkpoint's tower at these pixel bounds."""
        mine = self.root.resolve() if self.root else None
        theirs = local_checkpoint(vision.loaded.model_id)
        if mine is None or theirs is None or theirs.resolve() != mine:
            raise ValueError(f"the vision worker was loaded from {vision.loaded.model_id!r}, "
                             f"not from this model's checkpoint {model_path_or_id!r}")
        if (vision.min_pixels, vision.max_pixels) != (self.min_pixels, self.max_pixels):
            raise ValueError("the vision worker's min/max pixels differ from the backend's")

    def count(self, key: str, n: int = 1) -> None:
        with self._lock:
            self.counters[key] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self.counters)

    def embeds(self, images: Iterable[ImageLike]) -> dict[str, Part]:
        """Validated ``image_embeds`` parts (by sha256) for the images that have, or now get, a package."""
        if self.fingerprint is None or self.store is None or self.spec is None:
            return {}
        distinct = {img.sha256: img for img in images}
        found, missing = {}, {}
        for sha, img in distinct.items():
            pkg = self.store.get(sha, self.fingerprint)
            if pkg is None:
                missing[sha] = img
            else:
                found[sha] = pkg
        self.count("package_hits", len(found))
        self.count("package_misses", len(missing))
        if missing and self.vision is not None:
            for pkg in self.vision.encode(list(missing.values())):
                found[pkg.image_sha256] = self.store.put(pkg)
            self.count("vision_encodes", len(missing))
        parts: dict[str, Part] = {}
        for sha, pkg in found.items():
            try:
                parts[sha] = image_embeds_part(pkg.embeds, pkg.deepstack, pkg.grid_thw, self.spec,
                                               uuid=f"rs-{sha}-{self.fingerprint.digest()}-{pkg.embeds.dtype}")
            except PackageMismatch as exc:  # never sent; the image goes raw instead
                self.count("packages_refused")
                log.warning("package of image %s refused (%s); sending the image instead", sha[:12], exc)
        return parts

    def raw(self, img: ImageLike, cache: dict[str, Part]) -> Part:
        part = cache.get(img.sha256)
        if part is None:
            try:
                part = resized_image_part(img.image, min_pixels=self.min_pixels, max_pixels=self.max_pixels,
                                          patch_size=self.patch_size,
                                          uuid=f"rs-{img.sha256}-px{self.min_pixels}-{self.max_pixels}")
            except ValueError as exc:  # e.g. aspect ratio above 200, as in VisionEncoder.preprocess
                raise ImageError(f"image {img.sha256[:12]} cannot be resized for the model: {exc}") from exc
            cache[img.sha256] = part
        return part

    @staticmethod
    def all_embedded(images: Iterable[ImageLike], embeds: dict[str, Part]) -> bool:
        return all(img.sha256 in embeds for img in images)

    def parts(self, images: Sequence[ImageLike], embeds: dict[str, Part], use_embeds: bool,
              cache: dict[str, Part]) -> list[Part]:
        """One form for all of ``images``: their packages when ``use_embeds``, else raw images."""
        if use_embeds:
            self.count("remote_images_embeds", len(images))
            return [embeds[img.sha256] for img in images]
        self.count("remote_images_raw", len(images))
        return [self.raw(img, cache) for img in images]


def part_bytes(part: Part) -> int:
    """Approximate request bytes of one content part (packages dominate: base64 tensors)."""
    if part.get("type") == "image_embeds":
        return payload_bytes(part)
    if part.get("type") == "image_url":
        return len(part["image_url"]["url"]) + 64
    return len(str(part.get("text", ""))) + 32


def conversation_bytes(conversation: Sequence[Message]) -> int:
    return sum(part_bytes(p) for m in conversation for p in m["content"])


def budget_chunks(sizes: Sequence[int], budget: int, max_items: int) -> list[range]:
    """Consecutive index ranges of at most ``max_items`` whose sizes sum to at most ``budget``.

    A 2B-model package of a large image is tens of MB in base64, so request bodies are bounded by bytes
    as well as by count; an item larger than the budget goes alone.
    """
    chunks, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > budget or i - start >= max_items):
            chunks.append(range(start, i))
            start, total = i, 0
        total += size
    chunks.append(range(start, len(sizes)))
    return chunks


def make_client(model_path_or_id: str, served_model: str | None, base_url: str, **kwargs: Any) -> VLLMClient:
    """A client whose server is checked now: down or serving another model -> BackendUnavailable."""
    client = VLLMClient(base_url, served_model or str(model_path_or_id), **kwargs)
    try:
        client.check_model()
    except BaseException:
        client.close()
        raise
    return client


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
        store: PackageStore | None = None,
        vision: VisionEncoder | None = None,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        device: str | None = None,
        dtype: str | None = None,
        default_instruction: str = EMBED_DEFAULT_INSTRUCTION,
        send_packages: bool = True,
        local_vision: bool = False,
        max_request_bytes: int = 64 << 20,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> None:
        self.max_request_bytes = max_request_bytes
        self.client = make_client(model_path_or_id, served_model, base_url, api_key=api_key,
                                  connect_timeout=connect_timeout, read_timeout=read_timeout,
                                  max_retries=max_retries, max_concurrency=max_concurrency, max_batch=max_batch)
        try:
            self.images = RemoteImages(model_path_or_id, store=store, vision=vision, min_pixels=min_pixels,
                                       max_pixels=max_pixels, device=device, dtype=dtype,
                                       send_packages=send_packages, local_vision=local_vision)
            self.model_id = str(model_path_or_id)
            self.revision = checkpoint_revision(self.images.root)
            self.default_instruction = default_instruction
            self.image_max_bytes = image_max_bytes
            self.image_max_pixels = image_max_pixels
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
    def vision(self) -> VisionEncoder:
        """The local vision-only worker; AttributeError without one (so ``hasattr`` tells ingestion)."""
        if self.images.vision is None:
            raise AttributeError("this vLLM embedder has no local vision worker")
        return self.images.vision

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            return {**self.images.stats(), "requests": self._requests}

    def health(self) -> bool:
        return self.client.health()

    def close(self) -> None:
        self.client.close()

    def embed(self, items: Sequence[Any], dimensions: int | None = None) -> np.ndarray:
        contents, instructions = parse_embed_items(items, max_bytes=self.image_max_bytes,
                                                   max_pixels=self.image_max_pixels)
        return self.embed_contents(contents, instructions, dimensions)

    def embed_contents(
        self, contents: Sequence[Content], instructions: Sequence[str | None], dimensions: int | None = None
    ) -> np.ndarray:
        """Embed already-parsed content (the search service calls this with decoded images)."""
        if len(contents) != len(instructions):
            raise InvalidInput("one instruction (or None) per item is required")
        matryoshka(np.zeros((0, self.dimension), dtype=np.float32), dimensions, self.dimension)  # validate first
        if not contents:
            return np.zeros((0, dimensions or self.dimension), dtype=np.float32)
        embeds = self.images.embeds(img for c in contents for img in c.images)
        raw_cache: dict[str, Part] = {}
        batch = []
        for content, instruction in zip(contents, instructions, strict=True):
            use = self.images.all_embedded(content.images, embeds)
            parts = self.images.parts(content.images, embeds, use, raw_cache)
            parts += [text_part(t) for t in content.texts if t]
            batch.append(embedding_conversation(finish_instruction(instruction, self.default_instruction), parts))
        chunks = budget_chunks([conversation_bytes(c) for c in batch], self.max_request_bytes, self.client.max_batch)
        if len(chunks) == 1:
            vectors = self.client.embed_messages(batch)
        else:
            with ThreadPoolExecutor(max_workers=min(self.client.max_concurrency, len(chunks))) as pool:
                vectors = np.concatenate(list(pool.map(lambda r: self.client.embed_messages(batch[r.start:r.stop]),
                                                       chunks)))
        vectors = vectors.astype(np.float32)
        with self._lock:
            self._requests += len(chunks)
        vectors /= np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)  # the seam's contract
        return matryoshka(vectors, dimensions, self.dimension)
