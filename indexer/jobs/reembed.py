"""Re-embedding a set's references with another embedder version from their cached packages, at language-model
cost.

A fine-tuned embedder keeps the base's vision tower (:mod:`retrieval.tuning.version`), so every reference's
package is already stored under its tower: the new vectors need the language model only. References are
handles whose pixels are never read (the tower cannot run on them), and the encodes are counted all the same.

The new vectors are staged in a file beside the index while the old ones keep serving; the switch is one upsert
of every vector at the end (for FAISS one set lock and one file rename, so a search sees the old vectors or the
new ones, never a mix), then the staging file goes. References indexed while the vectors were staged are embedded
in the switch itself, so none keeps the old embedder's vector. Nothing is switched when a reference lacks its
package.
"""

from __future__ import annotations

import contextlib
import logging
import time
import uuid
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from rubricsearch.indexer.catalog import Catalog, ImageStatus, get_set
from rubricsearch.indexer.jobs.reconcile import all_images
from rubricsearch.retrieval.embedding.protocol import Embedder, matryoshka
from rubricsearch.retrieval.errors import Conflict
from rubricsearch.retrieval.index import VectorIndex
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.tuning.judgments import reference

log = logging.getLogger(__name__)
CHUNK = 64  # references per embedding call


@dataclass(frozen=True)
class ReembedReport:
    set_id: str
    model_id: str  # the embedder the set's vectors now come from
    references: int  # vectors switched
    skipped: int  # references deleted from the set while it was re-embedded (their vectors were not written)
    vision_encodes: int
    lm_tokens: int
    wall_s: float

    def to_json(self) -> dict[str, object]:
        return {"set_id": self.set_id, "model_id": self.model_id, "references": self.references,
                "skipped": self.skipped, "vision_encodes": self.vision_encodes, "lm_tokens": self.lm_tokens,
                "wall_s": round(self.wall_s, 2)}


def reembed_set_from_packages(catalog: Catalog, index: VectorIndex, embedder: Embedder, set_id: str, *,
                              scratch: Path, switching: Callable[[], AbstractContextManager[Any]] = nullcontext
                              ) -> ReembedReport:
    """Give every indexed reference of the set its vector from ``embedder`` (another version of the serving
    embedder, its tower the same), read from the references' packages; ``scratch`` holds the staged vectors
    until the switch, which runs inside ``switching()`` (the caller's catalog transaction that names the set's
    embedder: it commits with the vectors, and an error it raises switches nothing). Raises :class:`Conflict`
    (and switches nothing) when a reference has no package for the embedder's tower, or the set's index was
    never made with a dimension the embedder can give."""
    started = time.monotonic()
    with catalog.read() as s:
        get_set(s, set_id)  # NotFound for a deleted set
    shas = [r.sha256 for r in all_images(catalog, set_id) if r.status == ImageStatus.INDEXED]
    if not index.has_set(set_id) or not shas:
        with switching():
            return ReembedReport(set_id, embedder.model_id, 0, 0, 0, 0, time.monotonic() - started)
    dim = index.dim(set_id)
    if dim > embedder.dimension:
        raise Conflict(f"the set's vectors have {dim} dimensions; this embedder gives {embedder.dimension}",
                       set_id=set_id)
    _require_packages(embedder, shas, set_id)
    scratch.mkdir(parents=True, exist_ok=True)
    staged_file = scratch / f".reembed-{set_id}-{uuid.uuid4().hex[:8]}.npy"
    usage = Usage()
    try:
        staged = np.lib.format.open_memmap(staged_file, mode="w+", dtype=np.float32, shape=(len(shas), dim))
        for start in range(0, len(shas), CHUNK):
            chunk = shas[start:start + CHUNK]
            full = embedder.embed_contents([Content(images=[reference(sha)]) for sha in chunk], [None] * len(chunk),
                                           usage=usage)
            staged[start:start + len(chunk)] = matryoshka(full, dim, embedder.dimension)
        staged.flush()
        with switching():
            # inside the switch (the set's row locked by the activation): the references indexed now. One
            # deleted meanwhile must not come back; one indexed meanwhile gets this embedder's vector here, and a
            # batch committing after the switch embeds again with the active embedder (indexer.jobs.pipeline)
            still = [r.sha256 for r in all_images(catalog, set_id) if r.status == ImageStatus.INDEXED]
            indexed = set(still)
            keep = [i for i, sha in enumerate(shas) if sha in indexed]
            staged_shas = set(shas)
            late = [sha for sha in still if sha not in staged_shas]
            vectors = np.asarray(staged[keep])
            if late:
                _require_packages(embedder, late, set_id)
                full = embedder.embed_contents([Content(images=[reference(sha)]) for sha in late],
                                               [None] * len(late), usage=usage)
                vectors = np.concatenate([vectors, matryoshka(full, dim, embedder.dimension)])
            index.upsert(set_id, [shas[i] for i in keep] + late, vectors)
            index.flush()
        del staged
    finally:
        with contextlib.suppress(FileNotFoundError):
            staged_file.unlink()
    report = ReembedReport(set_id, embedder.model_id, len(keep) + len(late), len(shas) - len(keep), usage.total(),
                           usage.lm_tokens, time.monotonic() - started)
    log.info("re-embedded set %s from packages: %s", set_id, report)
    return report


def _require_packages(embedder: Embedder, shas: list[str], set_id: str) -> None:
    found = embedder.packages.find([reference(sha) for sha in shas])
    missing = [sha for sha in shas if sha not in found]
    if missing:
        raise Conflict(f"{len(missing)} of the set's references have no package for this embedder's vision tower: "
                       "run the package backfill for it first (re-embedding never runs the tower)",
                       set_id=set_id, missing=len(missing))
