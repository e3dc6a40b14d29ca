"""Optional reranker machinery behind the core's seams, loaded by name (:mod:`retrieval.runtime.registry`), never
imported by the core."""
