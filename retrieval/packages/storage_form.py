"""The storage form of a visual package: the compact dtype it is kept in (memory tier and files).

float8_e4m3fn keeps one float32 scale per token (row) by default, or per channel (column); bf16 and float32
are plain casts. ``pack_many`` quantises a tower batch in one pass; ``unpack`` restores float tensors.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import torch

from rubricsearch.retrieval.packages.package import Fingerprint, VisualPackage, owned

StorageDtype = Literal["float32", "bfloat16", "float8_e4m3fn"]
Fp8Scales = Literal["token", "channel"]
_FP8_MAX = 448.0
# torch.split_with_sizes but each part freshly allocated; torch's stub types it as returning None (out= form)
_split_copy = cast("Callable[..., list[torch.Tensor]]", torch.split_with_sizes_copy)


class Stored:
    """A package in its storage form (compact dtype, optional fp8 row scales)."""

    __slots__ = ("deepstack", "deepstack_scale", "embeds", "embeds_scale", "grid", "nbytes", "sha")

    def __init__(self, sha: str, grid: tuple[int, int, int], tensors: dict[str, torch.Tensor]) -> None:
        self.sha = sha
        self.grid = grid
        self.embeds = tensors["embeds"]
        self.deepstack = tensors["deepstack"]
        self.embeds_scale = tensors.get("embeds_scale")
        self.deepstack_scale = tensors.get("deepstack_scale")
        self.nbytes = sum(t.numel() * t.element_size() for t in tensors.values())

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"embeds": self.embeds, "deepstack": self.deepstack}
        if self.embeds_scale is not None and self.deepstack_scale is not None:
            out.update(embeds_scale=self.embeds_scale, deepstack_scale=self.deepstack_scale)
        return out


def pack(package: VisualPackage, storage_dtype: StorageDtype, fp8_scales: Fp8Scales,
         device: torch.device) -> Stored:
    """A package in storage form on ``device``."""
    embeds = package.embeds.detach().to(device)
    deepstack = package.deepstack.detach().to(device)
    tensors: dict[str, torch.Tensor]
    if storage_dtype == "float8_e4m3fn":
        quantise = _fp8_rows if fp8_scales == "token" else _fp8_columns
        e, es = quantise(embeds.float())
        d, ds = quantise(deepstack.float())
        tensors = {"embeds": e, "deepstack": d, "embeds_scale": es, "deepstack_scale": ds}
    else:
        dtype = getattr(torch, storage_dtype)
        # a copy each: a tower pass's packages are views of its batch tensors, which the memory tier must not keep
        tensors = {"embeds": embeds.to(dtype, copy=True).contiguous(),
                   "deepstack": owned(deepstack.to(dtype).contiguous())}
    return Stored(package.image_sha256, package.grid_thw, tensors)

@dataclass(eq=False)
class Joint:
    """A tower batch in storage form as one tensor per kind, every package's tokens side by side (``sizes``):
    the package writers copy a batch to the host with one copy per kind instead of four per package."""

    tensors: dict[str, torch.Tensor]
    sizes: list[int]

    def split(self, tensors: dict[str, torch.Tensor] | None = None) -> list[dict[str, torch.Tensor]]:
        """Each package's own contiguous tensors, of ``tensors`` (default: the joint ones; or a host copy of
        them); one torch call per kind, not one per package and kind (each call waits for the GIL)."""
        source = self.tensors if tensors is None else tensors
        parts = {name: _split_copy(t, self.sizes, dim=0 if name.startswith("embeds") else 1)
                 for name, t in source.items()}
        return [{name: chunks[i] for name, chunks in parts.items()} for i in range(len(self.sizes))]


@torch.no_grad()
def pack_many(packages: list[VisualPackage], storage_dtype: StorageDtype, fp8_scales: Fp8Scales,
              device: torch.device) -> tuple[list[Stored], Joint | None]:
    """A tower batch's packages quantised together (one pass over all their tokens), each then in storage of its
    own (a view would keep the whole batch alive in the memory tier), and the batch's :class:`Joint` form
    (``None`` where they are packed one by one)."""
    per_channel = storage_dtype == "float8_e4m3fn" and fp8_scales == "channel"  # scales per image
    if per_channel or len(packages) < 2 or len({(p.hidden_size, p.levels) for p in packages}) != 1:
        return [pack(p, storage_dtype, fp8_scales, device) for p in packages], None
    together = VisualPackage("", packages[0].fingerprint, (1, 1, 1), torch.cat([p.embeds for p in packages]),
                             torch.cat([p.deepstack for p in packages], dim=1))
    joint = Joint(pack(together, storage_dtype, fp8_scales, device).tensors(), [p.tokens for p in packages])
    stored = [Stored(p.image_sha256, p.grid_thw, tensors) for p, tensors in zip(packages, joint.split(), strict=True)]
    return stored, joint


def unpack(stored: Stored, fp: Fingerprint) -> VisualPackage:
    """Back to a float package (fp8 rows times their scales)."""
    if stored.embeds_scale is not None and stored.deepstack_scale is not None:
        embeds = stored.embeds.to(torch.float32) * stored.embeds_scale
        deepstack = stored.deepstack.to(torch.float32) * stored.deepstack_scale
    else:
        embeds, deepstack = stored.embeds, stored.deepstack
    return VisualPackage(stored.sha, fp, stored.grid, embeds, deepstack)


def unpack_many(stored: Sequence[Stored], fp: Fingerprint) -> list[VisualPackage]:
    """``unpack`` of each (same order), with the float8 ones of per-token scales dequantised together: one
    multiply over all their tokens instead of four small kernels per package (an ingestion batch's LM pass
    read 64 packages so), as views of one tensor. The values are exactly those of ``unpack``."""
    together = [s for s in stored if _token_scaled(s)]
    if len(together) < 2 or len({(s.embeds.device, s.embeds.shape[1], s.deepstack.shape[0]) for s in together}) != 1:
        return [unpack(s, fp) for s in stored]
    sizes = [int(s.embeds.shape[0]) for s in together]
    joint = unpack(Stored("", (1, 1, 1), {  # token rows (and their scales) side by side: one unpack for all
        "embeds": torch.cat([s.embeds for s in together]),
        "embeds_scale": torch.cat([cast(torch.Tensor, s.embeds_scale) for s in together]),
        "deepstack": torch.cat([s.deepstack for s in together], dim=1),
        "deepstack_scale": torch.cat([cast(torch.Tensor, s.deepstack_scale) for s in together], dim=1)}), fp)
    made = {id(s): VisualPackage(s.sha, fp, s.grid, e, d)
            for s, e, d in zip(together, joint.embeds.split(sizes), joint.deepstack.split(sizes, dim=1), strict=True)}
    return [made[id(s)] if id(s) in made else unpack(s, fp) for s in stored]


def _token_scaled(s: Stored) -> bool:
    return (s.embeds_scale is not None and s.deepstack_scale is not None and s.embeds.dtype == torch.float8_e4m3fn
            and tuple(s.embeds_scale.shape) == (s.embeds.shape[0], 1)
            and tuple(s.deepstack_scale.shape) == (*s.deepstack.shape[:2], 1))


def _fp8_columns(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to float8_e4m3fn with one float32 scale per channel (column), shared by all tokens."""
    amax = x.abs().amax(dim=-2, keepdim=True).clamp_min(1e-12)
    scale = amax / _FP8_MAX
    q = (x / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()


def _fp8_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantise to float8_e4m3fn with one float32 scale per row (per token), which keeps outliers exact-ish."""
    amax = x.abs().amax(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = amax / _FP8_MAX
    q = (x / scale).clamp(-_FP8_MAX, _FP8_MAX).to(torch.float8_e4m3fn)
    return q.contiguous(), scale.contiguous()
