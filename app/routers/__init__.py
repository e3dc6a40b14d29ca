"""REST routers. Each module listed here exposes ``router: APIRouter``; adding a feature is one line.

Conventions for a router module: thin handlers (work lives in retrieval/rerank/indexer), request and
response models in ``app/schemas/<feature>.py``, dependencies from ``app.deps`` (``AdminAccess`` on
every mutation, ``SearchAccess`` on reads of search data, ``JSON_BODY`` on JSON POST/PUT/PATCH), and
``responses=error_responses(...)`` so the error envelope is documented.
"""

ROUTER_MODULES: tuple[str, ...] = (
    "app.routers.health",
    "app.routers.embeddings",
    "app.routers.cohere",
    "app.routers.rerank",
    "app.routers.packages",
    "app.routers.visual_packages",
    "app.routers.sets",
    "app.routers.images",
    "app.routers.metadata",
    "app.routers.facets",
    "app.routers.jobs",
    "app.routers.search",
    "app.routers.web",
)
