"""A real server on 127.0.0.1 for the benchmarks (fresh data dir, the bench admin key); see tests/live_server.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING

from tests.live_server import ServerFailed, live_server

if TYPE_CHECKING:
    from fastapi import FastAPI

ADMIN = "bench-admin-key-0123456789abcdef"


@contextmanager
def serve(root: Path, emb: str | Path, rr: str | Path, revert: str = "",
          **env: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Yields (process, base URL) once /readyz answers 200; ``env`` holds extra ``RUBRICSEARCH_*`` settings;
    ``revert`` (:mod:`bench.reverts`) runs the server with those paths put back (:func:`reverted_app`)."""
    app = {"app": "bench.server:reverted_app", "RS_BENCH_REVERT": revert} if revert else {}
    try:
        with live_server(root / "data", emb, rr, ready_s=480, RUBRICSEARCH_ADMIN_API_KEYS=ADMIN, **app,
                         **env) as pair:
            yield pair
    except ServerFailed as exc:
        raise SystemExit(str(exc)) from exc


def reverted_app() -> FastAPI:
    """The product's app with ``RS_BENCH_REVERT``'s paths put back: the server side of a load test's A/B arm."""
    from app.main import create_app
    from bench import reverts

    reverts.revert(os.environ.get("RS_BENCH_REVERT", ""))
    return create_app()
