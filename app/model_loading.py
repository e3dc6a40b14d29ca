"""Loading the two models from settings, onto one package stage, with the offline fallback.

Both models register with one :class:`~retrieval.packages.VisualPackages`, so identical vision towers share
packages and different ones each get theirs at ingestion. A vLLM backend whose checkpoint is here gets a
vision-only worker for its own tower (``local_vision``): packages are then made and keyed here for it too.
"""

from __future__ import annotations

import fcntl
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Literal, TypeVar

from rubricsearch.app.plugins import first
from rubricsearch.app.settings import Settings
from rubricsearch.rerank.protocol import Reranker
from rubricsearch.rerank.rubric import RerankPolicy
from rubricsearch.retrieval.embedding import Embedder
from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.packages import VisualPackages
from rubricsearch.retrieval.runtime.config import (
    FusedSetting,
    InputLimits,
    LocalConfig,
    ModelConfig,
    VisionConfig,
    VLLMConfig,
)

log = logging.getLogger("rubricsearch.app")

ModelKind = Literal["embedding", "reranker"]
Backend = Literal["local", "vllm"]
M = TypeVar("M", Embedder, Reranker)
# A vLLM request's deadline before it is retried: a full batch of the 2B models' passes takes seconds, so a minute
# means a stuck server, not a slow one.
VLLM_TIMEOUT_S = 60.0
# Retries of a failed vLLM request (with back-off): a restarting server comes back within them; one that does not
# is down, and the request fails with 503.
VLLM_MAX_RETRIES = 3
# vLLM requests in flight at once per backend: enough to keep its continuous batching full, and the client's
# connection pool bounded.
VLLM_CONCURRENCY = 8
# The accelerated engine's paths, each kept by a measurement (docs/performance.md): Liger's fused kernels wherever
# they can run, CUDA-graph replays of small passes and of ingestion's recurring ones (the embedder ingests). Compiled
# blocks gained nothing beyond the spread between runs and cost a slow first batch per shape, so they stay off (the
# Python API's ``compile=True`` turns them on). RUBRICSEARCH_MODELS__ENGINE=local runs the plain engine without them.
FUSED_KERNELS: FusedSetting = "auto"
CUDA_GRAPHS = True
BULK_GRAPHS = True
COMPILE_BLOCKS = False


def load_embedder(settings: Settings, packages: VisualPackages) -> tuple[Embedder, bool]:
    """The embedder, and whether it is an offline test checkpoint."""
    from rubricsearch.retrieval.embedding import load_embedder as load

    def build(name: str, backend: Backend) -> Embedder:
        return load(name, model_config(settings, "embedding", backend), packages=packages)

    return _with_fallback(settings, "embedding", settings.models.embedding_model, settings.backend("embedding"), build)


def load_reranker(settings: Settings, packages: VisualPackages) -> tuple[Reranker, bool, RerankPolicy]:
    """The reranker, whether it is an offline test checkpoint, and the rerank policy recorded with the checkpoint
    that serves (``rubricsearch-policy.json``; none: every kind is reranked)."""
    from rubricsearch.rerank import load_reranker as load
    from rubricsearch.rerank.rubric import read_policy

    served: list[str] = []

    def build(name: str, backend: Backend) -> Reranker:
        model = load(name, model_config(settings, "reranker", backend), packages=packages)
        served.append(name)
        return model

    reranker, test = _with_fallback(settings, "reranker", settings.models.reranker_model,
                                    settings.backend("reranker"), build)
    return reranker, test, read_policy(served[-1])


def register_reranker_tower(settings: Settings, packages: VisualPackages) -> None:
    """Only the reranker's vision tower, for processes that ingest without loading the reranker (the CLI,
    ``rubricsearch worker``): ingestion then still builds its packages. Identical towers cost nothing more
    than the hash check; a tower that cannot be found here is left to a server's backfill job."""
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.engine.vision_only import vision_only

    vision = model_config(settings, "reranker", "local").vision

    def tower(name: str) -> VisionEncoder:
        return vision_only(name, device=settings.models.device, dtype=settings.models.dtype,
                           min_pixels=vision.min_pixels, max_pixels=vision.max_pixels, preprocess=vision.preprocess)

    try:
        if unobtainable(settings, settings.models.reranker_model):
            raise BackendUnavailable(f"{settings.models.reranker_model!r} is neither a local checkpoint nor in the "
                                     "Hugging Face cache, and is not fetched (the hub does not answer, or the "
                                     "fallback may serve)")
        worker = tower(settings.models.reranker_model)
    except Exception as exc:
        if not settings.models.fallback_to_test_models:
            log.warning("the reranker's vision tower (%s) is not available here (%s): its packages will be made "
                        "by a backfill job where it is", settings.models.reranker_model, exc)
            return
        worker = tower(str(_ensure_test_model(settings.data_dir / "test-models", "reranker")))
    packages.register("reranker", worker.fingerprint, worker)


def log_towers(packages: VisualPackages) -> None:
    """Say at start-up whether the models share one vision tower (then one package per image serves both)."""
    info = packages.describe()
    for tower in info["towers"]:
        log.info("vision tower %s (weights sha256 %s…) serves %s; runs here: %s", tower["digest"][:12],
                 tower["tower_sha256"][:12], "+".join(tower["roles"]), tower["local"])
    for role in info["unknown_roles"]:
        log.warning("the %s model's vision tower is unknown here (remote checkpoint): its images go raw", role)
    if info["shared"]:
        log.info("embedder and reranker share one vision tower: one package per image serves both")
    elif len(info["towers"]) > 1:
        log.warning("embedder and reranker have different vision towers: ingestion builds a package per tower")


