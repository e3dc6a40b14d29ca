"""The reranker's part of the accelerated local engine, a plug-in loaded by name (:mod:`.runtime`): packed
shared-prefix shortlist passes and their CUDA graphs, over :mod:`retrieval.plugins.accelerated`."""
