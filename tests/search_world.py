"""Shared set-up for the search-service tests: references indexed as ingestion indexes them."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.rubric import POLICY_FILE, RerankPolicy, RubricReranker
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.images import ReferenceImage, decode_image
from rubricsearch.retrieval.index.factory import make_index
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.search import SearchService


def indexed_pngs(packages: VisualPackages, emb: Any, index: Any, set_id: str,
                 make_png: Callable[[int, int, int], bytes], count: int, seed: int) -> dict[str, bytes]:
    """``count`` noise PNGs of growing width as one set's references: a package for every distinct tower (as
    ingestion builds them) and a 96-dimension vector each; returns their bytes by sha256."""
    index.create_set(set_id, 96)
    blobs: dict[str, bytes] = {}
    for i in range(count):
        data = make_png(64 + 8 * i, 96, seed + i)
        image = decode_image(data)
        blobs[image.sha256] = data
        packages.build([image])
        index.upsert(set_id, [image.sha256], emb.embed([{"image": data}], dimensions=96))
    return blobs


@dataclass
class PolicyWorld:
    """Tiny real models, a reranker checkpoint carrying a given policy file (``measured``) and a FAISS set "refs"
    of indexed PNGs: what the rerank-policy tests search."""

    emb: Any
    rr: Any
    index: Any
    blobs: dict[str, bytes]
    measured: Path

    def service(self, policy: RerankPolicy) -> SearchService:
        """The search service with the reranker under ``policy`` (read from ``measured``, or none)."""
        blobs = self.blobs
        return SearchService(self.emb, RubricReranker(self.rr, policy), self.index,
                             lambda sha: ReferenceImage(sha, lambda: blobs[sha]))


@contextmanager
def policy_world(root: Path, embedding_dir: Path, reranker_dir: Path, make_png: Callable[[int, int, int], bytes],
                 policy: dict[str, Any], seed: int) -> Iterator[PolicyWorld]:
    """A :class:`PolicyWorld` under ``root``, its models closed on exit."""
    measured = root / "measured-reranker"
    shutil.copytree(reranker_dir, measured)
    (measured / POLICY_FILE).write_text(json.dumps(policy))
    packages = VisualPackages(PackageStore(root / "packages", storage_dtype="float32"))
    emb = load_embedder(str(embedding_dir), packages=packages)
    rr = load_reranker(str(measured), packages=packages)
    index = make_index("faiss", path=root / "faiss")
    try:
        yield PolicyWorld(emb, rr, index, indexed_pngs(packages, emb, index, "refs", make_png, 10, seed), measured)
    finally:
        emb.close()
        rr.close()