def _with_fallback(settings: Settings, kind: ModelKind, name: str, backend: Backend,
                   build: Callable[[str, Backend], M]) -> tuple[M, bool]:
    """Load one model; on failure fall back to an offline test checkpoint when the settings allow it.

    A model that is not here is fetched only from a hub that answers: with the fallback allowed it is not
    fetched at all, and when the data dir holds the trained demo model (``rubricsearch demo`` ran) a hub that
    does not answer within seconds means the demo model serves, instead of minutes of retries and a failure;
    without a demo model that same check fails at once with what to do instead."""
    from rubricsearch.retrieval.qwen.model.checkpoint import is_test_model

    demo = first(lambda plugin: plugin.fallback_model(settings.data_dir, kind))  # the demo's trained models
    offline = backend == "local" and unobtainable(settings, name)
    if offline and demo is None and not settings.models.fallback_to_test_models:
        raise BackendUnavailable(
            f"the {kind} model {name!r} is neither a local checkpoint nor in the Hugging Face cache, and the hub "
            "does not answer: give a local checkpoint (RUBRICSEARCH_MODELS__EMBEDDING_MODEL / "
            "RUBRICSEARCH_MODELS__RERANKER_MODEL), let `rubricsearch demo` finish training its models, or set "
            "RUBRICSEARCH_MODELS__FALLBACK_TO_TEST_MODELS=true",
            model=name)
    if offline:
        log.warning("the %s model %r is neither a local checkpoint nor in the Hugging Face cache%s; serving an "
                    "offline checkpoint instead", kind, name,
                    "" if settings.models.fallback_to_test_models else ", and the hub does not answer")
    else:
        try:
            return build(name, backend), backend == "local" and is_test_model(name)
        except Exception as exc:
            if not settings.models.fallback_to_test_models:
                raise
            log.warning("cannot load the %s model %r (%s); serving an offline checkpoint instead", kind, name, exc)
    if demo is not None:
        log.warning("serving the DEMO %s model trained on generated faces: %s", kind, demo)
        return build(str(demo), "local"), True
    path = _ensure_test_model(settings.data_dir / "test-models", kind)
    return build(str(path), "local"), True


def unobtainable(settings: Settings, name: str) -> bool:
    """Whether a model is not here and will not be fetched: with the fallback allowed it is not fetched at all,
    otherwise only from a hub that answers the demo's connect probe within seconds."""
    return not hub_model_available(name) and (settings.models.fallback_to_test_models or not hub_reachable())


def hub_model_available(name: str) -> bool:
    """Whether ``name`` is a local checkpoint or is complete enough in the Hugging Face cache to load offline.

    Answers from the file system alone (no network), so the demo decides in milliseconds whether it must
    fall back; a model that is present but broken still fails (and falls back) when it loads."""
    if Path(name).expanduser().is_dir():
        return (Path(name).expanduser() / "config.json").exists()
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json")
    except Exception:  # not a valid repo id either
        return False
    return isinstance(found, str)


def hub_reachable(timeout_s: float = 2.0) -> bool:
    """Whether the Hugging Face hub could be asked at all: not with ``HF_HUB_OFFLINE``, else a TCP connect to
    its endpoint within ``timeout_s`` (transformers would otherwise retry for minutes before failing)."""
    import os
    import socket
    from urllib.parse import urlsplit

    if os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on"):
        return False
    endpoint = urlsplit(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    try:
        with socket.create_connection((endpoint.hostname or "huggingface.co",
                                       endpoint.port or (80 if endpoint.scheme == "http" else 443)), timeout_s):
            return True
    except OSError:
        return False


def model_config(settings: Settings, kind: ModelKind, backend: Backend) -> ModelConfig:
    """The one place flat settings become a model's typed configuration (each setting reaches one group)."""
    vision = VisionConfig(max_pixels=settings.models.max_pixels, preprocess=settings.models.preprocess)
    inputs = InputLimits(image_max_bytes=settings.image_bytes,
                         image_max_pixels=settings.image_pixels)
    models = settings.models
    if backend == "local":
        local = LocalConfig(engine=models.engine, device=models.device, dtype=models.dtype, compile=COMPILE_BLOCKS,
                            fused_kernels=FUSED_KERNELS, cuda_graphs=CUDA_GRAPHS,
                            bulk_graphs=BULK_GRAPHS and kind == "embedding")
        return ModelConfig(vision=vision, inputs=inputs, local=local)
    key = settings.vllm.api_key.get_secret_value() if settings.vllm.api_key else None
    # Packages are keyed by the fingerprint of the checkpoint's own tower (device/dtype as a local backend
    # would use them); with the weights here a vision-only worker makes them, so the server runs no vision
    # for any image whose package exists. Identical towers share one worker's packages.
    remote = VLLMConfig(
        base_url=(settings.vllm.embedding_url if kind == "embedding" else settings.vllm.reranker_url) or "",
        served_model=settings.vllm.embedding_served_name if kind == "embedding" else settings.vllm.reranker_served_name,
        api_key=key, read_timeout=VLLM_TIMEOUT_S, max_retries=VLLM_MAX_RETRIES, max_concurrency=VLLM_CONCURRENCY,
        device=models.device, dtype=models.dtype, local_vision=True)
    return ModelConfig(vision=vision, inputs=inputs, vllm=remote)


def _ensure_test_model(root: Path, kind: ModelKind) -> Path:
    """Generate the test checkpoint once; a file lock keeps concurrent workers from writing it twice."""
    from rubricsearch.retrieval.qwen.model.checkpoint import is_test_model, make_test_model

    root.mkdir(parents=True, exist_ok=True)
    path = root / kind
    with open(root / ".lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not is_test_model(path):
            log.warning("writing an offline %s test checkpoint to %s", kind, path)
            make_test_model(path, kind)
    return path
