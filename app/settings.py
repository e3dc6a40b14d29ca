"""All configuration in one validated place: ``RUBRICSEARCH_*`` environment variables (or a .env file).

A few choices sit at the top (``RUBRICSEARCH_DATA_DIR``); the rest are grouped by what they configure, one
pydantic model per group, set as ``RUBRICSEARCH_<GROUP>__<FIELD>`` (``RUBRICSEARCH_LIMITS__MAX_JSON_BYTES``).
A group is one typed object its consumer takes whole (``settings.models`` for the model constructors).
Values only a developer would tune are constants beside the code that uses them, not settings.

Settings are read and validated once at start-up; a bad value stops the process with a message that
names the variable, instead of failing later inside a request. The flat names of the previous release still
work for one release, with a warning (app/settings_renames.py).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from functools import lru_cache
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    BeforeValidator,
    ByteSize,
    Field,
    SecretStr,
    TypeAdapter,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, PydanticBaseSettingsSource, SettingsConfigDict

from rubricsearch.app.settings_renames import RenamedVariables, drop_demoted, refuse_flat_keywords

MiB = 1024 * 1024
# Bytes of one image file, in a request or ingested: a JPEG of MAX_IMAGE_PIXELS is well below it, and the models see
# every image resized to models.max_pixels, so a larger file is a scan to convert before it is sent, not a choice.
MAX_IMAGE_BYTES = 32 * MiB
# Decoded pixels of one image (an 8000 x 8000 photo), unless the decoding budget is smaller: one image never holds
# more than the whole budget, so a larger one would break the memory bound the budget promises (docs/hardening.md).
MAX_IMAGE_PIXELS = 64_000_000
# Decoded pixels of one image sent in a request (searches, embeddings, reranks, visual packages): it is resized to
# max_pixels anyway, so this bounds only the decoding.
MAX_QUERY_IMAGE_PIXELS = 50_000_000
_BYTE_SIZE = TypeAdapter(ByteSize)


def _byte_size(value: object) -> object:
    """Byte settings also take units (``48MiB``, ``2GiB``, ``500kB``), as operators write them."""
    return int(_BYTE_SIZE.validate_python(value)) if isinstance(value, str) else value


def _split_list(value: object) -> object:
    """Env values are comma-separated (``a,b``) or a JSON array (``["a","b"]``)."""
    if isinstance(value, str):
        if value.lstrip().startswith("["):
            return json.loads(value)
        return [k.strip() for k in value.split(",") if k.strip()]
    return value


Bytes = Annotated[int, BeforeValidator(_byte_size)]
Names = Annotated[list[str], NoDecode, BeforeValidator(_split_list)]
Keys = Annotated[list[SecretStr], NoDecode, BeforeValidator(_split_list)]


class _Group(BaseModel):
    """A group of settings (``RUBRICSEARCH_<GROUP>__<FIELD>``); a misspelt field stops the start-up."""

    model_config = {"extra": "forbid"}


class ModelSettings(_Group):
    """The models, their backends and the local engine: the one object the model constructors take."""

    embedding_model: str = Field(
        "Qwen/Qwen3-VL-Embedding-2B", description="Hub id or local folder of the embedding model.")
    reranker_model: str = Field(
        "Qwen/Qwen3-VL-Reranker-2B", description="Hub id or local folder of the reranker model.")
    device: str = Field(
        "auto", description="Torch device of the local models (auto: the first CUDA device, else the CPU).")
    dtype: str = Field(
        "auto", description="Torch dtype of the local models (auto: bfloat16 on CUDA, float32 on the CPU).")
    max_pixels: int = Field(
        1_843_200, ge=4096, description="Largest pixel count an image is resized down to before the vision tower.")
    preprocess: Literal["official", "gpu-nvjpeg"] = Field(
        "official", description="How images become pixel values: the official pixels bit for bit, resized on the "
        "model's device where it is a GPU (official), or JPEGs decoded by nvJPEG with their own package "
        "fingerprint (gpu-nvjpeg).")
    engine: Literal["auto", "local"] = Field(
        "auto", description="The local models' engine: auto the accelerated one on a GPU (CUDA graphs, fused "
        "kernels where they can run, packed passes; docs/architecture.md), local the plain reference engine "
        "everywhere.")
    fallback_to_test_models: bool = Field(
        False, description="Serves offline random-weight test checkpoints when the real models cannot be loaded.")
    embedding_model_aliases: Names = Field(
        default_factory=list, description="Extra names the API accepts in `model` for the embedder.")
    reranker_model_aliases: Names = Field(
        default_factory=list, description="Extra names the API accepts in `model` for the reranker.")


class VLLMSettings(_Group):
    """The vLLM servers behind the vllm backends."""

    embedding_url: str | None = Field(
        None, description="Base URL of the vLLM embedding server; when set, embeddings run there, not in this "
        "process.")
    reranker_url: str | None = Field(
        None, description="Base URL of the vLLM reranker server; when set, reranking runs there, not in this "
        "process.")
    embedding_served_name: str | None = Field(
        None, description="The name the embedding server serves (--served-model-name); default: the embedding model.")
    reranker_served_name: str | None = Field(
        None, description="The name the reranker server serves (--served-model-name); default: the reranker model.")
    api_key: SecretStr | None = Field(None, description="Bearer key sent to the vLLM servers.")


class PackageSettings(_Group):
    """Cached vision-tower outputs ("visual packages")."""

    storage_dtype: Literal["auto", "float32", "bfloat16", "float8_e4m3fn"] = Field(
        "auto", description="Number format of stored visual packages (auto: float8 e4m3 with per-token scales).")
    memory_bytes: Bytes = Field(2048 * MiB, ge=0, description="Memory kept for reference packages.")
    disk_bytes: Bytes = Field(100 * 1024 * MiB, ge=0, description="Disk kept for reference packages.")


class VectorSettings(_Group):
    """The vector index."""

    qdrant_url: str | None = Field(
        None, description="URL of a Qdrant server; when set, the vectors live there, not in the embedded FAISS index.")
    qdrant_api_key: SecretStr | None = Field(None, description="API key sent to the Qdrant server.")


class LimitSettings(_Group):
    """Bounds an operator sets for their hardware and threat model (docs/hardening.md)."""

    max_json_bytes: Bytes = Field(
        24 * MiB, ge=1024, description="Largest JSON body, which is parsed whole in memory (send larger images as "
        "multipart or by image_id).")
    decode_pixel_budget: int = Field(
        128_000_000, ge=1_000_000, description="Image pixels, as their headers declare them, decoded at once across "
        "searches, embeddings, reranks, visual packages and ingestion batches; one image may have at most this many "
        "(and at most 64,000,000).")


class AuthSettings(_Group):
    """Who may do what."""

    admin_api_keys: Keys = Field(
        default_factory=list, description="Keys that may create, change and delete sets, images and jobs.")
    search_api_keys: Keys = Field(default_factory=list, description="Keys that may use the search-class routes.")
    search_requires_key: bool = Field(False, description="Requires a key for the search-class routes too.")
    rate_limit_per_minute: int = Field(
        0, ge=0, description="Requests per minute per client on the search-class routes (0: no limit).")
    session_secret: SecretStr | None = Field(
        None, description="Secret signing admin session cookies (default: a new one per process).")
    session_cookie_secure: bool = Field(False, description="Marks the session cookie Secure (serve over HTTPS).")

    @field_validator("admin_api_keys", "search_api_keys")
    @classmethod
    def _long_keys(cls, keys: list[SecretStr]) -> list[SecretStr]:
        if any(len(key.get_secret_value()) < 16 for key in keys):
            raise ValueError("API keys must be at least 16 characters")
        return keys


class IngestSettings(_Group):
    """Ingestion workers, in the server or in `rubricsearch worker`."""

    workers: int = Field(1, ge=0, le=64, description="In-process ingestion worker threads.")
    url_allowed_hosts: Names = Field(
        default_factory=list,
        description="`host:port` pairs URL imports may reach even when they resolve to private addresses.")

    @field_validator("url_allowed_hosts")
    @classmethod
    def _host_ports(cls, entries: list[str]) -> list[str]:
        for hostport in entries:
            host, _, port = hostport.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) <= 65535:
                raise ValueError(f"RUBRICSEARCH_INGEST__URL_ALLOWED_HOSTS entries must be host:port (got {hostport!r})")
        return entries


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="RUBRICSEARCH_", env_file=".env", env_nested_delimiter="__",
                                      extra="ignore")

    # -- storage and server -----------------------------------------------------------------------
    data_dir: Path = Field(
        Path("data"), description="Folder holding the SQLite catalog, blobs, packages and FAISS indexes.")
    database_url: str | None = Field(
        None, description="SQLAlchemy URL of the catalog; default sqlite:///DATA_DIR/catalog.db.")
    host: str = Field("127.0.0.1", description="Address `rubricsearch serve` listens on.")
    port: int = Field(8000, ge=1, le=65535, description="Port `rubricsearch serve` listens on.")
    import_root: Path | None = Field(None, description="Server folders may be imported only under this root.")

    # -- groups -----------------------------------------------------------------------------------
    models: ModelSettings = Field(default_factory=ModelSettings, description="Models.")
    vllm: VLLMSettings = Field(default_factory=VLLMSettings, description="vLLM backends.")
    packages: PackageSettings = Field(default_factory=PackageSettings, description="Visual packages.")
    vectors: VectorSettings = Field(default_factory=VectorSettings, description="Vectors.")
    limits: LimitSettings = Field(default_factory=LimitSettings, description="Input limits.")
    auth: AuthSettings = Field(default_factory=AuthSettings, description="Auth.")
    ingest: IngestSettings = Field(default_factory=IngestSettings, description="Ingestion.")

    @classmethod
    def settings_customise_sources(
        cls, settings_cls: type[BaseSettings], init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource, dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        refuse_flat_keywords(init_settings)
        # The previous release's flat names come last, so a new name set beside its old one wins.
        return (init_settings, env_settings, dotenv_settings,
                RenamedVariables(settings_cls, env_settings, dotenv_settings), file_secret_settings)

    @model_validator(mode="before")
    @classmethod
    def _demoted(cls, data: Any) -> Any:
        return drop_demoted(data)

    @model_validator(mode="after")
    def _check(self) -> Settings:
        return self

    def updated(self, changes: Mapping[str, Any]) -> Settings:
        """A copy with ``changes``, where a group's value is a dict of its fields to change
        (``{"limits": {"max_json_bytes": 1024}}``); like ``model_copy``, nothing is validated again."""
        update: dict[str, Any] = {}
        for name, value in changes.items():
            group = getattr(self, name)
            update[name] = group.model_copy(update=value) if isinstance(group, BaseModel) else value
        return self.model_copy(update=update)

    def backend(self, kind: Literal["embedding", "reranker"]) -> Literal["local", "vllm"]:
        """Where a model runs: on the vLLM server whose URL is set, else in this process."""
        return "vllm" if (self.vllm.embedding_url if kind == "embedding" else self.vllm.reranker_url) else "local"

    def vector_backend(self) -> Literal["faiss", "qdrant"]:
        """Where the vectors live: on the Qdrant server whose URL is set, else in the embedded FAISS index."""
        return "qdrant" if self.vectors.qdrant_url else "faiss"

    # -- derived paths ----------------------------------------------------------------------------
    @property
    def catalog_url(self) -> str:
        return self.database_url or f"sqlite:///{(self.data_dir / 'catalog.db').resolve()}"

    @property
    def image_bytes(self) -> int:
        """The byte limit of one image file."""
        return MAX_IMAGE_BYTES

    @property
    def image_pixels(self) -> int:
        """The decoded-pixel limit of one image: the constant, or the whole decoding budget where that is smaller."""
        return min(MAX_IMAGE_PIXELS, self.limits.decode_pixel_budget)

    @property
    def request_image_pixels(self) -> int:
        """The pixel limit of one image sent in a request."""
        return min(self.image_pixels, MAX_QUERY_IMAGE_PIXELS)

    @property
    def blobs_dir(self) -> Path:
        return self.data_dir / "blobs"

    @property
    def packages_dir(self) -> Path:
        return self.data_dir / "packages"

    @property
    def faiss_dir(self) -> Path:
        return self.data_dir / "faiss"


GROUPS: dict[str, type[BaseModel]] = {
    name: info.annotation for name, info in Settings.model_fields.items()
    if isinstance(info.annotation, type) and issubclass(info.annotation, BaseModel)}


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    return Settings()


def worker_batch_size(settings: Settings) -> int:
    """Items per claimed batch: large on a GPU, where a batch is one tower pass and one LM pass
    (``rubricsearch worker --batch-size`` and ``rubricsearch ingest --batch-size`` choose another)."""
    import torch

    return 64 if settings.models.device != "cpu" and torch.cuda.is_available() else 8
