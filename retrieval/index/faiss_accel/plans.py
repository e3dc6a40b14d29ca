"""How the accelerated FAISS index reads a set: per-set caches beside the reference state, a filter's slot mask
from the payload bitmaps (recent ones cached), and the CPU search plan (a filtered HNSW walk widened for recall, or
an exact scan of the kept rows where that costs less)."""

from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass, field
from typing import Any

import faiss

from rubricsearch.retrieval.index.faiss_accel.device_search import DeviceMatrix
from rubricsearch.retrieval.index.faiss_accel.filtered_scan import RowScan
from rubricsearch.retrieval.index.faiss_accel.payload_index import PayloadIndex, SlotMask
from rubricsearch.retrieval.index.faiss_files import SetState, live_bitmap
from rubricsearch.retrieval.index.filters import Filter

# efSearch x 1.06 / sqrt(kept fraction), 1 to 16: fitted to the widenings measured at 1M x 2048 (bench/filter_ef_sweep;
# the widenings and the recall each reaches: docs/metadata.md); 1 / fraction over-widens the small ones
FILTER_EF_SCALE, FILTER_EF_BOOST = 1.06, 16.0
# recent filters' slot masks kept per set until its next write, bounded by their bytes (at least the last one is
# kept) and keyed by a digest of the filter, whose JSON may be megabytes: 64 masks at 1M slots
MASK_CACHE_BYTES = 8 << 20


@dataclass
class AccelState(SetState):
    """A set's reference state plus what the accelerated reads cache until the next write."""

    mirror: DeviceMatrix | None = None  # the set on an accelerator, built at the first search
    payload_index: PayloadIndex | None = None  # built at the first filtered search after a write
    masks: dict[bytes, SlotMask] = field(default_factory=dict)  # recent filters' live slots, by filter digest

    def forget_filters(self) -> None:
        """Drop what was derived from the payloads (after a write or a payload change)."""
        self.payload_index = None
        self.masks.clear()


def allowed_slots(entry: AccelState, filter: Filter) -> SlotMask:
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
    bitmap = allowed.bits if allowed is not None else live_bitmap(entry) if entry.dead else None
    if bitmap is not None:
        params.sel = faiss.IDSelectorBitmap(len(entry.live), faiss.swig_ptr(bitmap))
    return entry.index, params


def walk_boost(kept: int, live: int) -> float:
    """How much wider than an unfiltered walk's a filtered walk's beam is: x 1.06 / sqrt(kept fraction), 1 to 16
    (faiss' beam counts every node met, kept or not, so a filter keeping half the set needs a wider one)."""
    return min(FILTER_EF_BOOST, max(1.0, FILTER_EF_SCALE * math.sqrt(live / max(kept, 1))))
