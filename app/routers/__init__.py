"""REST routers. Each module listed here exposes ``router: APIRouter``; adding a feature is one line.

Conventions for a router module: thin handlers (work lives in retrieval/rerank/indexer), request and
response models in ``app/schemas/<feature>.py``, dependencies from ``app.deps`` (``AdminAccess`` on
every mutation, ``SearchAccess`` on reads of search data, ``JSON_BODY`` on JSON POST/PUT/PATCH), and
``responses=error_responses(...)`` so the error envelope is documented.
"""

ROUTER_MODULES: tuple[str, ...] = (
    "rubricsearch.app.routers.health",
    "rubricsearch.app.routers.embeddings",
    "rubricsearch.app.routers.cohere",
    "rubricsearch.app.routers.rerank",
    "rubricsearch.app.routers.packages",
    "rubricsearch.app.routers.visual_packages",
    "rubricsearch.app.routers.sets",
    "rubricsearch.app.routers.images",
    "rubricsearch.app.routers.metadata",
    "rubricsearch.app.routers.facets",
    "rubricsearch.app.routers.judgments",
    "rubricsearch.app.routers.jobs",
    "rubricsearch.app.routers.search",
    "rubricsearch.app.routers.evidence",
    "rubricsearch.app.routers.calibration",
    "rubricsearch.app.routers.training",
    "rubricsearch.app.routers.web",
)
