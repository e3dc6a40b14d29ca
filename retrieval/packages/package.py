"""The visual package: what the vision tower makes of one image, keyed by exactly what produced it."""

from __future__ import annotations

import functools
import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from rubricsearch.retrieval.errors import PackageMismatch

EXIF_POLICY = "transpose"  # EXIF orientation applied before resizing (retrieval.images.decode_image)


@dataclass(frozen=True, kw_only=True)
class Preprocess:
    """What turns an image into the tower's input pixels: two towers with equal ``Preprocess`` can share
    one decode and one preprocessing pass per image (ingestion does exactly that)."""

    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int
    image_mean: tuple[float, ...]
    image_std: tuple[float, ...]
    resize: str  # the resize implementation and its version, e.g. "qwen_vl_utils 0.0.14 / Pillow 13"
    exif: str = EXIF_POLICY


@dataclass(frozen=True, kw_only=True)
class Fingerprint(Preprocess):
    """Everything the vision output depends on besides the pixels: the preprocessing, and the tower.

    ``tower`` hashes the vision tower's weights (names, shapes, dtypes, bytes), so two models with
    byte-identical towers share packages and different towers never mix. The preprocessing fields
    decide the resized resolution and the normalised values, so a change to any of them (or to the
    resize implementation's version, or the EXIF policy) makes a new key: stored packages of an older
    fingerprint are never found, so never silently reused.
    """

    tower: str

    @classmethod
    def of(cls, tower: str, preprocess: Preprocess) -> Fingerprint:
        return cls(tower=tower, **asdict(preprocess))

    @property
    def preprocess(self) -> Preprocess:
        fields = asdict(self)
        del fields["tower"]
        return Preprocess(**fields)

    def digest(self) -> str:
        return _digest(self)

    @property
    def short(self) -> str:
        """A label for logs and metrics: the first 12 hex digits of the digest."""
        return self.digest()[:12]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        data = json.loads(text)
        for key in ("image_mean", "image_std"):
            if key in data:
                data[key] = tuple(data[key])
        return cls(**data)


@functools.lru_cache(maxsize=64)
def _digest(fp: Fingerprint) -> str:
    """Every package lookup keys by it (a search's rerank looks up each image): hashed once per fingerprint."""
    blob = json.dumps(asdict(fp), sort_keys=True).encode()
    return hashlib.sha256(blob).hexdigest()[:32]


def owned(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` holding only its own elements. A tower batch's output is split into per-image views that
    keep the whole batch's storage alive; a cache that keeps such a view holds far more than it counts
    (the query tier held well over its budget), so a view of a larger storage is copied."""
    if tensor.untyped_storage().nbytes() > tensor.numel() * tensor.element_size():
        return tensor.clone(memory_format=torch.contiguous_format)
    return tensor


@dataclass
class VisualPackage:
    """Merged vision embeddings ``[tokens, H]`` and deepstack features ``[L, tokens, H]`` of one image."""

    image_sha256: str
    fingerprint: Fingerprint
    grid_thw: tuple[int, int, int]
    embeds: torch.Tensor
    deepstack: torch.Tensor

    @property
    def tokens(self) -> int:
        return int(self.embeds.shape[0])

    @property
    def hidden_size(self) -> int:
        return int(self.embeds.shape[1])

    @property
    def levels(self) -> int:
        return int(self.deepstack.shape[0])

    @property
    def nbytes(self) -> int:
        return self.embeds.numel() * self.embeds.element_size() + self.deepstack.numel() * self.deepstack.element_size()

    def validate(self, *, hidden_size: int | None = None, levels: int | None = None) -> None:
        """Refuse a package whose shapes disagree with its grid or with the model it is meant for."""
        t, h, w = self.grid_thw
        merge = self.fingerprint.merge_size
        if min(t, h, w) < 1 or h % merge or w % merge:
            raise PackageMismatch(f"invalid grid_thw {self.grid_thw} for merge size {merge}")
        expected = t * h * w // (merge * merge)
        if self.embeds.ndim != 2 or self.embeds.shape[0] != expected:
            raise PackageMismatch(
                f"embeds shape {tuple(self.embeds.shape)} does not match grid {self.grid_thw} ({expected} tokens)"
            )
        if self.deepstack.ndim != 3 or tuple(self.deepstack.shape[1:]) != tuple(self.embeds.shape):
            raise PackageMismatch(
                f"deepstack shape {tuple(self.deepstack.shape)} does not match embeds {tuple(self.embeds.shape)}"
            )
        if hidden_size is not None and self.hidden_size != hidden_size:
            raise PackageMismatch(f"package hidden size {self.hidden_size} != model hidden size {hidden_size}")
        if levels is not None and self.levels != levels:
            raise PackageMismatch(f"package has {self.levels} deepstack levels; the model uses {levels}")

    def to_vllm_layout(self) -> torch.Tensor:
        """``[tokens, H*(1+L)]``: main features then each deepstack level, as vLLM's ``image_embeds`` expects."""
        return torch.cat([self.embeds, *self.deepstack.unbind(0)], dim=1)
