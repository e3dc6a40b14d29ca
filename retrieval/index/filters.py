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

The FAISS plug-in's :class:`~retrieval.index.faiss_accel.payload_index.PayloadIndex` evaluates a filter for a whole
set at once (a slot mask composed from an inverted index), which is what lets its CPU and device searches apply it as
an id selector or a mask instead of trimming a top-k; the reference FAISS index applies :func:`matches` row by row.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index.values import int_problem, text_problem

KEY_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,63}\Z")
MAX_CONDITIONS = 64
MAX_DEPTH = 4
MAX_ANY = 256
RANGE_OPS = ("gt", "gte", "lt", "lte")
FACET_PREFIX = "facets."
FACET_VALUE_KEY = "_facet_"  # payload keys user metadata may not use (indexer/catalog/metadata.py)
FACET_P_KEY = "_facetp_"
FACET_MIN_CONFIDENCE = 0.5
ATTRIBUTE_RE = re.compile(r"^[A-Za-z_][A-Za-z0-9_-]{0,47}\Z")  # leaves room for the payload key's prefix
Scalar = str | int | bool


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
        problem = text_problem(value) if isinstance(value, str) else (
            None if isinstance(value, bool) else int_problem(value))
        if problem is not None:
            raise _fail(where, problem)
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
        if isinstance(value, int) and not isinstance(value, bool) and (problem := int_problem(value)) is not None:
            raise _fail(f"{where}.{op}", problem)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            raise _fail(f"{where}.{op}", "range bounds are finite numbers")
        bounds[op] = float(value)
    return Range(key, **bounds)


# ------------------------------------------------------------------------------------------- evaluation
def typed_value(value: Any) -> tuple[str, Scalar] | None:
    """A payload value as match compares it: by type, so 1 and true never meet."""
    if isinstance(value, bool):
        return ("b", value)
    if isinstance(value, int):
        return ("i", value)
    if isinstance(value, str):
        return ("s", value)
    return None


def number_value(value: Any) -> float | None:
    """A payload value as range compares it; an integer beyond int64 (stored by an older version) is none."""
    if isinstance(value, bool) or not isinstance(value, int | float) or (
            isinstance(value, int) and int_problem(value) is not None):
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
            wanted = {typed_value(v) for v in c.values}
            return any(typed_value(v) in wanted for v in values)
        return any((x := number_value(v)) is not None and c.holds(x) for v in values)

    return (all(holds(c) for c in f.must) and not any(holds(c) for c in f.must_not)
            and (not f.should or any(holds(c) for c in f.should)))
