"""A filter met for the first time on an HNSW set, keeping few rows: those rows scanned exactly, by index.

A graph walk with a selector meets kept rows only in proportion to the fraction the filter keeps, so a filter
that keeps few rows needs a beam widened in inverse proportion (its cost grows as the fraction shrinks), while a
scan of the kept rows costs their bytes (it shrinks with them). The scan reads only the kept rows of the HNSW's
float32 storage, by slot (``faiss.knn_inner_products_by_idx``), so it is exact and costs O(kept rows), where a
flat search with a selector tests every slot of the set. It also beat 8-bit codes of the whole set scanned with
the selector, whose decoding is bound by compute and which would cost ``dim`` bytes a row more memory (the
options measured: docs/metadata.md, "A filter met for the first time").

:func:`search_plan`'s cost model picks the scan where it costs less than the widened walk.
"""

from __future__ import annotations

from typing import Any

import faiss
import numpy as np
import numpy.typing as npt

# Rows a scan reads for the cost of an unfiltered walk's efSearch x M node visits (the walk's widening comes on top):
# measured where the scan and the widened walk cost the same (docs/metadata.md)
SCAN_RATIO = 1.0


class RowScan:
    """An exact search over some rows of a flat float32 index, with a faiss index's ``search`` signature."""

    def __init__(self, flat: Any, slots: npt.NDArray[np.int64]) -> None:
        self.flat = flat  # faiss.IndexFlat (an HNSW's storage)
        self.slots = np.ascontiguousarray(slots, dtype=np.int64)

    def search(self, queries: npt.NDArray[np.float32], k: int, params: Any = None
               ) -> tuple[npt.NDArray[np.float32], npt.NDArray[np.int64]]:
        """``([Q, k] scores, [Q, k] slots)``, best first, -1 pads; ``params``: unused (the rows are the filter)."""
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        scores = np.full((len(queries), k), -np.inf, dtype=np.float32)
        slots = np.full((len(queries), k), -1, dtype=np.int64)
        knn_by_idx: Any = faiss.knn_inner_products_by_idx  # type: ignore[attr-defined]
        # ld_ids 0: every query scans the same subset of slots
        knn_by_idx(faiss.swig_ptr(queries), self.flat.get_xb(), faiss.swig_ptr(self.slots), self.flat.d,
                   len(queries), self.flat.ntotal, len(self.slots), k, faiss.swig_ptr(scores), faiss.swig_ptr(slots), 0)
        return scores, slots
