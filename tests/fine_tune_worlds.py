"""What the fine-tune tests of both trainers share: the judged tiny world (references with packages under the
model's tower and under another tower), the settings of a few steps, and a cell whose reference has no package."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore, Purpose
from rubricsearch.retrieval.runtime.config import LocalConfig
from rubricsearch.retrieval.tuning.judgments import JudgedCell
from rubricsearch.retrieval.tuning.settings import TuningSettings

CRITERIA = ("a red square", "no blue stripes")
SETTINGS = TuningSettings(steps=4, batch=8, lr=1e-3, seed=3)
CPU = LocalConfig(device="cpu")  # where the tests train
UNPACKAGED = JudgedCell(999, "0" * 64, CRITERIA[0], True)  # a reference without a package: skipped, and counted


@dataclass
class World:
    base: Path
    store: PackageStore
    cells: list[JudgedCell]
    other_store: PackageStore  # packages of the same images under another tower
    images: dict[str, Any]


def packages(model_dir: Path, images: list[Any], kind: str) -> PackageStore:
    """The images' packages as ingestion makes them, under ``model_dir``'s tower (``kind``: embedding or
    reranker)."""
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval.embedding import load_embedder

    store = PackageStore(storage_dtype="float32", memory_device="cpu")
    model = load_embedder(model_dir, store=store, device="cpu") if kind == "embedding" else load_reranker(
        model_dir, store=store, device="cpu")
    model.packages.get_or_encode(images, purpose=Purpose.INGEST)
    return store


def world_of(kind: str, base: Path, other_tower: Path, make_png: Callable[..., bytes], count: int) -> World:
    """``count`` pictures, each judged for both criteria, answers alternating."""
    images = [decode_image(make_png(48 + 8 * (i % 3), 40, seed=i)) for i in range(count)]
    cells = [JudgedCell(len(CRITERIA) * i + k + 1, img.sha256, c, (i + k) % 2 == 0)
             for i, img in enumerate(images) for k, c in enumerate(CRITERIA)]
    return World(base, packages(base, images, kind), cells, packages(other_tower, images, "reranker"),
                 {img.sha256: img for img in images})
