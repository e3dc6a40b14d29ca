"""The FAISS backend's per-set state and its file: one ``.npz`` per set (index bytes, slot ids, live mask,
meta), written to a temp file and renamed into place, so a crash leaves the old or the new state."""

from __future__ import annotations

import json
import os
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from retrieval.errors import BackendUnavailable
from retrieval.index.device_search import DeviceMatrix

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
    mirror: DeviceMatrix | None = None  # the set on an accelerator, built at the first search
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
    if index.d != entry.dim or index.ntotal != len(slot_ids) or len(live) != len(slot_ids):
        raise BackendUnavailable(f"{file} is inconsistent (dimension or row count)")
    entry.index, entry.ann = index, bool(meta["ann"])
    entry.slot_ids, entry.live = slot_ids, live
    entry.where = {sha: i for i, sha in enumerate(slot_ids) if live[i]}



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
