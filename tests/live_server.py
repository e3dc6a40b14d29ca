"""A real uvicorn server of the app on 127.0.0.1 in a subprocess, for browser tests, schema fuzzing and the
benchmarks: fresh data dir, the given checkpoints and settings, ready when /readyz answers 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class ServerFailed(RuntimeError):
    """The server exited or did not become ready; the message ends with its log."""


@contextmanager
def live_server(data: Path, embedding: str | Path, reranker: str | Path, *, ready_s: float = 240,
                **settings: str) -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """Yields (process, base URL); ``settings`` are extra environment variables (``RUBRICSEARCH_*``)."""
    data.mkdir(parents=True, exist_ok=True)
    port = free_port()
    env = {**os.environ, "RUBRICSEARCH_DATA_DIR": str(data), "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(embedding),
           "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(reranker),
           "RUBRICSEARCH_MODELS__FALLBACK_TO_TEST_MODELS": "false",
           "HF_HUB_OFFLINE": "1", **settings}
    log_path = data / "server.log"
    log = log_path.open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "uvicorn", "rubricsearch.app.main:create_app", "--factory", "--host",
                             "127.0.0.1", "--port", str(port)], cwd=ROOT, env=env, stdout=log,
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + ready_s
        while True:
            if proc.poll() is not None:
                raise ServerFailed(f"the server exited: {log_path.read_text(errors='replace')[-3000:]}")
            try:
                if httpx.get(f"{base}/readyz", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            if time.monotonic() > deadline:
                raise ServerFailed(f"the server did not become ready: {log_path.read_text(errors='replace')[-3000:]}")
            time.sleep(0.3)
        yield proc, base
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
        log.close()
