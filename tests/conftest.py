"""Session fixtures: tiny offline Qwen3-VL checkpoints are built once per test session."""

from __future__ import annotations

import importlib.util
import io
import json
import os
import sys
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from PIL import Image

# The suite runs more threads than the box has cores (the demo training's two beside pytest's, the servers'), and
# an OpenMP thread that spins at a barrier while its partner waits for a core burns the CPU the partner needs:
# the niced background training would make almost no progress beside the tests. Waiting threads sleep instead; the
# results do not change (the work is split by the thread count, not by how threads wait). Set before torch
# loads (libgomp reads it then), and inherited by every process the tests start.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
# The catalog fixtures need SQLAlchemy, which the GPU box (device tool) does not have.
pytest_plugins = ["tests.vllm_server", "tests.demo_training"] + (
    ["tests.conftest_catalog"] if importlib.util.find_spec("sqlalchemy") else [])
# Modules using these session fixtures run last, in this order, each part in collected order. The vLLM servers
# start at their first user rather than idling beside the rest of the run (their engines poll: a few percent of a
# core, ~3 GB each) and stop after their last (tests/vllm_server.py). The demo models train in the background
# all the while (tests/demo_training.py): their users come last, so that the vLLM modules, which need no demo
# model, run while the training still does rather than after a wait for it.
LAST = (("vllm_embed_server", "vllm_rerank_server"), ("demo_models",))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    def file(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    rank: dict[str, int] = {}
    for item in items:
        for place, fixtures in enumerate(LAST, 1):
            if set(fixtures) & set(getattr(item, "fixturenames", ())):
                rank[file(item)] = max(rank.get(file(item), 0), place)
    items.sort(key=lambda item: rank.get(file(item), 0))  # stable: each part keeps its order


@pytest.fixture(scope="session")
def tiny_embedding_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tiny-embedding"), "embedding", seed=0)


@pytest.fixture(scope="session")
def tiny_reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tiny-reranker"), "reranker", seed=0)


@pytest.fixture(scope="session")
def tiny_reranker_other_tower_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A reranker whose vision tower differs from the embedder's (another seed): reuse must not depend on
    the two towers being identical."""
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    return make_test_model(tmp_path_factory.mktemp("tiny-reranker-seed1"), "reranker", seed=1)


TOWERS = ("shared", "distinct")


@pytest.fixture(scope="session")
def reranker_dir_for(tiny_reranker_dir: Path, tiny_reranker_other_tower_dir: Path) -> Callable[[str], Path]:
    """The reranker checkpoint for a tower layout: ``shared`` (same tower as the embedder) or ``distinct``."""
    return lambda towers: tiny_reranker_dir if towers == "shared" else tiny_reranker_other_tower_dir


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (height, width, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


@pytest.fixture(scope="session")
def make_png() -> Callable[..., bytes]:
    return noise_png


def pil_item(item: dict[str, Any]) -> dict[str, Any]:
    """An input item with its image bytes decoded to PIL images, the form the official reference code takes."""
    from rubricsearch.retrieval.images import decode_image

    def pil(value: Any) -> Any:
        return [decode_image(v).image for v in value] if isinstance(value, list) else decode_image(value).image

    return {k: pil(v) if k == "image" else v for k, v in item.items()}


@contextmanager
def image_server(answer: Callable[[str], tuple[int, bytes]]) -> Iterator[str]:
    """A loopback HTTP server (an ephemeral port, a thread a request) for URL ingestion to fetch from: each GET
    gets ``answer(path)`` as (status, image/png body). Yields the base URL; the server stops with the block."""

    def handle(handler: BaseHTTPRequestHandler) -> None:
        status, body = answer(handler.path)
        handler.send_response(status)
        handler.send_header("Content-Type", "image/png")
        handler.send_header("Content-Length", str(len(body)))
        handler.end_headers()
        handler.wfile.write(body)

    with http_server(handle) as base:
        yield base


@contextmanager
def http_server(handle: Callable[[BaseHTTPRequestHandler], None]) -> Iterator[str]:
    """:func:`image_server` with the whole answer in ``handle(handler)``: for servers that stall, trickle bytes or
    hang up. Yields the base URL; the server stops with the block."""

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            handle(self)

        def log_message(self, *args: object) -> None:
            pass  # no request lines in the test output

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def png_server(monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """The base URL of a loopback server whose every path is a PNG (seeded by the path's length), its host
    allowed through ``RUBRICSEARCH_INGEST__URL_ALLOWED_HOSTS`` for the settings read from the environment."""
    with image_server(lambda path: (200, noise_png(30, 30, len(path)))) as base:
        monkeypatch.setenv("RUBRICSEARCH_INGEST__URL_ALLOWED_HOSTS", base.removeprefix("http://"))
        yield base


class TowerCounter:
    """Counts real calls of the vision tower's forward (patched on the module instance), and their images: the
    rows of ``grid_thw``, or of the precomputed ``cu_seqlens`` (one segment per single-frame image) that a pass
    hands the tower in place of a grid (``graphed_tower.tower_forward``)."""

    def __init__(self, visual: Any) -> None:
        self.calls = 0
        self.images = 0
        original = visual.forward

        def counted(hidden_states: Any, grid_thw: Any, **kwargs: Any) -> Any:
            self.calls += 1
            given = kwargs.get("cu_seqlens")
            self.images += int(grid_thw.shape[0]) if grid_thw.shape[0] or given is None else int(given.numel()) - 1
            return original(hidden_states, grid_thw, **kwargs)

        visual.forward = counted


@pytest.fixture
def count_tower() -> Callable[[Any], TowerCounter]:
    return TowerCounter


# -- guarded quality numbers ---------------------------------------------------------------------------------
QUALITY_LOG = "RUBRICSEARCH_QUALITY_LOG"


@pytest.fixture
def guarded(request: pytest.FixtureRequest) -> Callable[..., None]:
    """Record the numbers a demo-quality test guards (``guarded(name=value, ...)``) as JSON lines in the file
    ``$RUBRICSEARCH_QUALITY_LOG`` names, when it is set: how ``bench/demo_spread.py`` reads each number's spread
    over several trainings. Without the variable it records nothing."""
    path = os.environ.get(QUALITY_LOG)

    def record(**values: float) -> None:
        if path:
            with open(path, "a", encoding="utf-8") as out:
                for name, value in values.items():
                    out.write(json.dumps({"test": request.node.name, "name": name, "value": float(value)}) + "\n")

    return record


# -- process exit -------------------------------------------------------------------------------------------
# Model worker threads (LM schedulers, package writers, ingestion runners) are daemon threads. At interpreter
# teardown CPython ends a daemon thread that comes back from a torch call with pthread_exit, and the forced
# unwind through torch's noexcept C++ frames aborts the process ("terminate called without an active
# exception", exit 134) after every test has passed: seen once in a fresh-clone CI run, not reproducible on
# demand. Results and teardown are complete by pytest_unconfigure, so the process leaves there with pytest's
# own exit status and skips the interpreter teardown. RUBRICSEARCH_TEST_FULL_TEARDOWN=1 keeps the teardown.
_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    if os.environ.get("RUBRICSEARCH_TEST_FULL_TEARDOWN") == "1" or _EXIT_STATUS not in config.stash:
        return
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(config.stash[_EXIT_STATUS])
