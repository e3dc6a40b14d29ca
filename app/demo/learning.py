"""The learning test (issue 48): teach the demo reranker an attribute the demo models never saw, the collar.

Faces wearing the optional collar (:func:`app.demo.faces.with_collars`) are ingested as ingestion ingests
references (one package each, made once); N of the ``tune`` split are judged on both collar criteria ("a red
collar", "a blue collar": yes where the face wears that colour); :func:`rerank.tuning.fine_tune_reranker`, the
product's trainer, trains a version from those judgments and the packages; the version is saved and loaded as the
product loads a checkpoint, and this module measures it on held-out faces next to the base:

- the collar criteria's AUC (the raw P(yes) of each criterion over the held-out collar faces);
- the share of two-criterion rubrics pairing a collar criterion with another attribute's whose top 5 all meet
  both, the reranker ordering the whole held-out pool (the embedder was not trained: its recall order knows no
  collar, so the shortlist is every face);
- what every other query kind does on the standard held-out faces (no collar): nDCG@10 of each search kind
  through the product's service, and each other criterion's AUC.

Every image is encoded once, when packaged; training and scoring read packages (the encodes are counted).
"""

from __future__ import annotations

import random
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from rubricsearch.app.demo.evaluation import EVAL_SEED, eval_queries, eval_set, per_query
from rubricsearch.app.demo.faces import (
    ATTRIBUTES,
    COLLAR_VALUES,
    DEFAULT_SIZE,
    VALUES,
    Criterion,
    Face,
    Split,
    draw_face,
    faces,
    png_bytes,
    with_collars,
)
from rubricsearch.app.demo.probe import probe_accuracy
from rubricsearch.app.demo.rubrics import Query
from rubricsearch.app.demo.search_eval import SearchBench, auc
from rubricsearch.app.demo.training import pooled_tokens
from rubricsearch.rerank.tuning import JudgedCell, Tuned, TuningSettings, fine_tune_reranker, save_version
from rubricsearch.rerank.tuning.cells import example
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.runtime.config import LocalConfig

POOL_SEED = 48  # the judged references: ``tune`` faces (never trained on by the demo models)
COLLAR = [Criterion("collar", v) for v in COLLAR_VALUES if v != "none"]
# per search kind: a kind's change is judged against 0.02 of nDCG@10, and the paired standard error of a change
# over 25 queries is about 0.01 (docs/fine-tuning.md), over 100 about 0.004
KIND_QUERIES = 100


def collar_faces(split: Split, count: int, seed: int) -> tuple[list[Face], list[ImageLike]]:
    chosen = with_collars(faces(split, count, seed=seed), seed=seed)
    return chosen, [decode_image(png_bytes(draw_face(f, size=DEFAULT_SIZE, seed=seed))) for f in chosen]


def other_criteria() -> list[Criterion]:
    """Every other attribute value as a presence ("no forehead stripes" is "dark forehead stripes" flipped)."""
    return [c for c in (Criterion(a, v) for a in ATTRIBUTES for v in VALUES[a]) if not c.negative]


def rubrics(docs: Sequence[Face], *, least: int = 5) -> list[Query]:
    """Another attribute's presence, then a collar criterion: every pair with at least ``least`` held-out faces
    meeting both (a top 5 that can be all right)."""
    out = [Query("criteria", (other, collar)) for collar in COLLAR for other in other_criteria()]
    return [q for q in out if sum(q.relevant(f) for f in docs) >= least]


def judged_cells(pool: Sequence[Face], images: Sequence[ImageLike], n: int, others: int = 1) -> list[JudgedCell]:
    """The first ``n`` pool references judged as a team judging its rubrics would: on both collar criteria, and
    on ``others`` other criteria each (seeded), the judgments a set already holds; what they keep of the other
    criteria is measured in docs/fine-tuning.md."""
    rng = random.Random(f"judged:{POOL_SEED}")
    known = other_criteria()
    cells: list[JudgedCell] = []
    for face, img in zip(pool[:n], images[:n], strict=True):
        for c in (*COLLAR, *rng.sample(known, min(others, len(known)))):
            cells.append(JudgedCell(len(cells) + 1, img.sha256, c.text, c.holds(face)))
    return cells


@dataclass(frozen=True)
class Measured:
    """One reranker on the held-out faces."""

    collar_auc: dict[str, float]  # per collar criterion
    rubric_top5: float  # share of collar rubrics whose top 5 all meet both criteria
    rubrics: int
    kinds_queries: dict[str, list[float]]  # each query's nDCG@10 per search kind, standard faces
    other_auc: dict[str, float]  # per other criterion, standard faces

    @property
    def kinds_ndcg10(self) -> dict[str, float]:
        """Mean nDCG@10 per search kind."""
        return {k: float(np.mean(v)) for k, v in self.kinds_queries.items()}

    def to_json(self) -> dict[str, Any]:
        """The fields and the means, as the bench's JSON report writes them."""
        return {**asdict(self), "kinds_ndcg10": self.kinds_ndcg10}


