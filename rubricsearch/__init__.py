"""rubricsearch: two-stage multimodal retrieval and reranking with Qwen3-VL, from cached visual packages.

The public Python API, in one import::

    from rubricsearch import Settings, load_embedder, load_reranker, open_state, search_set, SearchBody

- :func:`load_embedder` / :func:`load_reranker`: Qwen3-VL-Embedding and Qwen3-VL-Reranker (a local path or a hub
  id), drop-ins for the official ``Qwen3VLEmbedder`` / ``Qwen3VLReranker`` classes.
- :class:`PackageStore` and :class:`VisualPackages`: each reference image's vision-tower output, kept by key.
- :class:`Settings` and :func:`open_state`: the product's stores and models in this process;
  :func:`search_set` searches a reference set with a :class:`SearchBody` and answers what ``POST /v1/search``
  answers (``state.search`` is the search service below it, taking a :class:`SearchRequest`).

The repository keeps its layers in top-level folders (``app/``, ``retrieval/``, ``rerank/``, ``indexer/``,
``web/``); this package links them in as ``rubricsearch.app`` and so on, and a wheel holds them under this name
alone. Names resolve lazily so ``import rubricsearch`` (the CLI's first step) loads neither torch nor FastAPI.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricsearch.app.schemas.search import SearchBody, SearchResponse
    from rubricsearch.app.set_search import search_set
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import AppState, open_state
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.search import SearchRequest, SearchResult

_EXPORTS = {
    "load_embedder": "rubricsearch.retrieval",
    "load_reranker": "rubricsearch.rerank",
    "PackageStore": "rubricsearch.retrieval.packages",
    "VisualPackages": "rubricsearch.retrieval.packages",
    "Settings": "rubricsearch.app.settings",
    "AppState": "rubricsearch.app.state",
    "open_state": "rubricsearch.app.state",
    "search_set": "rubricsearch.app.set_search",
    "SearchBody": "rubricsearch.app.schemas.search",
    "SearchResponse": "rubricsearch.app.schemas.search",
    "SearchRequest": "rubricsearch.retrieval.search",
    "SearchResult": "rubricsearch.retrieval.search",
}

__all__ = ["AppState", "PackageStore", "SearchBody", "SearchRequest", "SearchResponse", "SearchResult", "Settings",
           "VisualPackages", "load_embedder", "load_reranker", "open_state", "search_set"]


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'rubricsearch' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *__all__])
