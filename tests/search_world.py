"""Shared set-up for the search-service tests: references indexed as ingestion indexes them."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from retrieval.images import decode_image
from retrieval.packages import VisualPackages


def indexed_pngs(packages: VisualPackages, emb: Any, index: Any, set_id: str,
                 make_png: Callable[[int, int, int], bytes], count: int, seed: int) -> dict[str, bytes]:
    """``count`` noise PNGs of growing width as one set's references: a package for every distinct tower (as
    ingestion builds them) and a 96-dimension vector each; returns their bytes by sha256."""
    index.create_set(set_id, 96)
    blobs: dict[str, bytes] = {}
    for i in range(count):
        data = make_png(64 + 8 * i, 96, seed + i)
        image = decode_image(data)
        blobs[image.sha256] = data
        packages.build([image])
        index.upsert(set_id, [image.sha256], emb.embed([{"image": data}], dimensions=96))
    return blobs
