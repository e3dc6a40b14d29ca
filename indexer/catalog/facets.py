"""Attribute facets: a set's attribute schema, and each image's computed values beside (never in) its metadata.

A schema is a list of attributes, each with its allowed values and optional descriptions (what the model is
asked about a value instead of "The <attribute> is <value>"). It lives in the set's settings under
``facet_schema`` with a version that grows on every change; each attribute carries a digest of its name,
values and descriptions, so a schema change recomputes only the attributes whose digest changed.

An image's ``facets`` column holds ``{attr: {"value", "p", "probs": {value: p}, "digest"}}`` plus
``"_schema_version"``: the chosen value, its probability, the probability of every value, and which version
of the attribute produced them. It is written only by the facet job (indexer/jobs/facets.py).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.sets import set_row
from rubricsearch.indexer.catalog.tables import Image, ImageStatus
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index.filters import ATTRIBUTE_RE
from rubricsearch.retrieval.index.values import text_problem

MAX_ATTRIBUTES = 32
MAX_VALUES = 32
MAX_TEXT = 200
FACETS = "facets"  # the facet job's kind (ingestion workers leave its items alone)
SCHEMA_KEY = "facet_schema"
VERSION_KEY = "_schema_version"
_PAGE = 1000


@dataclass(frozen=True)
class Attribute:
    name: str
    values: tuple[str, ...]
    descriptions: tuple[str | None, ...]

    @property
    def digest(self) -> str:
        body = json.dumps([self.name, self.values, self.descriptions], separators=(",", ":"))
        return hashlib.sha256(body.encode()).hexdigest()[:16]

    def statements(self) -> list[str]:
        """What the reranker judges per value: its description, or "The <attribute> is <value>"."""
        label = self.name.replace("_", " ")
        return [d or f"The {label} is {v}" for v, d in zip(self.values, self.descriptions, strict=True)]

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "values": [{"value": v, "description": d}
                                              for v, d in zip(self.values, self.descriptions, strict=True)]}


@dataclass(frozen=True)
class FacetSchema:
    version: int
    attributes: tuple[Attribute, ...]

    def to_json(self) -> dict[str, Any]:
        return {"version": self.version, "attributes": [a.to_json() for a in self.attributes]}


def _text(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value.strip() or len(value) > MAX_TEXT:
        raise InvalidMetadata(f"{where}: a non-empty string of at most {MAX_TEXT} characters", location=where)
    if (problem := text_problem(value)) is not None:
        raise InvalidMetadata(f"{where}: {problem}", location=where)
    return value.strip()


def check_schema(raw: Any, version: int = 0) -> FacetSchema:
    """An attribute schema within its bounds; :class:`InvalidMetadata` names what is over or malformed."""
    attrs = raw.get("attributes") if isinstance(raw, Mapping) else None
    if not isinstance(attrs, list):
        raise InvalidMetadata("schema: an object with a list of `attributes`", location="schema")
    if len(attrs) > MAX_ATTRIBUTES:
        raise InvalidMetadata(f"schema.attributes: at most {MAX_ATTRIBUTES} attributes, got {len(attrs)}",
                              location="schema.attributes")
    out: list[Attribute] = []
    for i, attr in enumerate(attrs):
        where = f"schema.attributes[{i}]"
        if not isinstance(attr, Mapping) or set(attr) - {"name", "values"}:
            raise InvalidMetadata(f"{where}: an object with `name` and `values`", location=where)
        name = attr.get("name")
        if not isinstance(name, str) or not ATTRIBUTE_RE.match(name):
            raise InvalidMetadata(f"{where}.name: 1-48 letters, digits, '_' or '-', starting with a letter or '_'",
                                  location=f"{where}.name")
        if any(a.name == name for a in out):
            raise InvalidMetadata(f"{where}.name: attribute {name!r} is named twice", location=f"{where}.name")
        values = attr.get("values")
        if not isinstance(values, list) or not 2 <= len(values) <= MAX_VALUES:
            raise InvalidMetadata(f"{where}.values: {name!r} needs 2..{MAX_VALUES} values, got "
                                  f"{len(values) if isinstance(values, list) else 'none'}", location=f"{where}.values")
        names: list[str] = []
        descriptions: list[str | None] = []
        for j, value in enumerate(values):
            here = f"{where}.values[{j}]"
            if isinstance(value, str):
                value = {"value": value}
            if not isinstance(value, Mapping) or set(value) - {"value", "description"}:
                raise InvalidMetadata(f"{here}: a string, or an object with `value` and an optional `description`",
                                      location=here)
            v = _text(value.get("value"), f"{here}.value")
            if v in names:
                raise InvalidMetadata(f"{here}.value: {v!r} is listed twice", location=f"{here}.value")
            d = value.get("description")
            names.append(v)
            descriptions.append(None if d is None else _text(d, f"{here}.description"))
        out.append(Attribute(name, tuple(names), tuple(descriptions)))
    return FacetSchema(version, tuple(out))


def get_schema(session: Session, set_id: str) -> FacetSchema:
    """The set's schema (version 0 and no attributes when none was ever given)."""
    stored = dict(set_row(session, set_id).settings or {}).get(SCHEMA_KEY)
    if not stored:
        return FacetSchema(0, ())
    return check_schema(stored, int(stored["version"]))


