"""The FAISS backend's per-set state and its file: one ``.npz`` per set (index bytes, slot ids, live mask,
meta), written to a temp file and renamed into place, so a crash leaves the old or the new state."""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
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

from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.index.device_search import DeviceMatrix
from rubricsearch.retrieval.index.filtered_scan import RowScan
from rubricsearch.retrieval.index.filters import Filter
from rubricsearch.retrieval.index.payload_index import PayloadIndex, SlotMask

SUFFIX = ".idx.npz"
FORMAT_VERSION = 1
# efSearch x 1.06 / sqrt(kept fraction), 1 to 16: fitted to the widenings measured at 1M x 2048 (bench/filter_ef_sweep,
# docs/metadata.md), x1.5 at 50 % (recall@10 0.970) and x5 at 5 % (0.990); 1 / fraction over-widens the small ones
FILTER_EF_SCALE, FILTER_EF_BOOST = 1.06, 16.0
# recent filters' slot masks kept per set until its next write, bounded by their bytes (at least the last one is
# kept) and keyed by a digest of the filter, whose JSON may be megabytes: 64 masks at 1M slots
MASK_CACHE_BYTES = 8 << 20


@dataclass
class SetState:
    dim: int
    ann: bool = False
    index: Any = None  # faiss.Index once loaded; None until first use of a set found on disk
    slot_ids: list[str] = field(default_factory=list)
    live: npt.NDArray[np.bool_] = field(default_factory=lambda: np.zeros(0, dtype=bool))
    where: dict[str, int] = field(default_factory=dict)  # live id -> slot
    bitmap: npt.NDArray[np.uint8] | None = None  # packed live mask, cached between writes
    mirror: DeviceMatrix | None = None  # the set on an accelerator, built at the first search
    payloads: dict[str, dict[str, Any]] = field(default_factory=dict)  # id -> metadata filters read
    payload_index: PayloadIndex | None = None  # built at the first filtered search after a write
    masks: dict[bytes, SlotMask] = field(default_factory=dict)  # recent filters' live slots, by filter digest
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
    dir_fd = os.open(root, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)
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
    if changed:
        entry.payload_index = None
        entry.masks.clear()
    return changed


def new_index(dim: int, ann: bool, hnsw_m: int, ef_construction: int) -> Any:
    """An empty index: exact inner product, or an HNSW graph over flat rows."""
    if not ann:
        return faiss.IndexFlatIP(dim)
    index = faiss.IndexHNSWFlat(dim, hnsw_m, faiss.METRIC_INNER_PRODUCT)
    index.hnsw.efConstruction = ef_construction
    return index


def allowed_slots(entry: SetState, filter: Filter) -> SlotMask:
    """Live slots whose payload passes ``filter`` (recent filters' masks are kept until the next write)."""
    key = hashlib.blake2b(filter.cache_key().encode(), digest_size=16).digest()
    mask = entry.masks.pop(key, None)
    if mask is None:
        if entry.payload_index is None:
            entry.payload_index = PayloadIndex([entry.payloads.get(sha) if entry.live[i] else None
                                          for i, sha in enumerate(entry.slot_ids)], entry.live)
        mask = entry.payload_index.mask(filter)
        held = sum(m.bits.nbytes for m in entry.masks.values())
        while entry.masks and held + mask.bits.nbytes > MASK_CACHE_BYTES:  # least recently used first
            held -= entry.masks.pop(next(iter(entry.masks))).bits.nbytes
    entry.masks[key] = mask  # (re)inserted last: the most recently used
    return mask


def search_plan(entry: SetState, allowed: SlotMask | None, k: int, ef_search: int, walk_rows: float
                ) -> tuple[Any, Any]:
    """The index and search parameters for a CPU search; ``allowed`` (a filter's slot mask) must outlive the
    search, as faiss reads its bits through the selector.

    A filter on an HNSW set walks the graph with a beam widened the fewer rows it keeps (a walk meets about
    kept/live accepted nodes per visit), for recall, unless scanning the kept rows exactly costs less: a scan
    costs its rows, a walk about ``walk_rows`` (``filter_scan_ratio`` x efSearch x M) times its widening."""
    params: Any = faiss.SearchParameters()
    if entry.ann:
        boost = 1.0 if allowed is None else walk_boost(allowed.kept, len(entry.where))
        if allowed is not None and allowed.kept <= walk_rows * boost:
            return RowScan(faiss.downcast_index(entry.index.storage), allowed.slots()), None
        params = faiss.SearchParametersHNSW(efSearch=max(math.ceil(ef_search * boost), k))  # type: ignore[attr-defined]
    bitmap = None if allowed is None else allowed.bits
    if bitmap is None and entry.dead:
        if entry.bitmap is None:
            entry.bitmap = np.packbits(entry.live, bitorder="little")
        bitmap = entry.bitmap
    if bitmap is not None:
        params.sel = faiss.IDSelectorBitmap(len(entry.live), faiss.swig_ptr(bitmap))
    return entry.index, params


def walk_boost(kept: int, live: int) -> float:
    """How much wider than an unfiltered walk's a filtered walk's beam is: x 1.06 / sqrt(kept fraction), 1 to 16
    (faiss' beam counts every node met, kept or not, so a filter keeping half the set needs a wider one)."""
    return min(FILTER_EF_BOOST, max(1.0, FILTER_EF_SCALE * math.sqrt(live / max(kept, 1))))


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
