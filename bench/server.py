"""A real ``rubricsearch serve`` on 127.0.0.1 for the benchmarks (fresh data dir, admin key, bounded start)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
ADMIN = "bench-admin-key-0123456789abcdef"


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def serve(root: Path, emb: str | Path, rr: str | Path, **env: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Start the server with both checkpoints and extra ``RUBRICSEARCH_*`` settings; yields (process, base URL)
    once /readyz answers 200; stops it afterwards."""
    port = free_port()
    full = {**os.environ, "RUBRICSEARCH_DATA_DIR": str(root / "data"), "RUBRICSEARCH_EMBEDDING_MODEL": str(emb),
            "RUBRICSEARCH_RERANKER_MODEL": str(rr), "RUBRICSEARCH_ADMIN_API_KEYS": ADMIN,
            "RUBRICSEARCH_PORT": str(port), "RUBRICSEARCH_HOST": "127.0.0.1", **env}
    log = (root / "server.log").open("wb")
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], cwd=REPO, env=full, stdout=log,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        for _ in range(480):
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if server.poll() is not None:
                break
            time.sleep(0.5)
        else:
            server.poll()
        if server.returncode is not None or httpx.get(f"{base}/readyz", timeout=5).status_code != 200:
            log.flush()
            tail = (root / "server.log").read_text(errors="replace")[-4000:]
            raise SystemExit(f"server did not become ready; the end of {root / 'server.log'}:\n{tail}")
        yield server, base
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()
