"""A set's embedder versions in service: which one embeds the set's queries (its vectors come from the same one),
the guard on activating one, the re-embedding that switches the set's vectors, and rollback.

A version is activated only when it ranks the set's held-out judgments at least as well as the active embedder on
every row and better on one (:func:`compare`): the criteria it trained on (nDCG@10 over each criterion's held-out
references) and the set's other criteria, the ones it never trained on (the collapse a fine-tune can cause
there). Activating re-embeds the set's references with the version from their packages (language-model cost, no
tower); the old vectors and the old query embedder serve until the switch, where the index's upsert and the
catalog's activation commit together. Rollback re-embeds with the previous embedder the same way.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

from rubricsearch.app.model_loading import model_config
from rubricsearch.app.training import judged_cells
from rubricsearch.app.version_guard import LoadedVersions, side_by_side, training_ids
from rubricsearch.indexer.catalog.records import SetRecord
from rubricsearch.indexer.catalog.versions import (
    BASE,
    VersionRecord,
    activate,
    active_version,
    get_version,
    previous_version_id,
    roll_back,
)
from rubricsearch.indexer.jobs.reembed import reembed_set_from_packages
from rubricsearch.retrieval.embedding.protocol import Embedder
from rubricsearch.retrieval.errors import Conflict
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.tuning.contrastive import AT, criteria, query_instruction, ranking
from rubricsearch.retrieval.tuning.embedder import TEMPERATURE
from rubricsearch.retrieval.tuning.judgments import JudgedCell, reference

if TYPE_CHECKING:  # app.state builds this module's service
    from rubricsearch.app.state import AppState

ROWS = (f"ndcg@{AT}", f"ndcg@{AT} other criteria")  # the trained criteria's, the others'; higher is better


class SetEmbedders:
    """The embedder of each set's queries: the base, or the set's active version (loaded lazily, cached)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.loaded: LoadedVersions[Embedder] = LoadedVersions(lambda embedder: embedder.close())
        self.close = self.loaded.close

    def embedder_for(self, set_id: str, base: Embedder) -> tuple[Embedder, str]:
        active = self.loaded.active(self.state.catalog, set_id, "embedder", self.load)
        return active if active is not None else (base, BASE)

    def load(self, version: VersionRecord) -> Embedder:
        def load() -> Embedder:
            from rubricsearch.retrieval.embedding import load_embedder

            return load_embedder(version.path, model_config(self.state.settings, "embedding", "local"),
                                 packages=self.state.packages)

        return self.loaded.get(version.id, load)

    def of(self, version: VersionRecord | None) -> Embedder:
        return self.state.embedder if version is None else self.load(version)


def _trained_on(state: AppState, set_record: SetRecord, version: VersionRecord | None) -> list[JudgedCell]:
    return judged_cells(state, set_record, ids=training_ids(version)) if version is not None else []


def held_out(state: AppState, set_record: SetRecord, candidate: VersionRecord, current: VersionRecord | None
             ) -> tuple[list[JudgedCell], set[str]]:
    """The set's judgments neither embedder trained on (the candidate's validation judgments and every judgment
    newer than its data snapshot, less what the active version trained on), and the criteria the candidate
    trained on."""
    data = candidate.card.get("data", {})
    trained = _trained_on(state, set_record, candidate)
    excluded = {c.judgment_id for c in trained} | {c.judgment_id for c in _trained_on(state, set_record, current)}
    validation, snapshot = set(data.get("validation_judgment_ids", [])), int(data.get("max_judgment_id", 0))
    cells = [c for c in judged_cells(state, set_record)
             if (c.judgment_id in validation or c.judgment_id > snapshot) and c.judgment_id not in excluded]
    return cells, {c.criterion for c in trained}


