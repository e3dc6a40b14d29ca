"""Payload filters in Qdrant's filter JSON, checked once and applied inside every backend's vector search.

A filter is ``{"must": [...], "should": [...], "must_not": [...]}``; each condition is a field condition
``{"key": k, "match": {"value": v}}`` / ``{"key": k, "match": {"any": [v, ...]}}`` /
``{"key": k, "range": {"gt"|"gte"|"lt"|"lte": x}}``, or a nested filter. The semantics are Qdrant's, so
its backend passes the filter through and the others agree with it (the index congruence suite checks):
``must`` all hold, ``must_not`` none holds, ``should`` at least one holds when given; a list payload value
matches when any element does; a missing key matches no condition (so it passes a ``must_not``); ``match``
compares strings, integers and booleans by type (``1`` never matches ``true``), ``range`` compares numbers.

Computed attribute facets are named ``facets.<attribute>`` in a ``match`` condition, with an optional
``"min_confidence"`` beside it (default: the ``facet_min_confidence`` setting): the facet's chosen value is one of
those matched *and* its probability reaches the threshold. The payload holds a facet as two plain keys
(:func:`facet_payload`), so the condition becomes a nested filter over them and runs inside every backend's
search like any other.

:class:`Columns` evaluates a filter for a whole set at once over per-key columns (numpy masks), which is
what lets FAISS and the device search apply it as an id selector or a mask instead of trimming a top-k.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt

from retrieval.errors import InvalidMetadata

KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}$")
MAX_CONDITIONS = 64
MAX_DEPTH = 4
MAX_ANY = 256
RANGE_OPS = ("gt", "gte", "lt", "lte")
FACET_PREFIX = "facets."
FACET_VALUE_KEY = "_facet_"  # payload keys user metadata may not use (indexer/catalog/metadata.py)
FACET_P_KEY = "_facetp_"
FACET_MIN_CONFIDENCE = 0.5
ATTRIBUTE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,47}$")  # leaves room for the payload key's prefix
Scalar = str | int | bool
Mask = npt.NDArray[np.bool_]


@dataclass(frozen=True)
class Match:
    """``key`` equals one of ``values`` (``{"value": v}`` is a one-element ``any``)."""

    key: str
    values: tuple[Scalar, ...]
    any: bool


@dataclass(frozen=True)
class Range:
    key: str
    gt: float | None = None
    gte: float | None = None
    lt: float | None = None
    lte: float | None = None

    def holds(self, x: float) -> bool:
        return ((self.gt is None or x > self.gt) and (self.gte is None or x >= self.gte)
                and (self.lt is None or x < self.lt) and (self.lte is None or x <= self.lte))


@dataclass(frozen=True)
class Filter:
    must: tuple[Condition, ...] = ()
    should: tuple[Condition, ...] = ()
    must_not: tuple[Condition, ...] = ()

    def to_json(self) -> dict[str, Any]:
        """The canonical JSON form (a cache key, and what the Qdrant backend sends)."""
        out: dict[str, Any] = {}
        for clause in ("must", "should", "must_not"):
            conditions = getattr(self, clause)
            if conditions:
                out[clause] = [_condition_json(c) for c in conditions]
        return out

    def cache_key(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True, separators=(",", ":"))


Condition = Match | Range | Filter


def _condition_json(c: Condition) -> dict[str, Any]:
    if isinstance(c, Filter):
        return c.to_json()
    if isinstance(c, Match):
        return {"key": c.key, "match": {"any": list(c.values)} if c.any else {"value": c.values[0]}}
    bounds = {op: getattr(c, op) for op in RANGE_OPS if getattr(c, op) is not None}
    return {"key": c.key, "range": bounds}


# ---------------------------------------------------------------------------------------------- parsing
def parse_filter(raw: Any, where: str = "filter", *, facet_min_confidence: float = FACET_MIN_CONFIDENCE
                 ) -> Filter | None:
    """Check a filter's JSON; ``None`` or ``{}`` is no filter. :class:`InvalidMetadata` names the bad part.
    ``facet_min_confidence`` is the threshold of a ``facets.<attr>`` condition that names none."""
    if raw is None:
        return None
    counter = [0]
    parsed = _filter(raw, where, 0, counter, facet_min_confidence)
    return parsed if (parsed.must or parsed.should or parsed.must_not) else None


def _fail(where: str, message: str) -> InvalidMetadata:
    return InvalidMetadata(f"{where}: {message}", location=where)


def _filter(raw: Any, where: str, depth: int, counter: list[int], threshold: float) -> Filter:
    if not isinstance(raw, Mapping):
        raise _fail(where, "a filter must be an object with `must`, `should` and/or `must_not`")
    if depth > MAX_DEPTH:
        raise _fail(where, f"filters nest at most {MAX_DEPTH} levels deep")
    unknown = sorted(set(raw) - {"must", "should", "must_not"})
    if unknown:
        raise _fail(where, f"unknown clause(s) {', '.join(map(repr, unknown))}; use must, should, must_not")
    clauses: dict[str, tuple[Condition, ...]] = {}
    for clause in ("must", "should", "must_not"):
        items = raw.get(clause)
        if items is None:
            clauses[clause] = ()
            continue
        if isinstance(items, Mapping):  # Qdrant accepts a single condition in place of a list
            items = [items]
        if not isinstance(items, list):
            raise _fail(f"{where}.{clause}", "must be a list of conditions")
        clauses[clause] = tuple(_condition(item, f"{where}.{clause}[{i}]", depth, counter, threshold)
                                for i, item in enumerate(items))
    return Filter(**clauses)


def _condition(raw: Any, where: str, depth: int, counter: list[int], threshold: float) -> Condition:
    counter[0] += 1
    if counter[0] > MAX_CONDITIONS:
        raise _fail(where, f"a filter holds at most {MAX_CONDITIONS} conditions")
    if not isinstance(raw, Mapping):
        raise _fail(where, "a condition must be an object")
    if "key" not in raw:
        if set(raw) & {"must", "should", "must_not"}:
            return _filter(raw, where, depth + 1, counter, threshold)
        raise _fail(where, "a condition needs a `key` with `match` or `range`, or is a nested filter")
    key = raw["key"]
    if isinstance(key, str) and key.startswith(FACET_PREFIX):
        return _facet(key[len(FACET_PREFIX):], raw, where, threshold)
    if not isinstance(key, str) or not KEY_RE.match(key):
        raise _fail(f"{where}.key", f"invalid key {str(key)[:80]!r}: 1-64 letters, digits, '_' or '-'")
    ops = sorted(set(raw) - {"key"})
    if ops not in (["match"], ["range"]):
        raise _fail(where, f"expected exactly one of `match` or `range` beside `key`, got {ops or 'none'}"
                    + ("" if set(ops) <= {"match", "range"} else
                       f" (unknown operator(s) {', '.join(repr(o) for o in ops if o not in ('match', 'range'))})"))
    if ops == ["match"]:
        return _match(key, raw["match"], f"{where}.match")
    return _range(key, raw["range"], f"{where}.range")


def _facet(attribute: str, raw: Mapping[str, Any], where: str, default: float) -> Filter:
    """``facets.<attribute>``: the chosen value matches and its probability is at least the threshold."""
    if not ATTRIBUTE_RE.match(attribute):
        raise _fail(f"{where}.key", f"invalid facet attribute {attribute[:80]!r}: 1-48 letters, digits, '_' or '-'")
    extra = sorted(set(raw) - {"key", "match", "min_confidence"})
    if extra or "match" not in raw:
        raise _fail(where, "a facet condition is `key` with `match` and an optional `min_confidence`"
                    + (f" (unknown operator(s) {', '.join(map(repr, extra))})" if extra else ""))
    threshold = raw.get("min_confidence", default)
    if isinstance(threshold, bool) or not isinstance(threshold, int | float) or not 0 <= threshold <= 1:
        raise _fail(f"{where}.min_confidence", "min_confidence is a number in [0, 1]")
    match = _match(FACET_VALUE_KEY + attribute, raw["match"], f"{where}.match")
    return Filter(must=(match, Range(FACET_P_KEY + attribute, gte=float(threshold))))


def facet_payload(facets: Mapping[str, Any]) -> dict[str, Any]:
    """The payload keys of an image's computed facets (``{attr: {"value", "p", ...}}``): its chosen value
    and that value's probability per attribute, what ``facets.<attr>`` conditions read."""
    out: dict[str, Any] = {}
    for attribute, facet in facets.items():
        if isinstance(facet, Mapping) and "value" in facet:
            out[FACET_VALUE_KEY + attribute] = facet["value"]
            out[FACET_P_KEY + attribute] = float(facet["p"])
    return out


