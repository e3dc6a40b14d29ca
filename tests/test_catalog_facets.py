"""Facets in the catalog on SQLite and PostgreSQL: the schema's versions and bounds, which images are stale,
writes that keep user metadata and unchanged attributes, counts at a threshold, and the facet payload keys
that user metadata may not take."""

from __future__ import annotations

import pytest

from rubricsearch.indexer.catalog import Catalog, ImageRecord, ImageSource, ImageStatus, add_image, create_set
from rubricsearch.indexer.catalog.facets import (
    check_schema,
    count_facets,
    get_schema,
    put_schema,
    stale_attributes,
    stale_images,
    write_facets,
)
from rubricsearch.indexer.catalog.metadata import check_metadata
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index.filters import matches, parse_filter

SHAS = [f"{i:064x}" for i in range(1, 5)]
SCHEMA = {"attributes": [{"name": "ear_shape", "values": ["round", "folded"]},
                         {"name": "fur", "values": ["short", {"value": "long", "description": "Long fur"}]}]}


def facet(attr: dict[str, object], value: str, p: float, digest: str) -> dict[str, object]:
    values = [v if isinstance(v, str) else v["value"] for v in attr["values"]]  # type: ignore[union-attr]
    rest = (1 - p) / (len(values) - 1)
    return {"value": value, "p": p, "probs": {v: (p if v == value else rest) for v in values}, "digest": digest}


def test_schema_versions_stale_writes_and_counts(catalog: Catalog) -> None:
    with catalog.write() as s:
        set_id = create_set(s, "cats").id
        for i, sha in enumerate(SHAS):
            add_image(s, set_id, sha256=sha, byte_size=1, source=ImageSource.ZIP, meta={"label": f"L{i}"},
                      status=ImageStatus.INDEXED if i < 3 else ImageStatus.PENDING)
        assert get_schema(s, set_id).version == 0 and stale_images(s, set_id) == []
        schema = put_schema(s, set_id, SCHEMA)
        assert schema.version == 1 and put_schema(s, set_id, SCHEMA).version == 1  # unchanged: same version
    with catalog.write() as s:
        assert get_schema(s, set_id) == schema
        assert stale_images(s, set_id) == SHAS[:3]  # indexed images only
        ear, fur = schema.attributes
        for sha, (value, p) in zip(SHAS[:2], [("round", 0.9), ("folded", 0.6)], strict=True):
            write_facets(s, set_id, sha, schema, {"ear_shape": facet(SCHEMA["attributes"][0], value, p, ear.digest),
                                                  "fur": facet(SCHEMA["attributes"][1], "short", 0.7, fur.digest)})
        assert stale_images(s, set_id) == SHAS[2:3]
        images, counts = count_facets(s, set_id, 0.5)
        assert images == 2 and counts == {"ear_shape": {"round": 1, "folded": 1}, "fur": {"short": 2, "long": 0}}
        assert count_facets(s, set_id, 0.8)[1]["ear_shape"] == {"round": 1, "folded": 0}

        # a change to one attribute makes only that attribute stale; a dropped attribute goes at the next write
        changed = put_schema(s, set_id, {"attributes": [SCHEMA["attributes"][0],
                                                        {"name": "tail", "values": ["long", "short"]}]})
        assert changed.version == 2
        row = write_facets(s, set_id, SHAS[0], changed, {})
        assert row is not None
        record = ImageRecord.of(row)
        assert [a.name for a in stale_attributes(changed, record.facets)] == ["tail"]
        assert set(record.facets) == {"ear_shape", "_schema_version"} and record.meta == {"label": "L0"}
        assert write_facets(s, set_id, "f" * 64, changed, {}) is None  # gone: nothing written

    # the payload the index holds: metadata beside the facets' keys, and filters read it
    payload = record.payload
    assert payload["label"] == "L0" and payload["_facet_ear_shape"] == "round"
    flt = parse_filter({"must": [{"key": "facets.ear_shape", "match": {"value": "round"}}]})
    assert flt is not None and matches(flt, payload)
    strict = parse_filter({"must": [{"key": "facets.ear_shape", "match": {"value": "round"}, "min_confidence": 0.95}]})
    assert strict is not None and not matches(strict, payload)


def test_bounds_and_reserved_keys() -> None:
    with pytest.raises(InvalidMetadata, match="at most 32 attributes"):
        check_schema({"attributes": [{"name": f"a{i}", "values": ["x", "y"]} for i in range(33)]})
    with pytest.raises(InvalidMetadata, match=r"attributes\[0\].values\[1\].description"):
        check_schema({"attributes": [{"name": "a", "values": ["x", {"value": "y", "description": "d" * 201}]}]})
    with pytest.raises(InvalidMetadata, match="computed facets"):
        check_metadata({"_facet_ear_shape": "round"})
