"""A set's reranker versions in service: which one scores the set's searches, and the guard on activating one.

The active version is read from the catalog on every search of the set (one indexed read), so every process
serving the catalog switches at the next search; its checkpoint is loaded on first use and a few are kept
loaded. A version is activated only when it beats the active reranker side by side on held-out judgments that
neither model trained on: the candidate's validation judgments less the active version's training judgments,
scored by both through the trainer's forward (the pair a criteria-only search asks, from cached packages).
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from rubricsearch.app import embedder_versions
from rubricsearch.app.calibration import scorer_of
from rubricsearch.app.model_loading import model_config
from rubricsearch.app.training import judged_cells
from rubricsearch.app.version_guard import LoadedVersions, side_by_side, training_ids
from rubricsearch.indexer.catalog.records import SetRecord
from rubricsearch.indexer.catalog.versions import (
    ModelName,
    VersionRecord,
    activate,
    active_version,
    get_version,
    roll_back,
)
from rubricsearch.rerank.rubric import RubricReranker
from rubricsearch.retrieval.errors import Conflict
from rubricsearch.retrieval.metrics import ndcg_at
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.search.protocol import ShortlistScorer

if TYPE_CHECKING:  # app.state builds this module's service
    from rubricsearch.app.state import AppState

NDCG_AT = 10
# metric, which way is better
METRICS: tuple[tuple[str, str], ...] = (("auc", "higher"), ("log_loss", "lower"), ("precision_at_0.5", "higher"),
                                        (f"ndcg@{NDCG_AT}", "higher"))


class SetRerankers:
    """The reranker of each set's searches: the base, or the set's active version (loaded lazily, cached)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.loaded: LoadedVersions[RubricReranker] = LoadedVersions(lambda scorer: scorer.reranker.close())
        self.close = self.loaded.close

    def scorer_for(self, set_id: str, base: ShortlistScorer | None) -> ShortlistScorer | None:
        if base is None:
            return None
        active = self.loaded.active(self.state.catalog, set_id, "reranker", lambda version: self.load(version, base))
        return active[0] if active is not None else base

    def load(self, version: VersionRecord, base: ShortlistScorer) -> RubricReranker:
        def load() -> RubricReranker:
            from rubricsearch.rerank import load_reranker

            reranker = load_reranker(version.path, model_config(self.state.settings, "reranker", "local"),
                                     packages=self.state.packages)
            return RubricReranker(reranker, self.state.rerank_policy, version=version.id,
                                  base=getattr(base, "reranker", None))

        return self.loaded.get(version.id, load)


def _ndcg(scores: np.ndarray, labels: np.ndarray, criteria: Sequence[str]) -> float | None:
    """Mean nDCG@10 over the criteria with a yes and a no among the held-out references (None: no such one)."""
    values = []
    for criterion in sorted(set(criteria)):
        at = np.asarray([c == criterion for c in criteria])
        s, y = scores[at], labels[at].astype(np.float64)
        if y.all() or not y.any():
            continue
        values.append(ndcg_at(np.argsort(-s, kind="stable").tolist(), y.tolist(), NDCG_AT))
    return round(float(np.mean(values)), 4) if values else None


def held_out_metrics(scorer: RubricReranker | ShortlistScorer, cells: Sequence[Any]) -> dict[str, Any]:
    from rubricsearch.rerank.tuning import Metrics
    from rubricsearch.rerank.tuning.cells import example

    usage = Usage()
    scores = scorer.reranker.score_pairs([example(c).pair for c in cells], usage=usage)  # type: ignore[union-attr]
    labels = [c.holds for c in cells]
    metrics = Metrics.of(scores, labels).to_json()
    metrics[f"ndcg@{NDCG_AT}"] = _ndcg(np.asarray(scores), np.asarray(labels), [c.criterion for c in cells])
    metrics["vision_encodes"] = usage.total()
    return metrics


def compare(state: AppState, set_record: SetRecord, candidate: VersionRecord) -> dict[str, Any]:
    """The side-by-side table of the active reranker and ``candidate`` on the held-out judgments neither trained
    on, and whether the candidate passes: no metric worse (where both have it) and at least one better."""
    with state.catalog.read() as session:
        current = active_version(session, set_record.id, "reranker")
    held_out = set(candidate.card.get("data", {}).get("validation_judgment_ids", [])) - training_ids(current)
    cells = judged_cells(state, set_record, ids=held_out)
    if len({c.holds for c in cells}) < 2:
        raise Conflict("too few held-out judgments to compare the versions on (they need a yes and a no that "
                       "neither version trained on): record more judgments and train again",
                       held_out=len(cells))
    base = scorer_of(state.search)
    active_scorer = base if current is None else state.rerankers.load(current, base)
    candidate_scorer = state.rerankers.load(candidate, base)
    sides = {"active": held_out_metrics(active_scorer, cells), "candidate": held_out_metrics(candidate_scorer, cells)}
    return {**side_by_side(sides["active"], sides["candidate"], METRICS, current, candidate),
            "held_out_judgments": len(cells),
            "vision_encodes": sides["active"]["vision_encodes"] + sides["candidate"]["vision_encodes"]}


def activate_version(state: AppState, set_record: SetRecord, version_id: str) -> dict[str, Any]:
    """Make the version the set's active model of its kind if it beats the active one (an embedder's:
    re-embedding the set: :func:`app.embedder_versions.switch_to`); else :class:`Conflict` with the table, and nothing
    changes."""
    with state.catalog.read() as session:
        version = get_version(session, set_record.id, version_id)
        current = active_version(session, set_record.id, version.model)  # type: ignore[arg-type]
    if current is not None and current.id == version.id:
        raise Conflict("this version is the active one already", version_id=version_id)
    if not Path(version.path).is_dir():
        raise Conflict("the version's checkpoint folder is gone from the data dir", path=version.path)
    table = (embedder_versions.compare if version.model == "embedder" else compare)(state, set_record, version)
    if not table["passed"]:
        raise Conflict(f"the version does not beat the active {version.model} on the held-out judgments: not "
                       "activated", comparison=table)
    if version.model == "embedder":
        embedder_versions.switch_to(state, set_record, version, current, table)
        return table
    with state.catalog.write() as session:
        activate(session, set_record.id, "reranker", version.id, table,
                 expected=current.id if current is not None else None)
    return table


def rollback(state: AppState, set_record: SetRecord, model: ModelName = "reranker") -> str:
    """Undo the last activation of ``model``; returns what is active now (``base`` or a version id)."""
    if model == "embedder":
        return embedder_versions.rollback_embedder(state, set_record)
    with state.catalog.write() as session:
        now = roll_back(session, set_record.id, "reranker")
    return now or "base"