class Learning:
    """The collar faces and the standard faces, ingested once each; the pool's packages beside them."""

    def __init__(self, embedding: Path, reranker: Path, *, pool: int = 200, held_out: int = 150,
                 standard: int = 200) -> None:
        self.base = reranker
        self.pool, self.pool_images = collar_faces("tune", pool, POOL_SEED)
        docs, images = collar_faces("eval", held_out, EVAL_SEED)
        self.collared = SearchBench(str(embedding), str(reranker), docs, images)
        self.collared.packages.build(self.pool_images)  # the judged references are indexed too
        plain, plain_images = eval_set(standard)
        self.standard = SearchBench(str(embedding), str(reranker), plain, plain_images)
        self.packaging_encodes = self.encodes()
        self.rubric_queries = rubrics(docs)

    def encodes(self) -> int:
        return sum(sum(b.packages.encode_counts().values()) for b in (self.collared, self.standard))

    def use(self, reranker: Path) -> None:
        for bench in (self.collared, self.standard):
            bench.use_reranker(reranker)

    def measure(self) -> Measured:
        c, s = self.collared, self.standard
        top5 = [all(q.relevant(c.docs[c.position[h.sha256]])
                    for h in c.search(q, rerank=True, shortlist=len(c.docs), always=True)[:5])
                for q in self.rubric_queries]
        queries = eval_queries(KIND_QUERIES)
        rows = per_query(queries, s.docs, [s.ranking(q, rerank=True, shortlist=20) for q in queries])
        kinds = {kind: [ndcg10 for _, _, ndcg10 in r] for kind, r in rows.items()}
        return Measured(_aucs(c, COLLAR), float(np.mean(top5)), len(top5), kinds, _aucs(s, other_criteria()))

    def train(self, n: int, settings: TuningSettings, others: int = 1, *, keep: Path | None = None
              ) -> tuple[Measured, Tuned]:
        """Fine-tune on ``n`` judged references; the version's measurement and the training (its wall time,
        loading the base included, steps and vision encodes). The version is saved under ``keep`` if given (to
        diagnose it later), else in a temporary folder. The benches serve the base again afterwards."""
        tuned = fine_tune_reranker(self.base, judged_cells(self.pool, self.pool_images, n, others),
                                   self.collared.packages.store, settings=settings, local=LocalConfig(device="cpu"))
        with tempfile.TemporaryDirectory(prefix="learning-") as tmp:
            folder = keep or Path(tmp) / "version"
            save_version(tuned, folder)
            return self.measure_version(folder), tuned

    def measure_version(self, version: Path) -> Measured:
        """A saved version's measurement; the benches serve the base again afterwards."""
        self.use(version)
        try:
            return self.measure()
        finally:
            self.use(self.base)

    def collar_scores(self) -> dict[str, np.ndarray]:
        """P(yes) of every collar and other criterion (by statement) over the held-out collar faces, from the
        reranker the benches serve now."""
        c = self.collared
        return {k: np.asarray(v[0]) for k, v in
                criteria_scores(c.reranker, c.docs, c.images, [*COLLAR, *other_criteria()]).items()}

    def close(self) -> None:
        self.collared.close()
        self.standard.close()


def _aucs(bench: SearchBench, criteria: Sequence[Criterion]) -> dict[str, float]:
    return criteria_auc(bench.reranker, bench.docs, bench.images, criteria)


def criteria_scores(reranker: Any, docs: Sequence[Face], images: Sequence[ImageLike], criteria: Sequence[Criterion]
                    ) -> dict[str, tuple[list[float], list[bool]]]:
    """Each criterion's raw P(yes) over the faces (asked as search asks a criterion without a candidate), and
    whether it holds."""
    out = {}
    for c in criteria:
        rows = [example(JudgedCell(0, img.sha256, c.text, c.holds(f))) for f, img in zip(docs, images, strict=True)]
        out[c.text] = (reranker.score_pairs([r.pair for r in rows]), [r.yes for r in rows])
    return out


def criteria_auc(reranker: Any, docs: Sequence[Face], images: Sequence[ImageLike], criteria: Sequence[Criterion]
                 ) -> dict[str, float]:
    """Each criterion's AUC over the faces, of the raw P(yes) the reranker gives its statement."""
    return {k: auc(*v) for k, v in criteria_scores(reranker, docs, images, criteria).items()}


def probe(learning: Learning, attributes: Sequence[str] = ("collar", "stripes", "fur"), l2: float = 1e-2
          ) -> dict[str, float]:
    """Held-out accuracy of a linear probe per attribute on the packages' pooled tokens: fitted on the pool's
    faces, scored on the held-out collar faces. The ceiling under what training the language model can reach."""
    c = learning.collared
    found = c.reranker.packages.find(learning.pool_images + list(c.images))

    def features(images: Sequence[ImageLike]) -> torch.Tensor:
        return torch.stack([pooled_tokens(found[img.sha256].embeds.float()) for img in images])

    x_fit, x_test = features(learning.pool_images), features(c.images)
    labels = {a: (COLLAR_VALUES if a == "collar" else VALUES[a], [f.value(a) for f in learning.pool],
                  [f.value(a) for f in c.docs]) for a in attributes}
    return probe_accuracy(x_fit, x_test, labels, l2)
