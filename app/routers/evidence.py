"""``POST /v1/sets/{set}/evidence``: where in one reference the reranker judged one criterion."""

from __future__ import annotations

from typing import Annotated

import anyio
from fastapi import APIRouter, Body

from rubricsearch.app.deps import ADMITTED, JSON_BODY, ImageResolver, SearchAccess, SetPath, StateDep
from rubricsearch.app.evidence import local_runtime, reference_evidence, unavailable
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.evidence import EvidenceBody, EvidenceOut
from rubricsearch.app.sets import find_set, find_set_image
from rubricsearch.app.state import AppState

router = APIRouter(prefix="/v1", tags=["search"], route_class=BoundedJsonRoute)

DESCRIPTION = """\
A map over the reference's merged visual tokens (its cached package's grid) of how much each cell weighed in
the reranker's judgement of the criterion, with the box of the original image each cell covers: computed from
the cached package, so the vision tower does not run for the reference (`vision_encodes`). A negated criterion
("no X") is explained by its positive statement (`of`). With a `candidate`, the criterion is judged as a search
with that candidate judges it, and with `candidate_map` the candidate's map comes too. Without the reranker in
this process (the vLLM backend), the answer says evidence is unavailable and why.
"""


def _evidence(state: AppState, set_id: str, body: EvidenceBody) -> EvidenceOut:
    record = find_set(state, set_id)
    reference = find_set_image(state, record.id, body.image_id)
    candidate = ImageResolver(state).image(body.candidate) if body.candidate is not None else None
    runtime = local_runtime(state)
    if isinstance(runtime, str):
        return unavailable(body.criterion, runtime)
    return reference_evidence(state, runtime, reference, body.criterion, candidate, body.method,
                              body.candidate_map)


@router.post("/sets/{set_id}/evidence", summary="Evidence: where in a reference a criterion was judged",
             description=DESCRIPTION, responses=error_responses(400, 401, 403, 404, 413, 415, 422, 429, 503),
             dependencies=[JSON_BODY, ADMITTED])
async def post_evidence(set_id: SetPath, body: Annotated[EvidenceBody, Body()], state: StateDep,
                        _: SearchAccess) -> EvidenceOut:
    return await anyio.to_thread.run_sync(_evidence, state, set_id, body)