def put_schema(session: Session, set_id: str, raw: Any) -> FacetSchema:
    """Replace the schema; the version grows only when something changed."""
    row = set_row(session, set_id)
    old = get_schema(session, set_id)
    new = check_schema(raw, old.version)
    if new.attributes != old.attributes:
        new = FacetSchema(old.version + 1, new.attributes)
        row.settings = {**dict(row.settings or {}), SCHEMA_KEY: new.to_json()}
        session.flush()
    return new


def stale_attributes(schema: FacetSchema, facets: Mapping[str, Any]) -> list[Attribute]:
    """The schema's attributes an image's facets lack or hold from an older version of the attribute."""
    return [a for a in schema.attributes
            if not isinstance(facets.get(a.name), Mapping) or facets[a.name].get("digest") != a.digest]


def stale_images(session: Session, set_id: str) -> list[str]:
    """sha256s of the set's indexed images whose facets are out of date with its schema."""
    schema = get_schema(session, set_id)
    names = {a.name for a in schema.attributes}
    out: list[str] = []
    after = 0
    while True:
        rows = session.execute(select(Image.id, Image.sha256, Image.facets).where(
            Image.set_id == set_id, Image.status == ImageStatus.INDEXED.value, Image.id > after)
            .order_by(Image.id).limit(_PAGE)).all()
        if not rows:
            return out
        for image_id, sha, facets in rows:
            after = image_id
            facets = dict(facets or {})
            if stale_attributes(schema, facets) or set(facets) - names - {VERSION_KEY}:
                out.append(sha)


def write_facets(session: Session, set_id: str, sha256: str, schema: FacetSchema,
                 computed: Mapping[str, Mapping[str, Any]]) -> Image | None:
    """Store an image's newly computed attributes, keep its current ones, drop those the schema no longer has.
    ``None`` when the image is gone (deleted meanwhile)."""
    row = session.scalar(select(Image).where(Image.set_id == set_id, Image.sha256 == sha256))
    if row is None:
        return None
    names = {a.name for a in schema.attributes}
    facets = {k: v for k, v in dict(row.facets or {}).items() if k in names}
    facets.update({k: dict(v) for k, v in computed.items()})
    facets[VERSION_KEY] = schema.version
    row.facets = facets
    session.flush()
    return row


def count_facets(session: Session, set_id: str, min_confidence: float) -> tuple[int, dict[str, dict[str, int]]]:
    """Images of the set per attribute and chosen value at ``min_confidence`` or above, and the number of
    images with facets: the counts the Compare page offers to click."""
    schema = get_schema(session, set_id)
    counts: dict[str, Counter[str]] = {a.name: Counter() for a in schema.attributes}
    images = 0
    after = 0
    while True:
        rows: Sequence[Any] = session.execute(select(Image.id, Image.facets).where(
            Image.set_id == set_id, Image.id > after).order_by(Image.id).limit(_PAGE)).all()
        if not rows:
            break
        for image_id, facets in rows:
            after = image_id
            images += bool(facets)
            for name, counter in counts.items():
                facet = (facets or {}).get(name)
                if isinstance(facet, Mapping) and float(facet.get("p", 0.0)) >= min_confidence:
                    counter[str(facet["value"])] += 1
    return images, {a.name: {v: counts[a.name][v] for v in a.values} for a in schema.attributes}
