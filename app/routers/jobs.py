"""Ingestion jobs: list, read, cancel, and a Server-Sent Events stream of a job's progress."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import AsyncIterator
from typing import Annotated, Any

import anyio
from fastapi import APIRouter, Path, Query, Request
from fastapi.responses import StreamingResponse

from rubricsearch.app.deps import AdminAccess, SearchAccess, SettingsDep, StateDep, StoresDep
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.jobs import JobList, JobOut
from rubricsearch.app.sets import find_set
from rubricsearch.app.views import job_out
from rubricsearch.indexer.jobs import IngestionService
from rubricsearch.retrieval.errors import Conflict, NotFound

router = APIRouter(prefix="/v1", tags=["jobs"], route_class=BoundedJsonRoute)
# A progress check is one catalog read; twice a second looks live and costs nothing.
SSE_POLL_INTERVAL_S = 0.5
# A comment line after 15 s of quiet keeps the stream below proxies' idle timeouts (nginx's is 60 s).
SSE_HEARTBEAT_S = 15.0

JobPath = Annotated[str, Path(description="The job id.", max_length=64)]

EVENTS_DESCRIPTION = """\
A `text/event-stream` (Server-Sent Events) of the job: `event: progress` with the Job as JSON `data`
whenever its counts or state change, a `: heartbeat` comment line on a quiet stream (every 15 s by
default), and a last `event: done` with the finished Job, after which the server ends the stream.

```js
const events = new EventSource(`/v1/jobs/${id}/events`);
events.addEventListener("progress", e => show(JSON.parse(e.data)));
events.addEventListener("done", e => { show(JSON.parse(e.data)); events.close(); });
```
"""



@router.get("/jobs", summary="Ingestion jobs, newest first", responses=error_responses(401, 404, 422, 429))
def get_jobs(
    state: StoresDep,
    _: SearchAccess,
    set_id: Annotated[str | None, Query(description="Only this set's jobs (id or name).")] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 50,
) -> JobList:
    service = state.ingestion
    wanted = find_set(state, set_id).id if set_id is not None else None
    return JobList(data=[job_out(service, j) for j in service.list_jobs(set_id=wanted, limit=limit)])


@router.get("/jobs/{job_id}", summary="An ingestion job", responses=error_responses(401, 404, 422, 429))
def get_job(job_id: JobPath, state: StoresDep, _: SearchAccess) -> JobOut:
    service = state.ingestion
    return job_out(service, service.get_job(job_id))


@router.post("/jobs/{job_id}/cancel", status_code=202, summary="Cancel a job",
             description="Pending items are cancelled at once; items being processed finish, then the job "
                         "is `cancelled`. 409 if the job has already finished.",
             responses=error_responses(401, 403, 404, 409, 422))
def cancel_job(job_id: JobPath, state: StateDep, _: AdminAccess) -> JobOut:
    service = state.ingestion
    if service.get_job(job_id).finished:
        raise Conflict("the job has already finished", job_id=job_id)
    return job_out(service, service.cancel(job_id))


def _event(name: str, job: JobOut) -> str:
    return f"event: {name}\ndata: {json.dumps(job.model_dump(mode='json'), separators=(',', ':'))}\n\n"


async def job_events(service: IngestionService, job_id: str, *, poll_s: float, heartbeat_s: float,
                     stopping: threading.Event) -> AsyncIterator[str]:
    """The SSE lines for one job until it finishes (or disappears with its set), or the server stops (a client
    reconnects, as EventSource does by itself)."""
    last: tuple[Any, ...] | None = None
    quiet_since = time.monotonic()
    while not stopping.is_set():
        try:
            job = await anyio.to_thread.run_sync(service.get_job, job_id)
        except NotFound:
            yield "event: error\ndata: {\"type\":\"not_found\",\"message\":\"the job was deleted\"}\n\n"
            return
        key = (job.state, job.total, job.done, job.failed, job.skipped)
        if key != last:
            last = key
            yield _event("progress", await anyio.to_thread.run_sync(job_out, service, job))
            quiet_since = time.monotonic()
        if job.finished:
            yield _event("done", await anyio.to_thread.run_sync(job_out, service, job))
            return
        if time.monotonic() - quiet_since >= heartbeat_s:
            yield ": heartbeat\n\n"
            quiet_since = time.monotonic()
        await anyio.sleep(poll_s)


@router.get("/jobs/{job_id}/events", summary="Progress of a job as Server-Sent Events",
            description=EVENTS_DESCRIPTION, response_class=StreamingResponse,
            responses={200: {"content": {"text/event-stream": {"example": (
                'event: progress\ndata: {"id":"5b1a...","state":"running","done":64,"total":120,...}\n\n'
                ': heartbeat\n\nevent: done\ndata: {"id":"5b1a...","state":"succeeded",...}\n\n')}},
                "description": "An event stream that ends when the job finishes"},
                       **error_responses(401, 404, 422, 429)})
async def stream_job_events(job_id: JobPath, request: Request, state: StateDep, settings: SettingsDep,
                            _: SearchAccess) -> StreamingResponse:
    service = state.ingestion
    await anyio.to_thread.run_sync(service.get_job, job_id)  # 404 now, not inside the stream
    events = job_events(service, job_id, poll_s=SSE_POLL_INTERVAL_S, heartbeat_s=SSE_HEARTBEAT_S,
                        stopping=request.app.state.stopping)
    return StreamingResponse(events, media_type="text/event-stream",
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
