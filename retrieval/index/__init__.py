"""Vector indexes behind one Protocol: embedded FAISS (default) and Qdrant.

Backends are named in :data:`~retrieval.index.factory.BACKENDS` and imported by :func:`make_index` only when
chosen: ``"faiss"`` is the plug-in :mod:`retrieval.index.faiss_accel` layered on the reference ``FaissIndex``.
Import a concrete class from its module when a type is needed.
"""

from rubricsearch.retrieval.index.factory import Backend, make_index
from rubricsearch.retrieval.index.protocol import Hit, VectorIndex

__all__ = ["Backend", "Hit", "VectorIndex", "make_index"]
