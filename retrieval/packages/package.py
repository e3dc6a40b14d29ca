"""The visual package: what the vision tower makes of one image, keyed by exactly what produced it."""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass

import torch

from retrieval.errors import PackageMismatch


@dataclass(frozen=True)
class Fingerprint:
    """Everything the vision output depends on besides the pixels.

    ``tower`` hashes the vision tower's weights (names, shapes, dtypes, bytes), so two models with
    byte-identical towers share packages and different towers never mix. The preprocessing settings
    decide the resized resolution and therefore the grid.
    """

    tower: str
    min_pixels: int
    max_pixels: int
    patch_size: int
    merge_size: int
    temporal_patch_size: int

    def digest(self) -> str:
        blob = json.dumps(asdict(self), sort_keys=True).encode()
        return hashlib.sha256(blob).hexdigest()[:32]

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Fingerprint:
        return cls(**json.loads(text))


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
