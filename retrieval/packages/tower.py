"""What the package stage needs of a vision tower, and how it counts the tower's work.

A tower turns decoded images into :class:`VisualPackage` objects; the store keeps them. Keeping the tower
behind this small protocol lets :class:`~retrieval.packages.service.VisualPackages` own caching and
accounting for every tower in use (local Qwen3-VL models, vision-only workers beside vLLM) alike.
"""

from __future__ import annotations

import threading
from collections import Counter
from collections.abc import Hashable, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import torch

from rubricsearch.retrieval.images import ImageLike, ReferenceImage
from rubricsearch.retrieval.packages.package import Fingerprint, VisualPackage

Grid = tuple[int, int, int]


class Purpose(StrEnum):
    """Why an image went through a vision tower."""

    INGEST = "ingest"  # a reference package built by ingestion or a backfill job: the expected place
    REFERENCE = "reference"  # a reference image encoded while serving: a miss the product promises never to have
    QUERY = "query"  # a query-side image: a search candidate, an image sent to /v1/embeddings or /v1/rerank

    @classmethod
    def of(cls, image: ImageLike) -> Purpose:
        """References reach the models as :class:`ReferenceImage` handles; every other image is a query."""
        return cls.REFERENCE if isinstance(image, ReferenceImage) else cls.QUERY


@dataclass
class Prepared:
    """Preprocessed pixels of images, made ahead of the tower run (e.g. while the GPU runs another batch).

    ``pixels`` maps sha256 to (patches, grid), on the CPU or (GPU preprocessing) on the device;
    ``errors`` holds per-image preprocessing failures. With CPU preprocessing on CUDA, ``device`` holds all of
    them concatenated (in ``order``) already uploaded. ``ready`` is the event a pass waits for before it reads
    pixels made on another stream (the upload, or the GPU preprocessing).
    """

    pixels: dict[str, tuple[torch.Tensor, Grid]] = field(default_factory=dict)
    errors: dict[str, Exception] = field(default_factory=dict)
    order: list[str] = field(default_factory=list)
    device: torch.Tensor | None = None
    ready: Any = None  # a CUDA event recorded on the stream that made the pixels


class VisionTower(Protocol):
    """A vision tower that makes packages (``retrieval.qwen.engine.vision.VisionEncoder`` is the implementation)."""

    @property
    def fingerprint(self) -> Fingerprint:
        """The tower's weights hash plus every preprocessing setting: the packages' key."""
        ...

    @property
    def prepare_key(self) -> Hashable:
        """Towers with equal keys accept each other's :class:`Prepared` pixels (same preprocessing,
        device and input dtype), so ingestion preprocesses an image once for all of them."""
        ...

    def prepare(self, images: Sequence[ImageLike]) -> Prepared:
        """Preprocess (and on a GPU, upload) the images; per-image failures go to ``errors``."""
        ...

    def encode(self, images: Sequence[ImageLike], prepared: Prepared | None = None) -> list[VisualPackage]:
        """Run the tower (no cache lookup); raises on a bad image."""
        ...


class Usage:
    """The vision encodes one request caused, by model role and purpose; thread safe.

    Requests pass one down to the models so provenance can say, per request, that no reference was
    encoded (``reference == 0``) and how many query images were.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._encodes: Counter[tuple[str, str]] = Counter()
        self._tokens = 0

    def add_tokens(self, n: int) -> None:
        """Language-model tokens the request's passes processed (local backends count them)."""
        with self._lock:
            self._tokens += n

    @property
    def lm_tokens(self) -> int:
        with self._lock:
            return self._tokens

    def add(self, role: str, purpose: Purpose, n: int = 1) -> None:
        with self._lock:
            self._encodes[(role, purpose.value)] += n

    def total(self, purpose: Purpose | None = None) -> int:
        with self._lock:
            return sum(n for (_, p), n in self._encodes.items() if purpose is None or p == purpose.value)

    def to_dict(self) -> dict[str, Any]:
        """``{"total", "reference", "query", "ingest", "by_model": {role: {purpose: n}}}``."""
        with self._lock:
            items = dict(self._encodes)
        by_model: dict[str, dict[str, int]] = {}
        for (role, purpose), n in sorted(items.items()):
            by_model.setdefault(role, {})[purpose] = n
        out: dict[str, Any] = {p.value: sum(n for (_, q), n in items.items() if q == p.value) for p in Purpose}
        return {"total": sum(items.values()), **out, "by_model": by_model}