def _scalar(value: Any, where: str) -> Scalar:
    if isinstance(value, bool | str) or (isinstance(value, int) and not isinstance(value, bool)):
        if isinstance(value, str) and len(value) > 1024:
            raise _fail(where, "match strings are at most 1024 characters")
        return value
    raise _fail(where, f"match compares strings, integers or booleans, not {type(value).__name__}")


def _match(key: str, raw: Any, where: str) -> Match:
    if not isinstance(raw, Mapping) or len(raw) != 1 or next(iter(raw)) not in ("value", "any"):
        ops = sorted(raw) if isinstance(raw, Mapping) else []
        unknown = [o for o in ops if o not in ("value", "any")]
        hint = f" (unknown operator(s) {', '.join(map(repr, unknown))})" if unknown else ""
        raise _fail(where, "expected exactly one of {\"value\": v} or {\"any\": [v, ...]}" + hint)
    if "value" in raw:
        return Match(key, (_scalar(raw["value"], f"{where}.value"),), any=False)
    values = raw["any"]
    if not isinstance(values, list) or not 1 <= len(values) <= MAX_ANY:
        raise _fail(f"{where}.any", f"must be a list of 1..{MAX_ANY} values")
    return Match(key, tuple(_scalar(v, f"{where}.any[{i}]") for i, v in enumerate(values)), any=True)


