"""Typed Python client for the rubricsearch REST API (httpx; sync :class:`Client`, async :class:`AsyncClient`).

Errors come back as the server's own domain errors (:mod:`retrieval.errors`, e.g. ``NotFound``,
``PayloadTooLarge``), chosen by the envelope's ``type``, with ``.status`` and ``.details`` set.
"""

from rubricsearch.app.client.core import ApiError, data_url, raise_for_error
from rubricsearch.app.client.sync import AsyncClient, Client

__all__ = ["ApiError", "AsyncClient", "Client", "data_url", "raise_for_error"]
