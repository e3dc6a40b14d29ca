"""Typed configuration of one model: what reaches the task (embedder/reranker) and what reaches its runtime.

Every knob lives in exactly one group, so a reader sees which setting reaches which component: the
vision group goes to whatever makes packages (the local tower, a vision-only worker next to vLLM), the
input limits to the core's item parsing, the local and vLLM groups to their runtimes.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Literal, TypedDict

from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.qwen.engine.vision import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, PreprocessMode

# Liger's fused kernels (the accelerated runtime): on, off, or wherever they can run.
FusedSetting = bool | Literal["auto"]


@dataclass(frozen=True)
class VisionConfig:
    """How images become packages: the tower's pixel bounds and where preprocessing runs."""

    min_pixels: int = DEFAULT_MIN_PIXELS
    max_pixels: int = DEFAULT_MAX_PIXELS
    preprocess: PreprocessMode = "official"


@dataclass(frozen=True)
class InputLimits:
    """What an item's image may be before it is decoded (hostile input is refused here, not in the model)."""

    image_max_bytes: int = DEFAULT_MAX_BYTES
    image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS


@dataclass(frozen=True)
class LocalConfig:
    """The local torch runtime: loading, batching and the accelerated paths (each falls back where it cannot run).

    ``engine``: ``local`` the plain runtime, ``accelerated`` the plug-in with CUDA graphs and packed shortlist
    passes, ``auto`` the accelerated one on a GPU and the plain one elsewhere.
    """

    engine: Literal["auto", "local", "accelerated"] = "auto"
    device: str | None = None
    dtype: str | None = None
    attn_implementation: str | None = "sdpa"
    revision: str | None = None
    compile: bool = False
    fused_kernels: FusedSetting = False
    batch_size: int | None = None
    lm_workers: int | None = None
    max_batch_tokens: int | None = None
    cuda_graphs: bool = False
    bulk_graphs: bool = False
    # the reranker's shortlist paths: one shared prefix per (query, instruction), packed on FlashAttention
    share_prefix: bool = True
    packed: bool = True
    prefix_batch_bytes: int | None = None


@dataclass(frozen=True)
class VLLMConfig:
    """The vLLM runtime: the server, its client's limits, and how images travel (packages, keys or raw)."""

    base_url: str
    served_model: str | None = None
    api_key: str | None = None
    connect_timeout: float = 5.0
    read_timeout: float = 120.0
    max_retries: int = 3
    max_concurrency: int = 4
    max_batch: int = 32
    max_request_bytes: int = 64 << 20
    send_packages: bool = True
    local_vision: bool = False
    package_keys: bool = True
    # the device and dtype a local backend would use: packages are keyed (and made, with local_vision) so
    device: str | None = None
    dtype: str | None = None


@dataclass(frozen=True)
class ModelConfig:
    """One model: the task's limits, its vision and input groups, and its runtime (vLLM when ``vllm`` is set).

    ``max_length`` None: the task's own limit (the official classes' 8192 for embedding, 10240 for reranking).
    ``default_instruction`` None: the task's official default.
    """

    vision: VisionConfig = field(default_factory=VisionConfig)
    inputs: InputLimits = field(default_factory=InputLimits)
    local: LocalConfig = field(default_factory=LocalConfig)
    vllm: VLLMConfig | None = None
    max_length: int | None = None
    default_instruction: str | None = None


class ModelOptions(TypedDict, total=False):
    """The flat keyword form of :class:`ModelConfig` that ``load_embedder``/``load_reranker`` accept: each key is
    a field of exactly one group (a vLLM field, ``base_url`` first, selects the vLLM runtime)."""

    min_pixels: int
    max_pixels: int
    preprocess: PreprocessMode
    image_max_bytes: int
    image_max_pixels: int
    engine: Literal["auto", "local", "accelerated"]
    device: str | None
    dtype: str | None
    attn_implementation: str | None
    revision: str | None
    compile: bool
    fused_kernels: FusedSetting
    batch_size: int | None
    lm_workers: int | None
    max_batch_tokens: int | None
    cuda_graphs: bool
    bulk_graphs: bool
    share_prefix: bool
    packed: bool
    prefix_batch_bytes: int | None
    base_url: str
    served_model: str | None
    api_key: str | None
    connect_timeout: float
    read_timeout: float
    max_retries: int
    max_concurrency: int
    max_batch: int
    max_request_bytes: int
    send_packages: bool
    local_vision: bool
    package_keys: bool
    max_length: int | None
    default_instruction: str | None


def configure(config: ModelConfig | None, options: ModelOptions) -> ModelConfig:
    """``config`` (or the defaults) with the flat ``options`` placed into their groups."""
    config = config or ModelConfig()
    given = dict(options)

    def take(cls: type) -> dict[str, Any]:
        names = {f.name for f in fields(cls)}
        return {k: given.pop(k) for k in list(given) if k in names}

    vllm_keys = {f.name for f in fields(VLLMConfig)} - {"device", "dtype"}
    remote = config.vllm is not None or any(k in given for k in vllm_keys)
    top: dict[str, Any] = {k: given.pop(k) for k in ("max_length", "default_instruction") if k in given}
    vision = replace(config.vision, **take(VisionConfig))
    inputs = replace(config.inputs, **take(InputLimits))
    vllm = config.vllm
    if remote:  # device and dtype then key the packages the vLLM runtime sends
        picked = take(VLLMConfig)
        vllm = replace(vllm, **picked) if vllm is not None else VLLMConfig(**picked)
    local = replace(config.local, **take(LocalConfig))
    if given:
        raise TypeError(f"unknown model options: {sorted(given)}")
    return replace(config, vision=vision, inputs=inputs, local=local, vllm=vllm, **top)
