"""Prometheus metrics: HTTP traffic by route template, plus model, vision-tower, package-store and job numbers.

Each app has its own registry (several apps can live in one test process). Model and store counters
are read from their ``stats`` at scrape time, so the hot paths carry no metrics code; "package hits"
are vision-encoder runs saved by the feature store. ``rubricsearch_vision_encodes_total`` counts every
tower run by model role, tower and purpose: ``purpose="reference"`` is a reference encoded while
serving, which the product promises never to need (it stays 0 once every tower's packages exist).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from rubricsearch.app.state import AppState

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)
_MODEL_COUNTERS = {
    "package_hits": "Images whose visual package came from the store (vision encoder runs saved)",
    "package_misses": "Images that needed a vision encoder run",
    "lm_tokens": "Language-model tokens processed",
    "embedded_items": "Inputs embedded",
    "scored_pairs": "Query-document pairs scored",
}
_STORE_COUNTERS = ("hits", "misses", "writes", "corrupt")


class Metrics:
    """The registry of one app, its HTTP instruments and a collector that reads the app state."""

    def __init__(self, state: Callable[[], AppState | None]) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self.requests = Counter("rubricsearch_http_requests", "HTTP requests by route template and status",
                                ["method", "route", "status"], registry=self.registry)
        self.latency = Histogram("rubricsearch_http_request_duration_seconds", "HTTP request latency",
                                 ["method", "route"], buckets=LATENCY_BUCKETS, registry=self.registry)
        self.in_flight = Gauge("rubricsearch_http_requests_in_flight", "HTTP requests being served",
                               registry=self.registry)
        self.registry.register(StateCollector(state))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class StateCollector(Collector):
    def __init__(self, state: Callable[[], AppState | None]) -> None:
        self.state = state

    def collect(self) -> Iterator[Metric]:
        state = self.state()
        if state is None:
            return
        yield from _model_metrics(state)
        queue = GaugeMetricFamily("rubricsearch_model_queue_inputs", "Inputs waiting for a model's device",
                                  labels=["model"])
        for kind, n in state.queued_inputs().items():
            queue.add_metric([kind], float(n))
        yield queue
        yield CounterMetricFamily("rubricsearch_admission_refusals", "Requests refused (503 overloaded) because "
                                  "the model queues were full", value=float(state.admission_refusals))
        yield from _tower_metrics(state)
        yield from _store_metrics(state.packages.store.stats())
        if state.packages.queries is not None:
            yield from _query_tier_metrics(state.packages.queries.stats())
        yield GaugeMetricFamily("rubricsearch_test_models", "1 when offline test checkpoints are served",
                                value=float(state.test_models))
        yield from _job_metrics(state)


def _model_metrics(state: AppState) -> Iterator[Metric]:
    families = {name: CounterMetricFamily(f"rubricsearch_{name}", doc, labels=["model"])
                for name, doc in _MODEL_COUNTERS.items()}
    for kind, model in (("embedding", state.embedder_), ("reranker", state.reranker_)):
        if model is None:
            continue
        stats = model.stats
        for name, family in families.items():
            if name in stats:
                family.add_metric([kind], float(stats[name]))
    yield from families.values()


def _tower_metrics(state: AppState) -> Iterator[Metric]:
    """Every distinct vision tower in use, whether the models share one, and the encodes it ran."""
    info = state.packages.describe()
    towers = GaugeMetricFamily("rubricsearch_vision_tower", "1 per distinct vision tower in use",
                               labels=["tower", "models", "local"])
    for tower in info["towers"]:
        towers.add_metric([tower["digest"][:12], "+".join(tower["roles"]), str(tower["local"]).lower()], 1.0)
    yield towers
    yield GaugeMetricFamily("rubricsearch_vision_towers_shared", "1 when embedder and reranker share one tower",
                            value=float(info["shared"]))
    encodes = CounterMetricFamily("rubricsearch_vision_encodes", "Images run through a vision tower",
                                  labels=["model", "tower", "purpose"])
    for (role, tower, purpose), n in sorted(state.packages.encode_counts().items()):
        encodes.add_metric([role, tower, purpose], float(n))
    yield encodes


def _query_tier_metrics(stats: dict[str, int]) -> Iterator[Metric]:
    """The bounded memory tier of query images' packages (search candidates, API images)."""
    for name in ("hits", "misses", "evictions"):
        yield CounterMetricFamily(f"rubricsearch_query_packages_{name}", f"Query-image packages: {name}",
                                  value=float(stats.get(name, 0)))
    yield GaugeMetricFamily("rubricsearch_query_packages_bytes", "Bytes held by query-image packages",
                            value=float(stats.get("bytes", 0)))


