"""Per-criterion evidence of a set's references (``POST /v1/sets/{set}/evidence`` and ``explain`` on a search).

Evidence needs the reranker's language model in this process (:class:`~rerank.local.LocalScoringRuntime`): the
maps come from a backward pass or from edited packages, and vLLM's pooling runner offers neither. With another
backend each answer says it is unavailable and why.
"""

from __future__ import annotations

import time

from rubricsearch.app.schemas.evidence import EXPLAIN_MAX_HITS, EvidenceOut, ImageMapOut
from rubricsearch.app.services import reference_resolver
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import ImageRecord
from rubricsearch.rerank.evidence import Evidence, Method, explain_many
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.task import TaskReranker
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.qwen.model.prompts import Content


def local_runtime(state: AppState) -> LocalScoringRuntime | str:
    """The reranker runtime evidence runs on, or why there is none."""
    reranker = state.reranker_
    if reranker is None:
        return "no reranker is loaded in this process"
    runtime = reranker.runtime if isinstance(reranker, TaskReranker) else None
    if not isinstance(runtime, LocalScoringRuntime):
        return ("the reranker is served by vLLM, whose pooling runner has no backward pass and takes no edited "
                "visual packages; evidence needs the reranker loaded in this process (backend local)")
    return runtime


def unavailable(criterion: str, reason: str) -> EvidenceOut:
    return EvidenceOut(available=False, reason=reason, criterion=criterion)


def reference_evidence(state: AppState, runtime: LocalScoringRuntime, reference: ImageRecord, criterion: str,
                       candidate: ImageLike | None = None, method: Method | None = None,
                       candidate_maps: bool = False) -> EvidenceOut:
    """The evidence of ``criterion`` on one reference of a set (judged against the candidate when given, whose
    own map comes with ``candidate_maps``)."""
    return references_evidence(state, runtime, [reference], [criterion], candidate, method, candidate_maps)[0][0]


def references_evidence(state: AppState, runtime: LocalScoringRuntime, references: list[ImageRecord],
                        criteria: list[str], candidate: ImageLike | None = None, method: Method | None = None,
                        candidate_maps: bool = False) -> list[list[EvidenceOut]]:
    """Per reference, the evidence of every criterion, computed together (:func:`rerank.evidence.explain_many`);
    each answer's ``timings_ms.evidence`` is the whole batch's time (the maps share their passes)."""
    started = time.perf_counter()
    resolve = reference_resolver(state.settings, state.blobs)
    handles = [resolve(reference.sha256) for reference in references]
    sizes = {reference.sha256: _size(reference, handle) for reference, handle in zip(references, handles, strict=True)}
    if candidate is not None:
        sizes[candidate.sha256] = candidate.image.size
    asks = [(criterion, Content(images=[handle])) for handle in handles for criterion in criteria]
    found = explain_many(runtime, asks, sizes, candidate=candidate, method=method, candidate_maps=candidate_maps)
    timings = {"evidence": (time.perf_counter() - started) * 1000}
    outs = [evidence_out(one, timings_ms=timings) for one in found]
    return [outs[i * len(criteria):(i + 1) * len(criteria)] for i in range(len(references))]


def _size(record: ImageRecord, handle: ImageLike) -> tuple[int, int]:
    if record.width is not None and record.height is not None:
        return record.width, record.height
    width, height = handle.image.size  # decoded only for a record without its size
    return width, height


def evidence_out(found: Evidence, *, timings_ms: dict[str, float]) -> EvidenceOut:
    return EvidenceOut(
        available=True, criterion=found.criterion, method=found.method, statement=found.statement, of=found.of,
        instruction=found.instruction, p_yes=found.p_yes, vision_encodes=found.vision_encodes, timings_ms=timings_ms,
        images=[ImageMapOut(sha256=m.sha256, role=m.role, width=m.size[0], height=m.size[1], rows=m.grid[0],
                            cols=m.grid[1], boxes=[[list(b) for b in row] for row in m.boxes], values=m.values)
                for m in found.images])


def explain_hits(state: AppState, references: list[ImageRecord], criteria: list[str], asked: bool | list[str],
                 candidate: ImageLike | None, method: Method | None = None, candidate_maps: bool = False
                 ) -> list[list[EvidenceOut]]:
    """A search's ``explain``: per hit (at most :data:`EXPLAIN_MAX_HITS`, the rest get none), the evidence of every
    criterion asked (``True``: all of the search's criteria), all computed together; the candidate's maps too
    with ``candidate_maps``."""
    if asked is False:
        return [[] for _ in references]
    if not criteria:
        raise InvalidInput("explain needs a search with criteria (list them in `criteria`)")
    chosen = criteria if asked is True else [c.strip() for c in asked]
    unknown = [c for c in chosen if c not in criteria]
    if unknown:
        raise InvalidInput(f"explain names criteria the search does not have: {unknown}", criteria=unknown)
    runtime = local_runtime(state)
    shown = references[:EXPLAIN_MAX_HITS]
    if isinstance(runtime, str):
        out = [[unavailable(c, runtime) for c in chosen] for _ in shown]
    else:
        out = references_evidence(state, runtime, shown, chosen, candidate, method, candidate_maps) if shown else []
    return out + [[] for _ in references[EXPLAIN_MAX_HITS:]]
