"""The FAISS backend's per-set state and its file: one ``.npz`` per set (index bytes, slot ids, live mask,
meta), written to a temp file and renamed into place, so a crash leaves the old or the new state."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.durable import fsync_dir
from rubricsearch.retrieval.errors import BackendUnavailable

SUFFIX = ".idx.npz"
FORMAT_VERSION = 1


@dataclass
class SetState:
    dim: int
    ann: bool = False
    index: Any = None  # faiss.Index once loaded; None until first use of a set found on disk
    slot_ids: list[str] = field(default_factory=list)
    live: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    where: dict[str, int] = field(default_factory=dict)  # live id -> slot
    bitmap: npt.NDArray[np.uint8] | None = None  # packed live mask, cached between writes
    payloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> metadata filters read
    dirty: bool = False
    dropped: bool = False
    lock: threading.RLock = field(default_factory=threading.RLock)

    @property
    def dead(self) -> int:
        return len(self.slot_ids) - len(self.where)


def read_meta(file: Path) -> dict[str, Any]:
    try:
        with np.load(file, allow_pickle=False) as data:
            meta: dict[str, Any] = json.loads(data["meta"].tobytes())
    except Exception as exc:
        raise BackendUnavailable(f"cannot read FAISS index file {file}: {exc}") from exc
    if meta.get("format") != FORMAT_VERSION:
        raise BackendUnavailable(f"{file} has unknown index format {meta.get('format')!r}")
    return meta


def load_set(file: Path, entry: SetState) -> None:
    """Read a set's index, slot ids and live mask into ``entry``."""
    with np.load(file, allow_pickle=False) as data:
        meta = json.loads(data["meta"].tobytes())
        index = faiss.deserialize_index(np.ascontiguousarray(data["index"]))
        slot_ids = data["ids"].astype(str).tolist()
        live = data["live"].astype(bool)
        payloads = json.loads(data["payloads"].tobytes()) if "payloads" in data.files else {}
    if index.d != entry.dim or index.ntotal != len(slot_ids) or len(live) != len(slot_ids):
        raise BackendUnavailable(f"{file} is inconsistent (dimension or row count)")
    entry.index, entry.ann = index, bool(meta["ann"])
    entry.slot_ids, entry.live = slot_ids, live
    entry.where = {sha: i for i, sha in enumerate(slot_ids) if live[i]}
    entry.payloads = {sha: payload for sha, payload in payloads.items() if sha in entry.where}


def save_set(root: Path, file: Path, entry: SetState) -> None:
    """Write to a temp file, fsync, rename over the old file, fsync the directory."""
    meta = {"format": FORMAT_VERSION, "dim": entry.dim, "ann": entry.ann, "count": len(entry.where)}
    fd, tmp = tempfile.mkstemp(prefix=f".{file.name[: -len(SUFFIX)]}.", suffix=".tmp", dir=root)
    try:
        with os.fdopen(fd, "wb") as fh:
            np.savez(
                fh,
                meta=np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8),
                index=faiss.serialize_index(entry.index),
                ids=np.array(entry.slot_ids, dtype="S64"),
                live=entry.live,
                payloads=np.frombuffer(json.dumps(entry.payloads).encode(), dtype=np.uint8),
            )
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, file)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(root)
    entry.dirty = False


def apply_payloads(entry: SetState, payloads: dict[str, dict[str, Any]]) -> bool:
    """Replace the payloads of the set's live ids among ``payloads``; whether anything changed."""
    changed = False
    for sha, payload in payloads.items():
        if sha in entry.where and entry.payloads.get(sha, {}) != payload:
            if payload:
                entry.payloads[sha] = payload
            else:
                entry.payloads.pop(sha, None)
            changed = True
    return changed


def new_index(dim: int, ann: bool, hnsw_m: int, ef_construction: int) -> Any:
    """An empty index: exact inner product, or an HNSW graph over flat rows."""
    if not ann:
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    return index


def live_bitmap(entry: SetState) -> npt.NDArray[np.uint8]:
    """The live mask packed for faiss' ``IDSelectorBitmap`` (cached until the next write)."""
    if entry.bitmap is None:
        entry.bitmap = np.packbits(entry.live, bitorder="little")
    return entry.bitmap


@contextlib.contextmanager
def omp_threads(n: int | None) -> Iterator[None]:
    """Set OpenMP's thread count for this thread only (an OpenMP per-thread setting) and restore it."""
    if n is None:
        yield
        return
    before = faiss.omp_get_max_threads()
    faiss.omp_set_num_threads(n)
    try:
        yield
    finally:
        faiss.omp_set_num_threads(before)
