"""The previous release's flat ``RUBRICSEARCH_*`` names, read for one more release with a warning.

A renamed variable's value goes to its new place (``RUBRICSEARCH_MAX_JSON_BYTES`` →
``RUBRICSEARCH_LIMITS__MAX_JSON_BYTES``) unless the new name is set too, which wins. A variable whose value
became a constant is ignored: a deployment that still sets it must start, and the warning says what the value
is now and why. Both come from the environment and from the .env file. Remove this module one release after
the grouped names shipped (CHANGELOG.md, "Settings").
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

from pydantic.fields import FieldInfo
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource
from pydantic_settings.sources import EnvSettingsSource

log = logging.getLogger(__name__)

PREFIX = "RUBRICSEARCH_"

# Grouped settings that became constants: (group, field) → (the constant now holding the value, that value, why it
# is no setting). "auto" names the rule that picks the value by device or from other settings. Their grouped variables
# are ignored with a warning (:func:`drop_demoted`), and so are their flat names (PREVIOUS).
DEMOTED: dict[tuple[str, str], tuple[str, str, str]] = {
    ("models", "embed_batch_size"): ("rubricsearch.retrieval.runtime.local.LocalRuntime", "auto",
                                     "64 rows per LM pass on CUDA, 16 on the CPU, merged across requests"),
    ("models", "rerank_batch_size"): ("rubricsearch.retrieval.runtime.local.LocalRuntime", "auto",
                                      "64 rows per LM pass on CUDA, 16 on the CPU, merged across requests"),
    ("models", "lm_workers"): ("rubricsearch.retrieval.qwen.engine.batching.default_workers", "auto",
                               "one LM worker on a GPU, whose passes share one stream, one per core on a CPU"),
    ("models", "torch_threads"): ("rubricsearch.app.threads.op_threads", "auto",
                                  "one thread per op on a CPU for embedders narrower than 512, else torch's default"),
    ("models", "compile_blocks"): ("rubricsearch.app.model_loading.COMPILE_BLOCKS", "False",
                                   "compiled blocks gained nothing beyond the spread between runs as a default and "
                                   "cost a slow first batch per shape (docs/performance.md)"),
    ("models", "fused_kernels"): ("rubricsearch.app.model_loading.FUSED_KERNELS", "auto",
                                  "the accelerated engine runs Liger's kernels wherever they can run, measured "
                                  "faster (docs/performance.md); RUBRICSEARCH_MODELS__ENGINE=local runs without"),
    ("models", "cuda_graphs"): ("rubricsearch.app.model_loading.CUDA_GRAPHS", "True",
                                "the accelerated engine replays small passes as CUDA graphs, measured faster "
                                "(docs/performance.md); RUBRICSEARCH_MODELS__ENGINE=local runs without"),
    ("models", "bulk_graphs"): ("rubricsearch.app.model_loading.BULK_GRAPHS", "True",
                                "the accelerated engine replays ingestion's recurring passes as CUDA graphs, "
                                "measured faster (docs/performance.md); RUBRICSEARCH_MODELS__ENGINE=local runs "
                                "without"),
    ("models", "embedding_backend"): ("rubricsearch.app.settings.Settings.backend", "auto",
                                      "vllm where RUBRICSEARCH_VLLM__EMBEDDING_URL is set, else local"),
    ("models", "reranker_backend"): ("rubricsearch.app.settings.Settings.backend", "auto",
                                     "vllm where RUBRICSEARCH_VLLM__RERANKER_URL is set, else local"),
    ("models", "min_pixels"): ("rubricsearch.retrieval.qwen.engine.vision.DEFAULT_MIN_PIXELS", "4096",
                               "the official processor's floor; a higher one only upsamples small images into more "
                               "tokens"),
    ("vllm", "timeout_s"): ("rubricsearch.app.model_loading.VLLM_TIMEOUT_S", "60.0",
                            "a batch takes seconds: a minute means a stuck server, and the request is retried"),
    ("vllm", "max_retries"): ("rubricsearch.app.model_loading.VLLM_MAX_RETRIES", "3",
                              "a restarting server comes back within them; one that does not is down (503)"),
    ("vllm", "concurrency"): ("rubricsearch.app.model_loading.VLLM_CONCURRENCY", "8",
                              "keeps vLLM's continuous batching full with a bounded connection pool"),
    ("vllm", "package_keys"): ("rubricsearch.retrieval.runtime.config.VLLMConfig.package_keys", "True",
                               "keys go only to a server probed at start-up to read the package store; others get "
                               "the tensors"),
    ("packages", "query_memory_bytes"): ("rubricsearch.app.state.QUERY_MEMORY_SHARE", "0.25",
                                         "query packages live for one search: a quarter of "
                                         "RUBRICSEARCH_PACKAGES__MEMORY_BYTES holds many searches' candidates"),
    ("vectors", "backend"): ("rubricsearch.app.settings.Settings.vector_backend", "auto",
                             "qdrant where RUBRICSEARCH_VECTORS__QDRANT_URL is set, else the embedded FAISS index"),
    ("vectors", "search_device"): ("rubricsearch.app.state.VECTOR_SEARCH_DEVICE", "auto",
                                 "a GPU where there is one (faiss-gpu where installed, else torch), else the CPU; "
                                 "candidates are re-scored in float32, so the device changes no result"),
    ("vectors", "device_max_bytes"): ("rubricsearch.app.state.VECTOR_DEVICE_MAX_BYTES", "17179869184",
                                      "larger sets search on the CPU's index"),
    ("vectors", "faiss_filter_graph_bytes"): ("rubricsearch.app.state.FAISS_FILTER_GRAPH_BYTES", "1073741824",
                                              "a cache of filter graphs: without one a filter walks or scans the "
                                              "set, with the same results"),
    ("vectors", "default_dimensions"): ("rubricsearch.app.sets.check_dimensions", "auto",
                                        "the model's full size; a set's creation names a smaller one (dimensions)"),
    ("search", "default_top_k"): ("rubricsearch.app.services.DEFAULT_TOP_K", "50", "a request names its own top_k"),
    ("search", "default_top_n"): ("rubricsearch.app.services.DEFAULT_TOP_N", "10", "a request names its own top_n"),
    ("search", "max_criteria"): ("rubricsearch.app.services.MAX_CRITERIA", "12",
                                 "each criterion is a reranker pass over the shortlist: it bounds a search's cost"),
    ("search", "facet_min_confidence"): ("rubricsearch.app.services.FACET_MIN_CONFIDENCE", "0.5",
                                         "the more likely value; a request names another (min_confidence)"),
    ("limits", "max_query_image_pixels"): ("rubricsearch.app.settings.MAX_QUERY_IMAGE_PIXELS", "50000000",
                                           "a request's image is resized to max_pixels anyway; "
                                           "RUBRICSEARCH_LIMITS__DECODE_PIXEL_BUDGET can lower it"),
    ("limits", "max_image_bytes"): ("rubricsearch.app.settings.MAX_IMAGE_BYTES", "33554432",
                                    "a JPEG of the pixel limit is well below it, and the models see every image "
                                    "resized to max_pixels: a larger file is a scan to convert first"),
    ("limits", "max_image_pixels"): ("rubricsearch.app.settings.MAX_IMAGE_PIXELS", "64000000",
                                     "an 8000 x 8000 photo; RUBRICSEARCH_LIMITS__DECODE_PIXEL_BUDGET lowers it where "
                                     "that is smaller: one image never decodes beyond the whole budget"),
    ("limits", "max_request_bytes"): ("rubricsearch.app.http_limits.MAX_REQUEST_BYTES", "268435456",
                                      "a request carries images or one zip; larger collections import from a server "
                                      "folder or from URLs"),
    ("limits", "zip_max_entries"): ("rubricsearch.app.services.ZIP_MAX_ENTRIES", "10000",
                                    "a zip's directory is read whole; more files go in several zips"),
    ("limits", "zip_max_total_bytes"): ("rubricsearch.app.services.ZIP_MAX_TOTAL_BYTES", "2147483648",
                                        "bounds what one upload unpacks on the data disk; more go in several zips"),
    ("limits", "url_max_bytes"): ("rubricsearch.app.settings.MAX_IMAGE_BYTES", "33554432",
                                  "the limit of any image file; larger is no image the models take"),
    ("limits", "max_embedding_inputs"): ("rubricsearch.app.deps.MAX_EMBEDDING_INPUTS", "512",
                                         "one request's inputs are one batch of work admitted at once"),
    ("limits", "max_rerank_documents"): ("rubricsearch.app.deps.MAX_RERANK_DOCUMENTS", "1000",
                                         "one request's documents are one batch of work admitted at once"),
    ("limits", "max_queued_model_inputs"): ("rubricsearch.app.deps.MAX_QUEUED_MODEL_INPUTS", "8192",
                                            "a few seconds of a GPU's work: a refused client retries sooner than a "
                                            "queued one would finish"),
    ("limits", "max_concurrent_requests"): ("rubricsearch.app.http_limits.MAX_CONCURRENT_REQUESTS", "256",
                                            "far above what the models serve at once; it bounds request threads"),
    ("limits", "max_connections"): ("rubricsearch.app.http_limits.MAX_CONNECTIONS", "1024",
                                    "a few connections per client, with idle keep-alives"),
    ("ingest", "worker_id"): ("rubricsearch.app.services.worker_id", "auto",
                              "host and data folder with FAISS, so a restarted server gets its claims back at once; "
                              "host and pid otherwise; `rubricsearch worker --worker-id` names one"),
    ("ingest", "batch_size"): ("rubricsearch.app.settings.worker_batch_size", "auto",
                               "64 items per claim with a CUDA device (one tower and one LM pass), 8 on the CPU; "
                               "`rubricsearch worker --batch-size` chooses another for a worker process"),
    ("ingest", "batch_pixels"): ("rubricsearch.app.services.INGEST_BATCH_PIXELS", "100000000",
                                 "keeps a batch's decoding below the decoded-pixel budget's default"),
    ("ingest", "stop_timeout_s"): ("rubricsearch.app.services.WORKER_STOP_TIMEOUT_S", "120.0",
                                   "a batch takes seconds; compose.yaml's stop_grace_period is longer"),
}

# The previous release's flat names (lower case, no prefix) → their grouped place: a place that is a field of
# Settings is where a renamed name's value goes; one in DEMOTED is a constant now, and the name is ignored.
PREVIOUS: dict[str, tuple[str, str]] = {
    **{name: ("models", name) for name in (
        "embedding_model", "reranker_model", "embedding_backend", "reranker_backend", "device", "dtype",
        "min_pixels", "max_pixels", "preprocess", "compile_blocks", "fused_kernels", "cuda_graphs", "bulk_graphs",
        "fallback_to_test_models", "embedding_model_aliases", "reranker_model_aliases", "embed_batch_size",
        "rerank_batch_size", "lm_workers", "torch_threads")},
    **{f"vllm_{name}": ("vllm", name) for name in (
        "embedding_url", "reranker_url", "embedding_served_name", "reranker_served_name", "api_key", "timeout_s",
        "max_retries", "concurrency", "package_keys")},
    "package_storage_dtype": ("packages", "storage_dtype"),
    "package_memory_bytes": ("packages", "memory_bytes"),
    "package_disk_bytes": ("packages", "disk_bytes"),
    "query_package_memory_bytes": ("packages", "query_memory_bytes"),
    "vector_backend": ("vectors", "backend"),
    "qdrant_url": ("vectors", "qdrant_url"),
    "qdrant_api_key": ("vectors", "qdrant_api_key"),
    "vector_search_device": ("vectors", "search_device"),
    "default_dimensions": ("vectors", "default_dimensions"),
    "vector_device_max_bytes": ("vectors", "device_max_bytes"),
    "faiss_filter_graph_bytes": ("vectors", "faiss_filter_graph_bytes"),
    **{name: ("search", name) for name in ("default_top_k", "default_top_n", "max_criteria", "facet_min_confidence")},
    **{name: ("limits", name) for name in (
        "max_image_bytes", "max_image_pixels", "max_request_bytes", "max_json_bytes", "decode_pixel_budget",
        "max_query_image_pixels", "zip_max_entries", "zip_max_total_bytes", "url_max_bytes", "max_embedding_inputs",
        "max_rerank_documents", "max_queued_model_inputs", "max_concurrent_requests", "max_connections")},
    **{name: ("auth", name) for name in (
        "admin_api_keys", "search_api_keys", "search_requires_key", "rate_limit_per_minute", "session_secret",
        "session_cookie_secure")},
    "workers": ("ingest", "workers"),
    "worker_id": ("ingest", "worker_id"),
    "worker_batch_size": ("ingest", "batch_size"),
    "url_allowed_hosts": ("ingest", "url_allowed_hosts"),
    "worker_batch_pixels": ("ingest", "batch_pixels"),
    "worker_stop_timeout_s": ("ingest", "stop_timeout_s"),
}
RENAMED: dict[str, tuple[str, str]] = {old: place for old, place in PREVIOUS.items() if place not in DEMOTED}

# old flat name → (the constant now holding its value, that value, why it is no setting): the flat settings that
# were never grouped, then the demoted ones; tests/test_settings_renames.py checks each value against its constant
FIXED: dict[str, tuple[str, str, str]] = {
    "malloc_arena_max": ("rubricsearch.app.main.MALLOC_ARENA_MAX", "2",
                         "fewer arenas keep freed memory reusable across the server's threads"),
    "malloc_trim_interval_s": ("rubricsearch.app.main.MALLOC_TRIM_INTERVAL_S", "5.0",
                               "a trim only walks free lists, cheap every few seconds, and bounds what one "
                               "interval retains"),
    "sse_poll_interval_s": ("rubricsearch.app.routers.jobs.SSE_POLL_INTERVAL_S", "0.5",
                            "a progress check is one catalog read, and half a second looks live"),
    "sse_heartbeat_s": ("rubricsearch.app.routers.jobs.SSE_HEARTBEAT_S", "15.0",
                        "below the idle timeouts of common proxies (nginx 60 s)"),
    "decode_wait_s": ("rubricsearch.app.state.DECODE_WAIT_S", "2.0",
                      "a request waits out a batch's decoding, then gets 503 with Retry-After"),
    "worker_poll_interval_s": ("rubricsearch.app.services.WORKER_POLL_INTERVAL_S", "1.0",
                               "an idle claim query a second costs nothing and starts a job within a second"),
    "faiss_ann_threshold": ("rubricsearch.app.state.FAISS_ANN_THRESHOLD", "50000",
                            "below it an exact scan is as fast as HNSW and has no recall loss"),
    "vector_device_precision": ("rubricsearch.app.state.VECTOR_DEVICE_PRECISION", "auto",
                                "candidates are re-scored in float32, so the GPU copy's format changes no result"),
    "url_timeout_s": ("rubricsearch.app.services.URL_TIMEOUT_S", "20.0",
                      "a whole URL download's deadline, long enough for url_max_bytes on a slow link"),
    "url_max_redirects": ("rubricsearch.app.services.URL_MAX_REDIRECTS", "3",
                          "image hosts redirect once or twice; each hop is checked against the address rules"),
    "url_fetch_threads": ("rubricsearch.app.services.URL_FETCH_THREADS", "8",
                          "enough downloads in flight to keep a GPU batch fed"),
    "url_fetch_ahead_bytes": ("rubricsearch.app.services.URL_FETCH_AHEAD_BYTES", "268435456",
                              "bounds the fetched bytes a worker holds; MAX_IMAGE_BYTES bounds "
                              "one item"),
    "max_json_values": ("rubricsearch.app.jsonbody.MAX_JSON_VALUES", "100000",
                        "parser work per body; RUBRICSEARCH_LIMITS__MAX_JSON_BYTES bounds the body"),
    "max_json_depth": ("rubricsearch.app.jsonbody.MAX_JSON_DEPTH", "64",
                       "no request schema nests deeper than a few levels"),
    "max_header_bytes": ("rubricsearch.app.http_limits.MAX_HEADER_BYTES", "65536",
                         "the API's headers are a few hundred bytes"),
    "max_headers": ("rubricsearch.app.http_limits.MAX_HEADERS", "100",
                    "the API's requests carry about ten header fields"),
    "header_timeout_s": ("rubricsearch.app.http_limits.HEADER_TIMEOUT_S", "10.0",
                         "any client sends its headers within a second; slow ones are holding a connection"),
    "body_timeout_s": ("rubricsearch.app.http_limits.BODY_TIMEOUT_S", "30.0",
                       "a pause between body bytes, not the upload's length"),
    "rate_limit_burst": ("rubricsearch.app.auth.RATE_LIMIT_BURST", "30",
                         "a page of thumbnails or a batch script's first requests; "
                         "RUBRICSEARCH_AUTH__RATE_LIMIT_PER_MINUTE sets the rate"),
    "session_max_age_s": ("rubricsearch.app.auth.SESSION_MAX_AGE_S", "43200",
                          "an admin signs in once a working day"),
    **{old: DEMOTED[place] for old, place in PREVIOUS.items() if place in DEMOTED},
}


def new_name(old: str) -> str:
    """The variable that replaces the flat ``RUBRICSEARCH_<OLD>``."""
    group, field = RENAMED[old]
    return f"{PREFIX}{group.upper()}__{field.upper()}"


class RenamedVariables(PydanticBaseSettingsSource):
    """The old flat names found in the environment or the .env file, as the nested values they now set."""

    def __init__(self, settings_cls: type[BaseSettings], env: PydanticBaseSettingsSource,
                 dotenv: PydanticBaseSettingsSource) -> None:
        super().__init__(settings_cls)
        self.sources = [s for s in (env, dotenv) if isinstance(s, EnvSettingsSource)]

    def get_field_value(self, field: FieldInfo, field_name: str) -> tuple[Any, str, bool]:
        return None, field_name, False  # __call__ reads the old names, which are no fields

    def _lookup(self, old: str) -> str | None:
        for source in self.sources:
            key = f"{PREFIX}{old}" if source.case_sensitive else f"{PREFIX}{old}".lower()
            value = source.env_vars.get(key)
            if value is not None:
                return value
        return None

    def _is_set(self, name: str) -> bool:
        return any(name.lower() in {k.lower() for k in source.env_vars} for source in self.sources)

    def __call__(self) -> dict[str, Any]:
        out: dict[str, dict[str, str]] = {}
        for old, (group, field) in RENAMED.items():
            value = self._lookup(old.upper())
            if value is None:
                continue
            new = new_name(old)
            if self._is_set(new):
                _warn(f"{PREFIX}{old.upper()} is ignored: {new}, its new name, is set too")
                continue
            _warn(f"{PREFIX}{old.upper()} is renamed {new}; the old name stops working in the next release")
            out.setdefault(group, {})[field] = value
        for old, (constant, value, why) in FIXED.items():
            if self._lookup(old.upper()) is not None:
                _warn(f"{PREFIX}{old.upper()} is ignored: the value is fixed at {value} ({constant}): {why}")
        for (group, field), (constant, value, why) in DEMOTED.items():
            # a gone group's variables never reach drop_demoted: Settings ignores unknown top-level names
            if group not in GROUPED and self._lookup(f"{group}__{field}".upper()) is not None:
                _warn(f"{PREFIX}{group.upper()}__{field.upper()} is ignored: the value is fixed at {value} "
                      f"({constant}): {why}")
        return out


def refuse_flat_keywords(init: PydanticBaseSettingsSource) -> None:
    """Code passing an old flat name to ``Settings(...)`` fails at once: with ``extra="ignore"`` (needed for the
    variables and .env lines of other programs) the value would otherwise be dropped without a word."""
    for name in getattr(init, "init_kwargs", {}):
        if name in RENAMED:
            group, field = RENAMED[name]
            raise TypeError(f"Settings({name}=...) is Settings({group}={{{field!r}: ...}}) now")
        if name in FIXED:
            raise TypeError(f"Settings({name}=...): {name} is the constant {FIXED[name][0]} now")


def drop_demoted(data: Any) -> Any:
    """The settings' input without the grouped variables of settings that became constants, each with a warning (a
    deployment setting one must start; a group's unknown fields would stop it)."""
    if not isinstance(data, dict):
        return data
    for (group, field), (constant, value, why) in DEMOTED.items():
        values = data.get(group)
        if isinstance(values, dict) and field in values:
            data = {**data, group: {k: v for k, v in values.items() if k != field}}
            if not data[group] and group not in GROUPED:
                del data[group]
            _warn(f"{PREFIX}{group.upper()}__{field.upper()} is ignored: the value is fixed at {value} ({constant}): "
                  f"{why}")
    return data


# the groups Settings has (a demoted one's whole group may be gone: `search`)
GROUPED = ("models", "vllm", "packages", "vectors", "limits", "auth", "ingest")


def _warn(message: str) -> None:
    warnings.warn(message, DeprecationWarning, stacklevel=2)
    log.warning("%s", message)

