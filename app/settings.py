"""All configuration in one validated place: ``RUBRICSEARCH_*`` environment variables (or a .env file).

Settings are read and validated once at start-up; a bad value stops the process with a message that
names the variable, instead of failing later inside a request.
"""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import BeforeValidator, ByteSize, Field, SecretStr, TypeAdapter, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

MiB = 1024 * 1024
_BYTE_SIZE = TypeAdapter(ByteSize)


def _byte_size(value: object) -> object:
    """Byte settings also take units (``48MiB``, ``2GiB``, ``500kB``), as operators write them."""
    return int(_BYTE_SIZE.validate_python(value)) if isinstance(value, str) else value


Bytes = Annotated[int, BeforeValidator(_byte_size)]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUBRICSEARCH_", env_file=".env", env_nested_delimiter="__",
                                      extra="ignore")

    # -- storage ----------------------------------------------------------------------------------
    data_dir: Path = Field(Path("data"), description="catalog (SQLite), blobs, packages and FAISS indexes")
    database_url: str | None = Field(None, description="SQLAlchemy URL; default sqlite:///DATA_DIR/catalog.db")

    # -- models -----------------------------------------------------------------------------------
    embedding_model: str = "Qwen/Qwen3-VL-Embedding-2B"
    reranker_model: str = "Qwen/Qwen3-VL-Reranker-2B"
    embedding_backend: Literal["local", "vllm"] = "local"
    reranker_backend: Literal["local", "vllm"] = "local"
    device: str = "auto"
    dtype: str = "auto"
    min_pixels: int = Field(4096, ge=1024)
    max_pixels: int = Field(1_843_200, ge=4096)
    preprocess: Literal["official", "gpu", "gpu-nvjpeg"] = Field(
        "official", description="image preprocessing: the official CPU path (PIL + qwen_vl_utils + the processor), "
        "or resize/normalise/patchify on the model's device (gpu), with nvJPEG decoding too (gpu-nvjpeg); each has "
        "its own package fingerprint (README: measured deviation)")
    embed_batch_size: int | None = Field(
        None, ge=1, le=1024, description="rows per embedding LM pass (merged across requests); default 64 on CUDA, "
        "16 on the CPU")
    rerank_batch_size: int | None = Field(
        None, ge=1, le=1024, description="rows per reranker LM pass (merged across requests); default 64 on CUDA, "
        "16 on the CPU")
    lm_workers: int = Field(
        0, ge=0, le=64, description="threads running each local model's LM passes (0 = auto: one on a GPU, whose "
        "passes share one stream and its graphs' input buffers, so more is refused there; one per core on a CPU, "
        "where concurrent passes use different cores). Tiny "
        "checkpoints on 2 cores, 16 clients: 13.6 -> 17.1 searches/s with two (retrieval/qwen/batching.py)")
    torch_threads: int = Field(
        0, ge=0, le=1024, description="CPU threads one torch op may use in the server (0 = auto: one on a CPU when "
        "the embedder is narrower than 512, whose ops are too small to split while concurrent passes keep the cores "
        "busy; torch's default, one per core, otherwise). Tiny checkpoints on 2 cores: 16 clients 17.1 -> 20.2 "
        "searches/s with one thread (app/threads.py)")
    compile_blocks: bool = Field(
        False, description="torch.compile the transformer blocks of both vision towers and the embedder's LM "
        "(dynamic shapes): fuses their element-wise work. For sets of one image size on a GPU (448 px squares on an "
        "H100: 1.19-1.32x ingestion); sets of mixed sizes ingest slower (0.73x: the compiled LM pass is slower on "
        "varied lengths), see README. "
        "Each block compiles on first use, so the first batches are slow; results differ from eager at rounding level")
    fused_kernels: bool | Literal["auto"] = Field(
        "auto", description="Liger-Kernel's fused RMSNorm, rotary and SiLU-multiply kernels in both local models, "
        "the vision towers' rotary as one Triton kernel (bit-identical to transformers': 12-MP photos 24.4 -> 26.9 "
        "images/s on an H100) "
        "(the `gpu` extra): fewer kernels in every tower and LM pass, no warm-up and no per-shape compiles. auto = "
        "on where they can run (CUDA with liger-kernel installed), true = required, false = transformers' kernels. "
        "H100: search p50 72.8 -> 55.8 ms, 1.13-1.25x ingestion; rounding-level deviation (fp32: |Δscore| <= 1e-4 "
        "to the official reference; README)")
    cuda_graphs: bool = Field(
        True, description="on a GPU, run small LM passes (a search's candidate and criteria, short /v1/embeddings "
        "calls), the reranker's shortlists and small vision-tower passes (a search's candidate image) as CUDA-graph "
        "replays, captured once per shape: the host launches one "
        "graph instead of thousands of kernels (H100: one query's LM pass 60.8 -> 11.4 ms; results equal the eager "
        "passes at rounding level, README)")
    bulk_graphs: bool = Field(
        True, description="with cuda_graphs, ingestion passes replay CUDA graphs too, once their key comes a third "
        "time: the LM pass keyed by its bucketed packed sizes (a mixed-size set's batches share one or two), the "
        "tower for batches of one image size up to 512 x 512 px (H100, 2048 images, alternating: 448 px "
        "191.0-195.2 -> 211.2-222.5 images/s, mixed <= 640 px 165.4-170.4 -> 203.1, README); photos stay eager "
        "(GPU-bound, and 12-MP runs with graphs got NaN vectors in one batch, cause not proven); a capture whose "
        "first output is not finite runs eagerly")
    fallback_to_test_models: bool = Field(
        False, description="when the real models cannot be loaded, use offline random-weight test checkpoints"
    )
    embedding_model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="extra names the API accepts in `model` for the embedder"
    )
    reranker_model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="extra names the API accepts in `model` for the reranker"
    )

    # -- vLLM backends ----------------------------------------------------------------------------
    vllm_embedding_url: str | None = None
    vllm_reranker_url: str | None = None
    vllm_embedding_served_name: str | None = Field(
        None, description="the name the embedding server serves (--served-model-name); default: the embedding model")
    vllm_reranker_served_name: str | None = Field(
        None, description="the name the reranker server serves (--served-model-name); default: the reranker model")
    vllm_api_key: SecretStr | None = None
    vllm_timeout_s: float = Field(60.0, gt=0)
    vllm_max_retries: int = Field(3, ge=0, le=10)
    vllm_concurrency: int = Field(8, ge=1, le=256)

    # -- visual packages --------------------------------------------------------------------------
    package_storage_dtype: Literal["auto", "float32", "bfloat16", "float8_e4m3fn"] = "auto"
    package_memory_bytes: Bytes = Field(2048 * MiB, ge=0)
    package_disk_bytes: Bytes = Field(100 * 1024 * MiB, ge=0)
    query_package_memory_bytes: Bytes = Field(
        512 * MiB, ge=0, description="memory for query images' packages (search candidates, API images): never on "
        "disk, never competing with reference packages")

    # -- vectors ----------------------------------------------------------------------------------
    vector_backend: Literal["faiss", "qdrant"] = "faiss"
    qdrant_url: str | None = None
    qdrant_api_key: SecretStr | None = None
    faiss_ann_threshold: int = Field(50_000, ge=1)
    vector_search_device: Literal["auto", "cpu", "torch", "faiss-gpu"] = Field(
        "auto", description="where the embedded index searches: auto = faiss-gpu if installed with a GPU, else "
        "torch on CUDA (exact half-precision pass + float32 re-score), else the CPU (exact, then HNSW)")
    vector_device_precision: Literal["auto", "float16", "float8"] = Field(
        "auto", description="the GPU copy's number format (torch device search): auto = float8 e4m3 where the GPU "
        "multiplies it (compute capability 8.9+: half the bytes read per search), else float16; candidates are "
        "re-scored in float32 either way")
    vector_device_max_bytes: Bytes = Field(16 * 1024 * MiB, ge=0, description="largest set mirrored on the GPU")
    default_dimensions: int | None = Field(None, ge=64, description="Matryoshka dimension for new sets")

    # -- search -----------------------------------------------------------------------------------
    default_top_k: int = Field(50, ge=1, le=1000)
    default_top_n: int = Field(10, ge=0, le=200)
    max_criteria: int = Field(12, ge=1, le=64)

    # -- input limits -----------------------------------------------------------------------------
    max_image_bytes: Bytes = Field(32 * MiB, ge=1024)
    max_image_pixels: int = Field(64_000_000, ge=4096, description="decoded pixels (decompression-bomb guard)")
    max_request_bytes: Bytes = Field(256 * MiB, ge=1024)
    max_json_bytes: Bytes = Field(
        24 * MiB, ge=1024, description="largest JSON body (parsed whole in memory, so refusing a body under it "
        "costs < 100 MB): data-URL images up to ~18 MB fit; send larger ones as multipart or by image_id")
    zip_max_entries: int = Field(10_000, ge=1)
    zip_max_total_bytes: Bytes = Field(2048 * MiB, ge=1024)
    url_max_bytes: Bytes = Field(32 * MiB, ge=1024)
    url_timeout_s: float = Field(20.0, gt=0)
    url_max_redirects: int = Field(3, ge=0, le=10)
    import_root: Path | None = Field(None, description="server folders may be imported only under this root")
    max_queued_model_inputs: int = Field(
        8192, ge=0, description="admission control: when more inputs than this wait for the models' devices, "
        "new searches, embeddings and reranks get 503 `overloaded` with Retry-After (0 = never refuse)")
    max_embedding_inputs: int = Field(512, ge=1, le=100_000, description="inputs per /v1/embeddings request")
    max_rerank_documents: int = Field(1000, ge=1, le=100_000, description="documents per /v1/rerank request")

    # -- server and auth --------------------------------------------------------------------------
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)
    admin_api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    search_requires_key: bool = False
    search_api_keys: Annotated[list[SecretStr], NoDecode] = Field(default_factory=list)
    rate_limit_per_minute: int = Field(
        0, ge=0, description="requests per minute per client on the search-class routes; 0 disables"
    )
    rate_limit_burst: int = Field(30, ge=1, description="requests a client may make at once before the rate applies")
    session_secret: SecretStr | None = None
    workers: int = Field(1, ge=0, le=64, description="in-process ingestion worker threads")
    session_max_age_s: int = Field(12 * 3600, ge=60, description="lifetime of an admin session cookie")
    malloc_arena_max: int = Field(
        2, ge=0, le=1024, description="glibc malloc arenas for the server's threads (0 = glibc's default, 8 per "
        "core): fewer arenas keep freed memory reusable instead of scattered (README: soak)")
    malloc_trim_interval_s: float = Field(
        5.0, ge=0, le=3600, description="seconds between malloc_trim calls returning freed heap pages to the "
        "system (0 = never); without them RSS crept up under churn while the in-use heap stayed flat")
    session_cookie_secure: bool = Field(False, description="mark the session cookie Secure (serve over HTTPS)")

    # -- ingestion and jobs -----------------------------------------------------------------------
    worker_id: str | None = Field(
        None, description="stable id of this process's ingestion workers (claims come back at once after a "
        "restart); default: host + data dir with FAISS (one process per directory), host + pid otherwise"
    )
    worker_batch_size: int | None = Field(
        None, ge=1, le=1024, description="job items a worker claims and processes at once; default 64 with a CUDA "
        "device (one tower pass per batch), 8 on the CPU")
    worker_batch_pixels: int = Field(
        100_000_000, ge=0, description="image pixels (as stored) per claimed batch: a claim takes fewer items "
        "than worker_batch_size where the run's last batch's images would exceed it (8 twelve-megapixel photos; "
        "small images keep the full batch): a photo job becomes several batches, which the pipeline overlaps, "
        "and a batch's memory stays bounded; a run's first claim is 8; 0: no bound")
    worker_poll_interval_s: float = Field(
        1.0, gt=0, le=60, description="how often an idle `rubricsearch worker` looks for new job items"
    )
    worker_stop_timeout_s: float = Field(
        120.0, gt=0, le=3600, description="on SIGTERM a worker finishes its batch for at most this long"
    )
    url_allowed_hosts: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="`host:port` pairs URL imports may reach even when they resolve to private addresses",
    )
    sse_poll_interval_s: float = Field(0.5, gt=0, le=60, description="how often a job event stream checks progress")
    sse_heartbeat_s: float = Field(15.0, gt=0, le=3600, description="comment line sent on a quiet event stream")

    # -- hardening: bounded work per request ---------------------------------------------------------
    max_json_values: int = Field(
        100_000, ge=1000, description="array items and object members a JSON body may hold; a body with more is "
        "refused (413) by a scan of its bytes before it is parsed")
    max_json_depth: int = Field(64, ge=8, le=1000, description="how deeply a JSON body may nest (deeper is 422)")
    max_header_bytes: Bytes = Field(
        64 * 1024, ge=4096, description="size of a request's header section; larger is answered 431 and closed")
    max_headers: int = Field(100, ge=16, le=10_000, description="header fields of one request; more is 431")
    header_timeout_s: float = Field(
        10.0, gt=0, le=600, description="seconds a connection may take to send a request's headers (408 after)")
    body_timeout_s: float = Field(
        30.0, gt=0, le=3600, description="seconds a request body may go without a byte before it is refused (408)")
    max_concurrent_requests: int = Field(
        256, ge=1, le=100_000, description="requests handled at once (event streams included); more get 503 "
        "`overloaded` with Retry-After")
    max_connections: int = Field(
        1024, ge=1, le=1_000_000, description="open connections uvicorn serves; requests on more get its plain 503")
    decode_pixel_budget: int = Field(
        128_000_000, ge=1_000_000, description="image pixels (as their headers declare them) being decoded at once "
        "across searches, embeddings, reranks, visual packages and ingestion batches")
    decode_wait_s: float = Field(
        2.0, ge=0, le=60, description="how long a request waits for room in the decoded-pixel budget before it "
        "gets 503 `overloaded` with Retry-After (ingestion waits as long as it takes)")
    max_query_image_pixels: int = Field(
        50_000_000, ge=4096, description="decoded pixels of one image sent in a request (searches, embeddings, "
        "reranks, visual packages), which is resized to max_pixels anyway; ingested images have max_image_pixels")
    url_fetch_threads: int = Field(
        8, ge=1, le=256, description="threads per ingestion worker that fetch URL items, apart from the threads "
        "that read uploads, archives and folders")

    @field_validator(
        "admin_api_keys", "search_api_keys", "embedding_model_aliases", "reranker_model_aliases", "url_allowed_hosts",
        mode="before",
    )
    @classmethod
    def _split_keys(cls, value: object) -> object:
        """Env values are comma-separated (``a,b``) or a JSON array (``["a","b"]``)."""
        if isinstance(value, str):
            if value.lstrip().startswith("["):
                return json.loads(value)
            return [k.strip() for k in value.split(",") if k.strip()]
        return value

    @model_validator(mode="after")
    def _check(self) -> Settings:
        if self.min_pixels > self.max_pixels:
            raise ValueError("RUBRICSEARCH_MIN_PIXELS must not exceed RUBRICSEARCH_MAX_PIXELS")
        if self.fused_kernels is True and self.device.startswith("cpu"):
            raise ValueError("RUBRICSEARCH_FUSED_KERNELS needs a CUDA device (RUBRICSEARCH_DEVICE is cpu)")
        if self.lm_workers > 1 and not self.device.startswith("cpu") and self.device != "auto":
            raise ValueError("RUBRICSEARCH_LM_WORKERS above 1 runs only on a CPU (a GPU's passes share one stream "
                             "and its graphs' input buffers)")
        if self.embedding_backend == "vllm" and not self.vllm_embedding_url:
            raise ValueError("RUBRICSEARCH_VLLM_EMBEDDING_URL is required when the embedding backend is vllm")
        if self.reranker_backend == "vllm" and not self.vllm_reranker_url:
            raise ValueError("RUBRICSEARCH_VLLM_RERANKER_URL is required when the reranker backend is vllm")
        if self.vector_backend == "qdrant" and not self.qdrant_url:
            raise ValueError("RUBRICSEARCH_QDRANT_URL is required when the vector backend is qdrant")
        for hostport in self.url_allowed_hosts:
            host, _, port = hostport.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"RUBRICSEARCH_URL_ALLOWED_HOSTS entries must be host:port (got {hostport!r})")
        for key in (*self.admin_api_keys, *self.search_api_keys):
            if len(key.get_secret_value()) < 16:
                raise ValueError("API keys must be at least 16 characters")
        return self

    # -- derived paths ----------------------------------------------------------------------------
    @property
    def catalog_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'catalog.db').resolve()}"

    @property
    def request_image_pixels(self) -> int:
        """The pixel limit of one image sent in a request."""
        return min(self.max_image_pixels, self.max_query_image_pixels)

    @property
    def blobs_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def packages_dir(self) -> Path:
        return self.data_dir / "packages"

    @property
    def faiss_dir(self) -> Path:
        return self.data_dir / "faiss"


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def worker_batch_size(settings: Settings) -> int:
    """Items per claimed batch: large on a GPU, where a batch is one tower pass and one LM pass."""
    if settings.worker_batch_size is not None:
        return settings.worker_batch_size
    import torch

    return 64 if settings.device != "cpu" and torch.cuda.is_available() else 8
