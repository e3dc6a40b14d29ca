"""Facet quality on the held-out generated faces: do the computed facets name each face's true attributes?

The faces' five attributes (:data:`app.demo.faces.VALUES`) are the schema, each value described by the
criterion text the demo models know ("triangular ears", "ginger fur"). The references get their packages
as ingestion builds them, then their facets through the facet job's own computation
(:func:`indexer.jobs.facets.compute_facets`, cached packages only), so a bug on that path shows here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion, Face
from rubricsearch.indexer.catalog.facets import FacetSchema, check_schema
from rubricsearch.indexer.jobs.facets import compute_facets
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import Usage


def demo_schema() -> FacetSchema:
    return check_schema({"attributes": [
        {"name": a, "values": [{"value": v, "description": Criterion(a, v).text} for v in VALUES[a]]}
        for a in ATTRIBUTES]})


@dataclass(frozen=True)
class FacetQuality:
    accuracy: dict[str, float]  # per attribute: chosen value == the face's true value
    chance: dict[str, float]  # the most frequent true value's share (a constant guess)
    images: int
    vision_encodes: int  # during the facet computation (the promise: 0)

    @property
    def mean(self) -> float:
        return sum(self.accuracy.values()) / len(self.accuracy)


def facet_quality(reranker_path: str, docs: list[Face], images: list[ImageLike]) -> FacetQuality:
    """Load the reranker, build the references' packages (ingestion), compute and score their facets."""
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages

    packages = VisualPackages(PackageStore(storage_dtype="float32"))
    reranker: Any = load_reranker(reranker_path, device="cpu", packages=packages)
    try:
        packages.build(images)
        schema = demo_schema()
        usage = Usage()
        shas = [img.sha256 for img in images]
        facets = compute_facets(reranker, schema.attributes, shas, usage=usage)
    finally:
        reranker.close()
    accuracy: dict[str, float] = {}
    chance: dict[str, float] = {}
    for attr in ATTRIBUTES:
        truth = [face.value(attr) for face in docs]
        hits = sum(facets[sha][attr]["value"] == t for sha, t in zip(shas, truth, strict=True))
        accuracy[attr] = hits / len(docs)
        chance[attr] = max(truth.count(v) for v in set(truth)) / len(docs)
    return FacetQuality(accuracy, chance, len(docs), usage.total())


def zero_shot_accuracy(embedding_path: str, docs: list[Face], images: list[ImageLike]) -> dict[str, float]:
    """The alternative the facets do not use, measured beside them: the embedder's zero-shot choice (the
    value whose text query, under the product's criteria-search instruction, is nearest the reference)."""
    import numpy as np

    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.qwen.model.prompts import Content
    from rubricsearch.retrieval.search.instructions import QUERY_TEXT_ONLY

    packages = VisualPackages(PackageStore(storage_dtype="float32"))
    embedder: Any = load_embedder(embedding_path, device="cpu", packages=packages)
    try:
        refs = np.asarray(embedder.embed_contents([Content(images=[img]) for img in images], [None] * len(images)))
        out: dict[str, float] = {}
        for attr in ATTRIBUTES:
            texts = [Criterion(attr, v).text for v in VALUES[attr]]
            queries = np.asarray(embedder.embed_contents([Content(texts=[t]) for t in texts],
                                                         [QUERY_TEXT_ONLY.format(criteria=t) for t in texts]))
            chosen = (refs @ queries.T).argmax(axis=1)
            out[attr] = float(np.mean([VALUES[attr][c] == face.value(attr) for c, face in zip(chosen, docs,
                                                                                               strict=True)]))
        return out
    finally:
        embedder.close()
