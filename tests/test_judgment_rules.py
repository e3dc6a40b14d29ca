"""Judgments derived from a metadata field (SQLite and, when configured, PostgreSQL): the statements' wording (a
facet attribute's, or "The <key> is <value>", or the caller's), yes for the image's value and no for the others,
hand-made judgments kept, and unknown fields refused with nothing written."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import Catalog, ImageRecord, JudgmentSource, JudgmentSpec, SetRecord
from rubricsearch.indexer.catalog.facets import MAX_VALUES, put_schema
from rubricsearch.indexer.catalog.judgment_rules import derive, record_derivation
from rubricsearch.retrieval.errors import InvalidInput, NotFound

BREEDS: list[Any] = ["tabby", "siamese", "tabby", ["siamese", "tabby"], None, "sphynx"]


@pytest.fixture
def images(catalog: Catalog, reference_set: SetRecord) -> list[ImageRecord]:
    """One image per entry of BREEDS (None: no `breed` field), each also holding an unrelated `shelf`."""
    with catalog.write() as s:
        out = []
        for n, breed in enumerate(BREEDS):
            meta = {"shelf": n} if breed is None else {"breed": breed, "shelf": n}
            sha = hashlib.sha256(f"cat-{n}".encode()).hexdigest()
            out.append(cat.add_image(s, reference_set.id, sha256=sha, byte_size=1, source="upload", meta=meta)[0])
        return out


def _table(judgments: list[JudgmentSpec] | list[cat.JudgmentRecord]) -> dict[tuple[int, str], bool]:
    return {(j.image_id, j.criterion): j.holds for j in judgments}


def test_metadata_values_give_yes_for_their_own_statement_and_no_for_the_others(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]
) -> None:
    with catalog.read() as s:
        found = derive(s, reference_set.id, "breed", statements={"sphynx": "  A hairless cat "})
    assert [(st.value, st.statement) for st in found.statements] == [
        ("tabby", "The breed is tabby"), ("siamese", "The breed is siamese"), ("sphynx", "A hairless cat")]
    table = _table(found.judgments)
    tabby, siamese, both, sphynx = images[0].id, images[1].id, images[3].id, images[5].id
    assert table[(tabby, "The breed is tabby")] and not table[(tabby, "The breed is siamese")]
    assert not table[(tabby, "A hairless cat")] and table[(sphynx, "A hairless cat")]
    assert table[(siamese, "The breed is siamese")] and not table[(siamese, "The breed is tabby")]
    assert table[(both, "The breed is siamese")] and table[(both, "The breed is tabby")]  # a list holds each
    assert not any(image_id == images[4].id for image_id, _ in table)  # no breed field: nothing derived
    assert len(table) == 5 * 3 and found.images == 5 and found.skipped_images == 0
    assert {(st.value, st.yes, st.no) for st in found.statements} == {("tabby", 3, 2), ("siamese", 2, 3),
                                                                       ("sphynx", 1, 4)}
    assert all(j.source is JudgmentSource.DERIVED for j in found.judgments)
    with catalog.read() as s:
        assert cat.list_judgments(s, reference_set.id) == []  # deriving alone writes nothing
    with catalog.write() as s:
        written = record_derivation(s, reference_set.id, found)
    assert _table(written) == table
    with catalog.read() as s:
        assert _table(cat.list_judgments(s, reference_set.id)) == table


def test_a_facet_attribute_gives_the_values_and_their_wording(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]
) -> None:
    with catalog.write() as s:
        put_schema(s, reference_set.id, {"attributes": [{"name": "breed", "values": [
            {"value": "tabby", "description": "The coat has tabby stripes"}, "siamese", "persian"]}]})
        found = derive(s, reference_set.id, "breed")
    assert [st.statement for st in found.statements] == [
        "The coat has tabby stripes", "The breed is siamese", "The breed is persian"]
    assert found.skipped_images == 1  # the sphynx is none of the attribute's values
    assert _table(found.judgments)[(images[1].id, "The breed is persian")] is False


def test_judgments_by_hand_are_kept_unless_overwritten(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]
) -> None:
    mine = JudgmentSpec(images[0].id, "The breed is tabby", False, JudgmentSource.PERSON, "ana")
    with catalog.write() as s:
        cat.record_judgment(s, reference_set.id, mine)
        found = derive(s, reference_set.id, "breed")
        record_derivation(s, reference_set.id, found)
    assert found.kept == 1
    with catalog.read() as s:
        assert _table(cat.list_judgments(s, reference_set.id))[(images[0].id, "The breed is tabby")] is False
    with catalog.write() as s:
        record_derivation(s, reference_set.id, derive(s, reference_set.id, "breed", overwrite=True))
    with catalog.read() as s:
        assert _table(cat.list_judgments(s, reference_set.id))[(images[0].id, "The breed is tabby")] is True


@pytest.mark.parametrize(("key", "statements"), [
    ("colour", None),  # no image holds it, no attribute names it
    ("bad key!", None),
    ("breed", {"persian": "A persian"}),  # a value the field does not have
    ("breed", {"tabby": "The breed is siamese"}),  # two values worded the same
    ("breed", {"tabby": "x" * 501}),
])
def test_bad_rules_are_refused(catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord], key: str,
                               statements: dict[str, str] | None) -> None:
    with pytest.raises(InvalidInput), catalog.write() as s:
        derive(s, reference_set.id, key, statements=statements)
    with pytest.raises(NotFound), catalog.read() as s:
        derive(s, "no-such-set", "breed")


def test_a_field_of_more_distinct_values_than_an_attribute_may_have_is_refused(
    catalog: Catalog, reference_set: SetRecord
) -> None:
    def add(n: int) -> None:
        sha = hashlib.sha256(f"code-{n}".encode()).hexdigest()
        cat.add_image(s, reference_set.id, sha256=sha, byte_size=1, source="upload", meta={"code": n})

    with catalog.write() as s:
        for n in range(MAX_VALUES):
            add(n)
        assert len(derive(s, reference_set.id, "code").statements) == MAX_VALUES
        add(MAX_VALUES)
        with pytest.raises(InvalidInput, match="distinct values"):
            derive(s, reference_set.id, "code")