def _rows(embedder: Embedder, cells: Sequence[JudgedCell], trained: set[str], dim: int, usage: Usage
          ) -> dict[str, float | None]:
    """nDCG@10 of each held-out criterion judged both ways over its held-out references, averaged over the
    trained criteria and over the others (None: no such criterion)."""
    measured = [c for c in criteria(cells, {c.sha256 for c in cells}) if c.yes and c.no]
    if not measured:
        return dict.fromkeys(ROWS)
    shas = sorted({s for c in measured for s in c.judged})
    docs = embedder.embed_contents([Content(images=[reference(s)]) for s in shas], [None] * len(shas),
                                   dimensions=dim, usage=usage)
    queries = embedder.embed_contents([Content(texts=[c.text]) for c in measured],
                                      [query_instruction(c.text) for c in measured], dimensions=dim, usage=usage)
    out: dict[str, float | None] = {}
    for row, group in zip(ROWS, (True, False), strict=True):
        at = [i for i, c in enumerate(measured) if (c.text in trained) == group]
        out[row] = (round(ranking([measured[i] for i in at], queries[at] @ docs.T, shas, TEMPERATURE).ndcg, 4)
                    if at else None)
    return out


def compare(state: AppState, set_record: SetRecord, candidate: VersionRecord) -> dict[str, Any]:
    """The side-by-side table of the active embedder and ``candidate`` on the held-out judgments neither trained
    on, and whether the candidate passes: no row worse (where both have it) and at least one better. The trained
    criteria's row must be computable (:class:`Conflict` otherwise)."""
    with state.catalog.read() as session:
        current = active_version(session, set_record.id, "embedder")
    cells, trained = held_out(state, set_record, candidate, current)
    dim = state.index.dim(set_record.id) if state.index.has_set(set_record.id) else state.embedder.dimension
    usage = Usage()
    sides = {"active": _rows(state.embedders.of(current), cells, trained, dim, usage),
             "candidate": _rows(state.embedders.load(candidate), cells, trained, dim, usage)}
    if sides["active"][ROWS[0]] is None:
        raise Conflict("too few held-out judgments to compare the versions on (a criterion the version trained on, "
                       "judged yes and no on references neither version trained on): record more judgments",
                       held_out=len(cells))
    return {**side_by_side(sides["active"], sides["candidate"], [(row, "higher") for row in ROWS], current,
                           candidate),
            "held_out_judgments": len(cells),
            "vision_encodes": usage.total()}


def switch_to(state: AppState, set_record: SetRecord, version: VersionRecord, current: VersionRecord | None,
              table: dict[str, Any]) -> None:
    """Re-embed the set with the version that passed the guard (``table``) and switch the vectors and the
    active embedder together; :class:`Conflict` (nothing switched) if the active one is not ``current`` any
    more."""

    @contextmanager
    def switching() -> Iterator[None]:
        with state.catalog.write() as session:  # a changed active version refuses before any vector moves
            activate(session, set_record.id, "embedder", version.id, table,
                     expected=current.id if current is not None else None)
            yield

    _reembed(state, set_record, state.embedders.load(version), switching)


def rollback_embedder(state: AppState, set_record: SetRecord) -> str:
    """Undo the last embedder activation: re-embed the set with the embedder active before it (or the base) and
    switch back; returns what is active now."""
    with state.catalog.read() as session:
        previous_id = previous_version_id(session, set_record.id, "embedder")
        previous = get_version(session, set_record.id, previous_id) if previous_id is not None else None

    @contextmanager
    def switching() -> Iterator[None]:
        with state.catalog.write() as session:
            if roll_back(session, set_record.id, "embedder") != previous_id:
                raise Conflict("the active embedder changed while rolling back: try again", set_id=set_record.id)
            yield

    _reembed(state, set_record, state.embedders.of(previous), switching)
    return previous_id or BASE


def _reembed(state: AppState, set_record: SetRecord, embedder: Embedder, switching: Any) -> None:
    reembed_set_from_packages(state.catalog, state.index, embedder, set_record.id,
                              scratch=state.settings.data_dir / "reembed", switching=switching)