def _store_metrics(stats: dict[str, int]) -> Iterator[Metric]:
    for name in _STORE_COUNTERS:
        yield CounterMetricFamily(f"rubricsearch_package_store_{name}", f"Package store {name}",
                                  value=float(stats.get(name, 0)))
    evictions = CounterMetricFamily("rubricsearch_package_store_evictions", "Packages evicted", labels=["tier"])
    size = GaugeMetricFamily("rubricsearch_package_store_bytes", "Bytes held", labels=["tier"])
    count = GaugeMetricFamily("rubricsearch_package_store_packages", "Packages held", labels=["tier"])
    hits = CounterMetricFamily("rubricsearch_package_store_tier_hits", "Hits by tier", labels=["tier"])
    for tier in ("memory", "disk"):
        evictions.add_metric([tier], float(stats.get(f"evictions_{tier}", 0)))
        size.add_metric([tier], float(stats.get(f"{tier}_bytes", 0)))
        count.add_metric([tier], float(stats.get(f"{tier}_packages", 0)))
        hits.add_metric([tier], float(stats.get(f"{tier}_hits", 0)))
    yield from (evictions, size, count, hits)


def _job_metrics(state: AppState) -> Iterator[Metric]:
    """Progress of queued and running ingestion jobs (at most 100, newest first)."""
    from rubricsearch.indexer.catalog import JobState, list_jobs

    try:
        with state.catalog.read() as session:
            jobs = list_jobs(session, states=[JobState.QUEUED, JobState.RUNNING], limit=100)
    except Exception:  # a scrape must not fail because the catalog is down; /readyz reports that
        return
    active = GaugeMetricFamily("rubricsearch_jobs_active", "Ingestion jobs by state", labels=["state"])
    for job_state in (JobState.QUEUED, JobState.RUNNING):
        active.add_metric([job_state.value], float(sum(j.state == job_state for j in jobs)))
    items = GaugeMetricFamily("rubricsearch_job_items", "Items of active jobs", labels=["job_id", "set_id", "kind"])
    progress = GaugeMetricFamily("rubricsearch_job_progress", "Fraction processed", labels=["job_id", "set_id"])
    for job in jobs:
        for kind in ("total", "done", "failed", "skipped"):
            items.add_metric([job.id, job.set_id, kind], float(getattr(job, kind)))
        progress.add_metric([job.id, job.set_id], job.progress)
    yield from (active, items, progress)


class MetricsMiddleware:
    """Counts every HTTP request by its route *template* (``/v1/images/{sha256}/...``), never the raw path."""

    def __init__(self, app: ASGIApp, metrics: Metrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500
        start = time.perf_counter()

        async def send_status(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        self.metrics.in_flight.inc()
        try:
            await self.app(scope, receive, send_status)
        finally:
            self.metrics.in_flight.dec()
            route: Any = scope.get("route")
            template = str(getattr(route, "path", "")) or "unmatched"
            method = str(scope.get("method", ""))
            self.metrics.requests.labels(method, template, str(status)).inc()
            self.metrics.latency.labels(method, template).observe(time.perf_counter() - start)
