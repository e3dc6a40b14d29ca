"""What a set's reranker and embedder versions share in service: the cache of loaded version checkpoints, which
judgments a version trained on, and the guard's side-by-side table."""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Generic, TypeVar

from rubricsearch.indexer.catalog.db import Catalog
from rubricsearch.indexer.catalog.versions import ModelName, VersionRecord, active_version_id, get_version

LOADED_VERSIONS = 2  # checkpoints of a kind kept in memory besides the base (each is a whole model)
Model = TypeVar("Model")


class LoadedVersions(Generic[Model]):
    """Version checkpoints kept loaded, by version id: the least recently used is closed past
    :data:`LOADED_VERSIONS`."""

    def __init__(self, close: Callable[[Model], None]) -> None:
        self._close = close
        self._loaded: OrderedDict[str, Model] = OrderedDict()
        self._lock = threading.Lock()

    def cached(self, version_id: str) -> Model | None:
        with self._lock:
            if version_id in self._loaded:
                self._loaded.move_to_end(version_id)
                return self._loaded[version_id]
        return None

    def get(self, version_id: str, load: Callable[[], Model]) -> Model:
        """The loaded version, ``load()`` run (under the lock: once) when it is not."""
        with self._lock:
            if version_id not in self._loaded:
                self._loaded[version_id] = load()
                while len(self._loaded) > LOADED_VERSIONS:
                    self._close(self._loaded.popitem(last=False)[1])
            self._loaded.move_to_end(version_id)
            return self._loaded[version_id]

    def active(self, catalog: Catalog, set_id: str, model: ModelName, load: Callable[[VersionRecord], Model]
               ) -> tuple[Model, str] | None:
        """The set's active version of ``model`` and its id, ``load`` called only when it is not loaded yet; None
        when the set serves the base. Every search asks: the id alone is read, the version's card only to load."""
        with catalog.read() as session:
            version_id = active_version_id(session, set_id, model)
            if version_id is None:
                return None
            loaded = self.cached(version_id)
            if loaded is not None:
                return loaded, version_id
            version = get_version(session, set_id, version_id)
        return load(version), version_id

    def close(self) -> None:
        with self._lock:
            for model in self._loaded.values():
                self._close(model)
            self._loaded.clear()


def training_ids(version: VersionRecord | None) -> set[int]:
    if version is None:
        return set()
    data = version.card.get("data", {})
    return set(data.get("judgment_ids", [])) - set(data.get("validation_judgment_ids", []))


def side_by_side(active: Mapping[str, Any], candidate: Mapping[str, Any], metrics: Sequence[tuple[str, str]],
                 current: VersionRecord | None, version: VersionRecord) -> dict[str, Any]:
    """The guard's table of either model kind: a row per metric (``(name, "higher" or "lower")``: which way is
    better), and whether the candidate passes: no metric worse where both have it, and at least one better."""
    rows, better, worse = [], 0, 0
    for name, direction in metrics:
        a, c = active[name], candidate[name]
        verdict = "not computable"
        if a is not None and c is not None:
            gain = (c - a) if direction == "higher" else (a - c)
            verdict = "better" if gain > 0 else "worse" if gain < 0 else "same"
            better, worse = better + (verdict == "better"), worse + (verdict == "worse")
        rows.append({"metric": name, "better_when": direction, "active": a, "candidate": c, "candidate_is": verdict})
    return {"active": current.id if current is not None else "base", "candidate": version.id, "metrics": rows,
            "passed": worse == 0 and better > 0}
