"""Liveness (``/healthz``), readiness (``/readyz``) and Prometheus metrics (``/metrics``)."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST

from rubricsearch.app.deps import not_ready
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.health import Liveness, Readiness
from rubricsearch.retrieval.errors import BackendUnavailable

router = APIRouter(tags=["health"], route_class=BoundedJsonRoute)


@router.get("/healthz", summary="The process is up")
def healthz() -> Liveness:
    return Liveness()


@router.get("/readyz", summary="Models loaded, catalog reachable, index healthy; the vision towers in use",
            responses=error_responses(503))
def readyz(request: Request) -> Readiness:
    state = getattr(request.app.state, "rubricsearch", None)
    if state is None:
        raise not_ready(request)
    checks = state.readiness()
    failing = [name for name, ok in checks.items() if not ok]
    if failing:
        paused = state.ingestion_.paused if state.ingestion_ is not None else None
        raise BackendUnavailable(f"not ready: {', '.join(failing)}" + (f" ({paused})" if paused else ""),
                                 checks=checks)
    towers = state.packages.describe()
    return Readiness(checks=checks, test_models=state.test_models, models_label=state.models_label,
                     towers=towers["towers"],
                     towers_shared=towers["shared"], unknown_towers=towers["unknown_roles"])


@router.get("/metrics", summary="Prometheus metrics", response_class=Response,
            responses={200: {"content": {CONTENT_TYPE_LATEST: {}}, "description": "Prometheus text format"}})
def metrics(request: Request) -> Response:
    return Response(request.app.state.metrics.render(), media_type=CONTENT_TYPE_LATEST)
