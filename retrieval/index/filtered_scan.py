"""A filter met for the first time on an HNSW set: its kept rows scanned as 8-bit codes, the best re-scored exactly.

A graph walk with a selector meets kept rows only in proportion to the fraction the filter keeps, so a filter
that keeps few rows needs a beam widened in inverse proportion (its cost grows as the fraction shrinks), while a
scan of the kept rows costs their bytes (it shrinks with them). The scan reads the set's rows as 8-bit scalar
codes (one byte per value, a quarter of the float32 rows in the HNSW's storage; about 2.6x faster per row, measured
at 250k x 2048 on one core), and the ``4k + 16`` best candidates are re-scored exactly from the float32 rows, so
results are those of an exact scan wherever the codes rank the true top-k among the candidates.

The codes cover every slot of the set (a filter's selector picks the kept ones) and cost ``dim`` bytes per row
beside the float32 storage. They are built at the first scan of a set state (trained on a sample of its rows),
extended by later upserts, and dropped when the set is rebuilt (its slots renumbered).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

from retrieval.index.faiss_files import SetState, walk_boost
from retrieval.index.payload_index import SlotMask

# Rows of codes a scan reads for the cost of one (efSearch x M) unit of a filtered walk, whose beam is widened by
# walk_boost: measured where both meet (bench/filter_search.py's cost-model table; docs/metadata.md)
SCAN_RATIO = 1.2
SAMPLE = 65_536  # rows the codes' per-dimension ranges are trained on
CHUNK = 65_536  # rows reconstructed from the storage at a time while the codes are built


@dataclass(frozen=True)
class CodeScan:
    """A filter's kept rows, to be scanned in the set's codes."""

    codes: Any  # faiss.IndexScalarQuantizer over every slot of the set
    allowed: SlotMask

    def candidates(self, queries: npt.NDArray[np.float32], n: int, ef_search: int) -> npt.NDArray[np.int64]:
        """``[Q, n]`` kept slots best by their codes (-1 pads), for an exact re-score (``ef_search``: unused)."""
        params = faiss.SearchParameters()
        params.sel = faiss.IDSelectorBitmap(self.allowed.size, faiss.swig_ptr(self.allowed.bits))
        _, slots = self.codes.search(queries, min(n, self.allowed.kept), params=params)
        out: npt.NDArray[np.int64] = slots
        return out


def code_scan(entry: SetState, allowed: SlotMask | None, walk_rows: float) -> CodeScan | None:
    """This filter's scan if its kept rows cost less to scan than to walk, else None. A scan costs its rows; a
    walk ``walk_rows`` (``filter_scan_ratio`` x efSearch x M: the rows a scan reads for the cost of an unfiltered
    walk) times its beam's widening (:func:`walk_boost`, which grows as the kept fraction shrinks). The set's codes
    are built now if it has none (with faiss' own threads: the caller has not yet capped them)."""
    if allowed is None or not entry.ann or allowed.kept > walk_rows * walk_boost(allowed.kept, len(entry.where)):
        return None
    return CodeScan(scan_codes(entry), allowed)


def scan_codes(entry: SetState) -> Any:
    """The set's 8-bit codes (``faiss.IndexScalarQuantizer``), built now if the set state has none."""
    if entry.codes is None:
        n = len(entry.slot_ids)
        codes = faiss.IndexScalarQuantizer(entry.dim, faiss.ScalarQuantizer.QT_8bit,
                                           faiss.METRIC_INNER_PRODUCT)
        live = np.flatnonzero(entry.live)
        sample = live[np.linspace(0, len(live) - 1, min(len(live), SAMPLE)).astype(np.int64)] if len(live) else live
        codes.train(entry.index.reconstruct_batch(sample) if len(sample) else np.zeros((1, entry.dim), np.float32))
        for start in range(0, n, CHUNK):
            codes.add(entry.index.reconstruct_n(start, min(CHUNK, n - start)))
        entry.codes = codes
    return entry.codes
