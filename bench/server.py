"""A real server on 127.0.0.1 for the benchmarks (fresh data dir, the bench admin key); see tests/live_server.py."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from bench.common import env_name
from tests.live_server import ServerFailed, live_server

ADMIN = "bench-admin-key-0123456789abcdef"


@contextmanager
def serve(root: Path, emb: str | Path, rr: str | Path, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Yields (process, base URL) once /readyz answers 200; ``env`` holds extra ``RUBRICSEARCH_*`` settings."""
    try:
        keys = {env_name("auth.admin_api_keys"): ADMIN}  # an older tree (gpu_report --against) reads the flat name
        with live_server(root / "data", emb, rr, ready_s=480, **keys, **env) as pair:
            yield pair
    except ServerFailed as exc:
        raise SystemExit(str(exc)) from exc

