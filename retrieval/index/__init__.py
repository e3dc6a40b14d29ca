"""Vector indexes behind one Protocol: embedded FAISS (default) and Qdrant.

Backends are imported lazily by :func:`make_index`; import ``FaissIndex`` / ``QdrantIndex`` from
their modules when a concrete type is needed.
"""

from rubricsearch.retrieval.index.factory import Backend, make_index
from rubricsearch.retrieval.index.protocol import Hit, VectorIndex

__all__ = ["Backend", "Hit", "VectorIndex", "make_index"]
