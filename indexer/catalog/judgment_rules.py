"""Judgments derived from what the catalog already knows: a metadata field whose values are mutually exclusive
(``breed: tabby``) says, for each of its values, whether that value's statement holds for an image: "yes" for the
image's own value, "no" for every other.

The statements are worded as a facet attribute's are (:meth:`Attribute.statements`: the value's description, or
"The <attribute> is <value>"). When the set's facet schema has an attribute of that name, its values and
descriptions are used; otherwise the values are those the set's images hold. Either way the caller may reword any
value's statement. The image's value always comes from its metadata, never from computed facets (those are the
model's answers, which judgments exist to check).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.facets import MAX_VALUES, Attribute, get_schema
from rubricsearch.indexer.catalog.judgments import (
    MAX_PER_SET,
    JudgmentRecord,
    JudgmentSpec,
    clean_criterion,
    list_judgments,
    record_judgments,
)
from rubricsearch.indexer.catalog.metadata import iter_metadata
from rubricsearch.indexer.catalog.tables import JudgmentSource
from rubricsearch.retrieval.errors import InvalidInput, PayloadTooLarge
from rubricsearch.retrieval.index.filters import KEY_RE


@dataclass(frozen=True, slots=True)
class Statement:
    value: str
    statement: str
    yes: int  # images the derivation judges "holds" for this statement
    no: int


@dataclass(frozen=True, slots=True)
class Derivation:
    """What a rule derives: each value's statement with its counts, and the judgments (specs until written)."""

    key: str
    statements: list[Statement]
    judgments: list[JudgmentSpec]
    images: int  # images holding one of the values
    skipped_images: int  # images whose value is not one of the values (no judgment derived for them)
    kept: int  # cells a person or an API client judged, left as they are


def value_text(value: Any) -> str:
    """How a metadata value is named in a derivation (strings as they are, other JSON values as JSON)."""
    return value if isinstance(value, str) else json.dumps(value)


def _image_values(meta: Mapping[str, Any], key: str) -> set[str] | None:
    if key not in meta:
        return None
    raw = meta[key]
    return {value_text(v) for v in (raw if isinstance(raw, list) else [raw])}


def derive(session: Session, set_id: str, key: str, *, statements: Mapping[str, str] | None = None,
           author: str | None = None, overwrite: bool = False) -> Derivation:
    """The judgments metadata field ``key`` implies for the set's images (nothing is written).

    Raises :class:`InvalidInput` for a key no image holds (and no facet attribute names), a reworded value the
    field does not have, or more distinct values than an attribute may have."""
    if not isinstance(key, str) or not KEY_RE.fullmatch(key):
        raise InvalidInput("key must be a metadata key (letters, digits, '_' or '-', starting with a letter or '_')",
                           key=str(key)[:80])
    schema = get_schema(session, set_id)  # NotFound for an unknown set
    held: list[tuple[int, set[str]]] = []
    seen: dict[str, None] = {}
    for image in iter_metadata(session, set_id):
        values = _image_values(image.meta, key)
        if values is not None:
            held.append((image.id, values))
            seen.update(dict.fromkeys(sorted(values)))
    attribute = next((a for a in schema.attributes if a.name == key), None)
    if attribute is None:
        if not held:
            raise InvalidInput(f"no image of this set has metadata field {key!r} and no facet attribute is named "
                               "so", key=key)
        if len(seen) > MAX_VALUES:
            raise InvalidInput(f"field {key!r} holds {len(seen)} distinct values; a derivation takes at most "
                               f"{MAX_VALUES} (mutually exclusive values, as a facet attribute's)", key=key)
        attribute = Attribute(key, tuple(seen), (None,) * len(seen))
    wording = dict(zip(attribute.values, attribute.statements(), strict=True))
    unknown = sorted(set(statements or {}) - set(wording))
    if unknown:
        raise InvalidInput(f"statements reword values field {key!r} does not have", key=key, values=unknown[:20])
    wording = {value: clean_criterion(text) for value, text in {**wording, **(statements or {})}.items()}
    if len(set(wording.values())) < len(wording):
        raise InvalidInput("two values have the same statement; word each differently", key=key)
    judged_by_hand = set() if overwrite else {
        (j.image_id, j.criterion) for j in list_judgments(session, set_id)
        if j.source is not JudgmentSource.DERIVED}
    specs: list[JudgmentSpec] = []
    counts = {value: [0, 0] for value in wording}
    images = skipped = kept = 0
    for image_id, values in held:
        if not values & set(wording):
            skipped += 1
            continue
        images += 1
        for value, statement in wording.items():
            if (image_id, statement) in judged_by_hand:
                kept += 1
                continue
            holds = value in values
            counts[value][0 if holds else 1] += 1
            specs.append(JudgmentSpec(image_id, statement, holds, JudgmentSource.DERIVED, author))
    if len(specs) > MAX_PER_SET:
        raise PayloadTooLarge(f"the derivation gives {len(specs)} judgments; a set holds at most {MAX_PER_SET}",
                              key=key, limit=MAX_PER_SET)
    return Derivation(key=key, statements=[Statement(v, s, *counts[v]) for v, s in wording.items()],
                      judgments=specs, images=images, skipped_images=skipped, kept=kept)


def record_derivation(session: Session, set_id: str, derivation: Derivation) -> list[JudgmentRecord]:
    """Write a derivation's judgments in the caller's transaction: all of them or (on any error) none. A
    derivation is bounded by the set's bound, not by a request's: it is computed here, not sent."""
    return record_judgments(session, set_id, derivation.judgments, max_items=MAX_PER_SET)
