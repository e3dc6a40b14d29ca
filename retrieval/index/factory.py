"""One place that turns a backend name and its options into a :class:`VectorIndex`.

Backends are named here and imported by dotted path only when chosen, so a FAISS deployment never imports
qdrant-client (nor the reverse), and the core never imports a plug-in: ``"faiss"`` is the reference FAISS index
with the accelerated filtered and device search layered on (:mod:`retrieval.index.faiss_accel`), ``"faiss-reference"``
the plain one alone.
"""

from __future__ import annotations

import importlib
from typing import Any, Literal

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.index.protocol import VectorIndex

Backend = Literal["faiss", "faiss-reference", "qdrant"]
BACKENDS: dict[str, str] = {
    "faiss": "rubricsearch.retrieval.index.faiss_accel:AcceleratedFaissIndex",
    "faiss-reference": "rubricsearch.retrieval.index.faiss_index:FaissIndex",
    "qdrant": "rubricsearch.retrieval.index.qdrant_index:QdrantIndex",
}


def make_index(backend: Backend | str, **options: Any) -> VectorIndex:
    """Build a backend; ``options`` go to its constructor.

    The FAISS backends need ``path``; QdrantIndex needs ``url`` (server) or ``path`` (local mode).
    """
    target = BACKENDS.get(backend)
    if target is None:
        raise InvalidInput(f"unknown vector index backend {backend!r}: expected one of {', '.join(BACKENDS)}")
    module, _, name = target.partition(":")
    index: VectorIndex = getattr(importlib.import_module(module), name)(**options)
    return index