def _range(key: str, raw: Any, where: str) -> Range:
    if not isinstance(raw, Mapping) or not raw:
        raise _fail(where, "expected an object with gt, gte, lt and/or lte")
    unknown = sorted(set(raw) - set(RANGE_OPS))
    if unknown:
        raise _fail(where, f"unknown operator(s) {', '.join(map(repr, unknown))}; use gt, gte, lt, lte")
    bounds: dict[str, float] = {}
    for op, value in raw.items():
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _fail(f"{where}.{op}", "range bounds are finite numbers")
        bounds[op] = float(value)
    return Range(key, **bounds)


# ------------------------------------------------------------------------------------------- evaluation
def _typed(value: Any) -> tuple[str, Scalar] | None:
    """A payload value as match compares it: by type, so 1 and true never meet."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, str):
        return ("s", value)
    return None


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    return float(value)


def _values(payload: Mapping[str, Any], key: str) -> list[Any]:
    value = payload.get(key)
    if value is None:
        return []
    return list(value) if isinstance(value, list) else [value]


def matches(f: Filter, payload: Mapping[str, Any]) -> bool:
    """One payload against a filter: the reference the column evaluation and the backends must agree with."""
    def holds(c: Condition) -> bool:
        if isinstance(c, Filter):
            return matches(c, payload)
        values = _values(payload, c.key)
        if isinstance(c, Match):
            wanted = {_typed(v) for v in c.values}
            return any(_typed(v) in wanted for v in values)
        return any((x := _number(v)) is not None and c.holds(x) for v in values)

    return (all(holds(c) for c in f.must) and not any(holds(c) for c in f.must_not)
            and (not f.should or any(holds(c) for c in f.should)))


class Columns:
    """A set's payloads by key, for evaluating a filter over every slot at once.

    A key holding at most one value per slot (the common case) is kept dense: an integer code per slot for
    ``match`` and a float per slot (NaN where absent) for ``range``, so a condition is one vectorised
    comparison over the set. A key holding lists keeps postings (slots per value) and (slot, number) pairs.
    Built once per set state (writes drop it).
    """

    def __init__(self, payloads: Sequence[Mapping[str, Any] | None]) -> None:
        self.size = len(payloads)
        postings: dict[str, dict[tuple[str, Scalar], list[int]]] = {}
        numbers: dict[str, tuple[list[int], list[float]]] = {}
        for slot, payload in enumerate(payloads):
            if not payload:
                continue
            for key, raw in payload.items():
                for value in raw if isinstance(raw, list) else [raw]:
                    typed = _typed(value)
                    if typed is not None:
                        postings.setdefault(key, {}).setdefault(typed, []).append(slot)
                    x = _number(value)
                    if x is not None:
                        slots, xs = numbers.setdefault(key, ([], []))
                        slots.append(slot)
                        xs.append(x)
        self._codes: dict[str, tuple[npt.NDArray[np.int32], dict[tuple[str, Scalar], int]]] = {}
        self._postings: dict[str, dict[tuple[str, Scalar], npt.NDArray[np.int64]]] = {}
        for key, by_value in postings.items():
            arrays = {v: np.asarray(s, dtype=np.int64) for v, s in by_value.items()}
            everything = np.concatenate(list(arrays.values()))
            if len(np.unique(everything)) == len(everything):  # one value per slot: dense codes
                codes = np.full(self.size, -1, dtype=np.int32)
                vocab = {}
                for code, (value, slots_of) in enumerate(arrays.items()):
                    codes[slots_of] = code
                    vocab[value] = code
                self._codes[key] = (codes, vocab)
            else:
                self._postings[key] = arrays
        self._dense: dict[str, npt.NDArray[np.float64]] = {}
        self._pairs: dict[str, tuple[npt.NDArray[np.int64], npt.NDArray[np.float64]]] = {}
        for key, (slot_list, x_list) in numbers.items():
            slots_arr, xs_arr = np.asarray(slot_list, dtype=np.int64), np.asarray(x_list, dtype=np.float64)
            if len(np.unique(slots_arr)) == len(slots_arr):
                dense = np.full(self.size, np.nan)
                dense[slots_arr] = xs_arr
                self._dense[key] = dense
            else:
                self._pairs[key] = (slots_arr, xs_arr)

    def mask(self, f: Filter) -> Mask:
        """Slots whose payload passes ``f`` (dead slots' payloads are None, so only a pure ``must_not``
        passes them: callers AND the result with the live mask)."""
        out = np.ones(self.size, dtype=bool)
        for c in f.must:
            out &= self._condition(c)
        for c in f.must_not:
            out &= ~self._condition(c)
        if f.should:
            any_of = np.zeros(self.size, dtype=bool)
            for c in f.should:
                any_of |= self._condition(c)
            out &= any_of
        return out

    def _condition(self, c: Condition) -> Mask:
        if isinstance(c, Filter):
            return self.mask(c)
        if isinstance(c, Match):
            wanted = [_typed(v) for v in c.values]
            if c.key in self._codes:
                codes, vocab = self._codes[c.key]
                known = [vocab[w] for w in wanted if w in vocab]
                if len(known) == 1:
                    return codes == known[0]
                return np.isin(codes, known) if known else np.zeros(self.size, dtype=bool)
            out = np.zeros(self.size, dtype=bool)
            for w in wanted:
                slots = self._postings.get(c.key, {}).get(w)  # type: ignore[arg-type]
                if slots is not None:
                    out[slots] = True
            return out
        if c.key in self._dense:
            return self._in_range(c, self._dense[c.key])  # NaN (absent) fails every comparison
        slots, xs = self._pairs.get(c.key, (np.zeros(0, np.int64), np.zeros(0)))
        out = np.zeros(self.size, dtype=bool)
        out[slots[self._in_range(c, xs)]] = True
        return out

    @staticmethod
    def _in_range(c: Range, xs: npt.NDArray[np.float64]) -> Mask:
        keep: Mask | None = None
        for op, bound in (("gt", c.gt), ("gte", c.gte), ("lt", c.lt), ("lte", c.lte)):
            if bound is None:
                continue
            hit = {"gt": np.greater, "gte": np.greater_equal, "lt": np.less, "lte": np.less_equal}[op](xs, bound)
            keep = hit if keep is None else keep & hit
        assert keep is not None  # a Range has at least one bound
        return keep
