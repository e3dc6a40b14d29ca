"""The vector index seam: one small Protocol plus the input checks every backend shares.

Vectors are float32, L2-normalised embeddings and the score is their inner product, so exact
search gives the same ids and scores on every backend (the congruence suite checks this). Each
reference set has its own index with its own dimension, because the Matryoshka dimension is a
per-set setting.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, NamedTuple, Protocol, runtime_checkable

import numpy as np
import numpy.typing as npt

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.index.filters import KEY_RE, Filter

SET_ID_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")
SHA256_RE = re.compile(r"^[0-9a-f]{64}$")
MAX_DIM = 65_536
# Embeddings arrive normalised; a looser norm means a caller forgot to renormalise after Matryoshka
# truncation, which would silently skew every score.
NORM_TOLERANCE = 1e-3

FloatArray = npt.NDArray[np.float32]


class Hit(NamedTuple):
    """One search result: an image sha256 and its inner-product score (higher is closer)."""

    id: str
    score: float


@runtime_checkable
class VectorIndex(Protocol):
    """A store of per-set vector indexes keyed by image sha256.

    Every method that names a set other than :meth:`create_set` and :meth:`has_set` raises
    :class:`~retrieval.errors.NotFound` for an unknown set; bad input raises
    :class:`~retrieval.errors.InvalidInput`; an unreachable store raises
    :class:`~retrieval.errors.BackendUnavailable`.
    """

    def create_set(self, set_id: str, dim: int) -> None:
        """Create an empty set; a no-op if it exists with ``dim``, ``Conflict`` if with another."""
        ...

    def drop_set(self, set_id: str) -> None:
        """Delete a set and all its vectors."""
        ...

    def has_set(self, set_id: str) -> bool: ...

    def list_sets(self) -> dict[str, int]:
        """All sets and their dimensions."""
        ...

    def dim(self, set_id: str) -> int: ...

    def upsert(self, set_id: str, ids: Sequence[str], vectors: npt.ArrayLike) -> None:
        """Insert or replace vectors ``[N, D]``; re-upserting an id replaces it, never duplicates."""
        ...

    def delete(self, set_id: str, ids: Iterable[str]) -> None:
        """Remove ids; ids not in the set are ignored so deletes can be retried."""
        ...

    def set_payloads(self, set_id: str, payloads: Mapping[str, Mapping[str, Any]]) -> None:
        """Replace the metadata payload of ids in the set (ids not in it are ignored); filters read it.
        Upserting an id keeps its payload, deleting it drops it."""
        ...

    def payloads(self, set_id: str, ids: Iterable[str]) -> dict[str, dict[str, Any]]:
        """The stored payloads of those ids that are in the set (``{}`` for one without any): what start-up
        reconciliation compares with the catalog."""
        ...

    def count(self, set_id: str, filter: Filter | None = None) -> int:
        """Vectors in the set, or those whose payload passes ``filter``."""
        ...

    def ids(self, set_id: str) -> set[str]: ...

    def vectors(self, set_id: str, ids: Iterable[str]) -> dict[str, FloatArray]:
        """Stored vectors by id (ids not in the set are left out): query by an indexed image, checks."""
        ...

    def matching(self, set_id: str, ids: Iterable[str], filter: Filter | None = None) -> set[str]:
        """Which of ``ids`` are in the set and, with ``filter``, have a payload that passes it: whether a filter
        keeps a known image, asked of that image alone (a search cannot say it: duplicates may fill its top-k)."""
        ...

    def search(self, set_id: str, query: npt.ArrayLike, k: int, filter: Filter | None = None) -> list[list[Hit]]:
        """Top-``k`` hits, best first, for each query row (``[D]`` counts as one row); with ``filter``, the
        top-``k`` of the ids whose payload passes it (found inside the search, never by trimming a top-k)."""
        ...

    def flush(self) -> None:
        """Make every accepted write durable."""
        ...

    def close(self) -> None: ...

    def health(self) -> bool: ...


def check_set_id(set_id: str) -> str:
    """Set ids become file and collection names, so only a safe alphabet is allowed."""
    if not isinstance(set_id, str) or not SET_ID_RE.match(set_id):
        raise InvalidInput(
            f"invalid set id {set_id!r}: use 1-128 letters, digits, '_', '.' or '-', starting with a letter or digit",
            set_id=str(set_id),
        )
    return set_id


def check_dim(dim: int) -> int:
    if isinstance(dim, bool) or not isinstance(dim, int | np.integer) or not 1 <= int(dim) <= MAX_DIM:
        raise InvalidInput(f"invalid dimension {dim!r}: must be an integer in 1..{MAX_DIM}", dim=str(dim))
    return int(dim)


def check_k(k: int) -> int:
    if isinstance(k, bool) or not isinstance(k, int | np.integer) or int(k) < 1:
        raise InvalidInput(f"invalid k {k!r}: must be a positive integer", k=str(k))
    return int(k)


def check_ids(ids: Iterable[str]) -> list[str]:
    """Ids are lower-case sha256 hex digests; upper case is accepted and folded."""
    out: list[str] = []
    for raw in ids:
        value = raw.lower() if isinstance(raw, str) else raw
        if not isinstance(value, str) or not SHA256_RE.match(value):
            raise InvalidInput(f"invalid id {raw!r}: expected a sha256 hex digest", id=str(raw)[:80])
        out.append(value)
    return out


def _as_matrix(values: npt.ArrayLike, dim: int, what: str) -> FloatArray:
    try:
        arr = np.asarray(values, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InvalidInput(f"{what} must be a numeric array: {exc}") from exc
    if arr.ndim == 1:
        arr = arr[None, :]
    if arr.ndim != 2:
        raise InvalidInput(f"{what} must have shape [N, {dim}], got {list(arr.shape)}")
    if arr.shape[0] and arr.shape[1] != dim:
        raise InvalidInput(
            f"{what} have dimension {arr.shape[1]} but the set's dimension is {dim}",
            expected=dim,
            got=int(arr.shape[1]),
        )
    if arr.shape[0] == 0:
        return np.zeros((0, dim), dtype=np.float32)
    if not np.isfinite(arr).all():
        raise InvalidInput(f"{what} contain NaN or infinite values")
    norms = np.linalg.norm(arr, axis=1)
    bad = np.flatnonzero(np.abs(norms - 1.0) > NORM_TOLERANCE)
    if bad.size:
        raise InvalidInput(
            f"{what} must be L2-normalised: row {int(bad[0])} has norm {float(norms[bad[0]]):.6g}",
            row=int(bad[0]),
        )
    return np.ascontiguousarray(arr)


def check_vectors(ids: Sequence[str], vectors: npt.ArrayLike, dim: int) -> tuple[list[str], FloatArray]:
    """Validate an upsert batch; a repeated id keeps its last vector, as sequential upserts would."""
    clean_ids = check_ids(ids)
    arr = _as_matrix(vectors, dim, "vectors")
    if arr.shape[0] != len(clean_ids):
        raise InvalidInput(f"got {len(clean_ids)} ids but {arr.shape[0]} vectors")
    last = {sha: row for row, sha in enumerate(clean_ids)}
    if len(last) != len(clean_ids):
        rows = sorted(last.values())
        return [clean_ids[r] for r in rows], arr[rows]
    return clean_ids, arr


def check_queries(query: npt.ArrayLike, dim: int) -> FloatArray:
    """Validate a query ``[D]`` or ``[Q, D]`` and return it as ``[Q, D]``."""
    return _as_matrix(query, dim, "query vectors")


def check_payloads(payloads: Mapping[str, Mapping[str, Any]]) -> dict[str, dict[str, Any]]:
    """Payloads by id: objects whose keys filters can name (the catalog bounds their size)."""
    out: dict[str, dict[str, Any]] = {}
    for sha, payload in zip(check_ids(payloads), payloads.values(), strict=True):
        if not isinstance(payload, Mapping) or not all(isinstance(k, str) and KEY_RE.match(k) for k in payload):
            raise InvalidInput(f"the payload of {sha} must be an object keyed by 1-64 letters, digits, '_' or '-'")
        out[sha] = dict(payload)
    return out
