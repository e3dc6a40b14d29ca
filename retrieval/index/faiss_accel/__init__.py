"""A plug-in of the vector index seam: FAISS with fast filtered search (payload bitmaps, widened walks, exact scans
of few kept rows, graphs of recurring filters) and an accelerator copy of each set, layered on the reference
:class:`~retrieval.index.faiss_index.FaissIndex`. The factory loads it by name (``"faiss"``, the default); nothing
in the core imports it.
"""

from rubricsearch.retrieval.index.faiss_accel.index import AcceleratedFaissIndex

__all__ = ["AcceleratedFaissIndex"]
