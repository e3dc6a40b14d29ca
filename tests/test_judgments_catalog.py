"""Judgments in the catalog (SQLite and, when configured, PostgreSQL): recording by cell, all-or-nothing batches,
bounds, listing, deleting, and the cascade when a reference or a set goes."""

from __future__ import annotations

import hashlib
from datetime import UTC

import pytest
from sqlalchemy import func, select

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import Catalog, ImageRecord, JudgmentFilter, JudgmentSource, JudgmentSpec, SetRecord
from rubricsearch.indexer.catalog import judgments as store
from rubricsearch.indexer.catalog.tables import Judgment
from rubricsearch.retrieval.errors import InvalidInput, NotFound, PayloadTooLarge


def _image(s, set_id: str, n: int) -> ImageRecord:
    sha = hashlib.sha256(f"{set_id}-{n}".encode()).hexdigest()
    return cat.add_image(s, set_id, sha256=sha, byte_size=10, source="upload")[0]


@pytest.fixture
def images(catalog: Catalog, reference_set: SetRecord) -> list[ImageRecord]:
    with catalog.write() as s:
        return [_image(s, reference_set.id, n) for n in range(3)]


def _rows(catalog: Catalog) -> int:
    with catalog.read() as s:
        return int(s.scalar(select(func.count(Judgment.id))) or 0)


def test_a_cell_holds_one_judgment_and_the_later_replaces_it(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]
) -> None:
    a = images[0]
    with catalog.write() as s:
        first = cat.record_judgment(s, reference_set.id, JudgmentSpec(a.id, "  has a red stripe ", True,
                                                                       JudgmentSource.PERSON, "ana"))
    assert first.criterion == "has a red stripe" and first.holds and first.created_at.tzinfo is UTC
    with catalog.write() as s:  # the same answer again changes nothing (a re-import is a no-op)
        again = cat.record_judgment(s, reference_set.id, JudgmentSpec(a.id, "has a red stripe", True,
                                                                       JudgmentSource.PERSON, "ana"))
    assert again == first
    with catalog.write() as s:
        later = cat.record_judgment(s, reference_set.id, JudgmentSpec(a.id, "has a red stripe", False,
                                                                       JudgmentSource.PERSON, "bo"))
    assert later.id > first.id and later.holds is False and later.author == "bo"
    with catalog.read() as s:
        assert cat.list_judgments(s, reference_set.id) == [later]
        # what an earlier calibration (fitted at first.id) saw no longer exists whole: the count says so
        assert cat.list_judgments(s, reference_set.id, JudgmentFilter(until_id=first.id)) == []


def test_batch_is_all_or_nothing(catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]) -> None:
    good = [JudgmentSpec(img.id, "smiles", n % 2 == 0) for n, img in enumerate(images)]
    with catalog.write() as s:
        other = cat.create_set(s, "elsewhere")
        foreign = _image(s, other.id, 0)
    bad_batches = [
        ([*good, JudgmentSpec(999_999, "smiles", True)], NotFound),
        ([*good, JudgmentSpec(foreign.id, "smiles", True)], NotFound),  # a reference of another set
        ([*good, JudgmentSpec(images[0].id, "   ", True)], InvalidInput),
        ([*good, JudgmentSpec(images[0].id, "x" * 501, True)], InvalidInput),
        ([*good, JudgmentSpec(images[0].id, "a\x00b", True)], InvalidInput),
        ([*good, JudgmentSpec(images[0].id, "a\ud800", True)], InvalidInput),  # not storable as UTF-8
        ([*good, JudgmentSpec(images[0].id, "ok", True, JudgmentSource.API, "\udfff")], InvalidInput),
        ([*good, JudgmentSpec(images[0].id, "ok", "yes")], InvalidInput),  # type: ignore[arg-type]
        ([*good, JudgmentSpec(images[0].id, "ok", True, "oracle")], InvalidInput),  # type: ignore[arg-type]
    ]
    for batch, error in bad_batches:
        with pytest.raises(error), catalog.write() as s:
            cat.record_judgments(s, reference_set.id, batch)
        assert _rows(catalog) == 0
    with pytest.raises(NotFound), catalog.write() as s:
        cat.record_judgments(s, "no-such-set", good)
    with catalog.write() as s:
        written = cat.record_judgments(s, reference_set.id, [*good, JudgmentSpec(images[0].id, "smiles", False)])
    assert [j.image_id for j in written] == [img.id for img in images]
    assert written[0].holds is False  # a cell given twice takes its last judgment
    assert _rows(catalog) == 3
    with catalog.write() as s:
        assert cat.record_judgment(s, reference_set.id, JudgmentSpec(images[0].id, "x" * 500, True)).criterion


def test_batches_and_sets_are_bounded(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    too_many = [JudgmentSpec(images[0].id, f"c{n}", True) for n in range(store.MAX_BATCH + 1)]
    with pytest.raises(PayloadTooLarge), catalog.write() as s:
        cat.record_judgments(s, reference_set.id, too_many)
    assert _rows(catalog) == 0
    monkeypatch.setattr(store, "MAX_PER_SET", 4)
    with catalog.write() as s:
        cat.record_judgments(s, reference_set.id, [JudgmentSpec(images[0].id, f"c{n}", True) for n in range(3)])
    with pytest.raises(PayloadTooLarge), catalog.write() as s:
        cat.record_judgments(s, reference_set.id, [JudgmentSpec(images[1].id, f"c{n}", True) for n in range(2)])
    with catalog.write() as s:  # replacing judged cells does not grow the set
        cat.record_judgments(s, reference_set.id, [JudgmentSpec(images[0].id, f"c{n}", False) for n in range(3)])
        cat.record_judgment(s, reference_set.id, JudgmentSpec(images[1].id, "c0", True))
    assert _rows(catalog) == 4


def test_listing_filters_pages_and_deletes(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]
) -> None:
    specs = [JudgmentSpec(img.id, crit, (n + k) % 2 == 0, source)
             for n, img in enumerate(images) for k, (crit, source) in
             enumerate([("smiles", JudgmentSource.PERSON), ("wears glasses", JudgmentSource.DERIVED)])]
    with catalog.write() as s:
        written = cat.record_judgments(s, reference_set.id, specs)
    with catalog.read() as s:
        assert [j.id for j in cat.list_judgments(s, reference_set.id)] == sorted(j.id for j in written)
        assert {j.criterion for j in cat.list_judgments(s, reference_set.id, JudgmentFilter(criterion=" smiles"))} \
            == {"smiles"}
        assert len(cat.list_judgments(s, reference_set.id, JudgmentFilter(image_id=images[1].id))) == 2
        assert {j.source for j in cat.list_judgments(s, reference_set.id,
                                                     JudgmentFilter(source=JudgmentSource.DERIVED))} \
            == {JudgmentSource.DERIVED}
        pages, after = [], None
        while True:
            page = cat.page_judgments(s, reference_set.id, limit=4, after_id=after)
            pages.append(page.items)
            after = page.next_after
            if after is None:
                break
        assert [len(p) for p in pages] == [4, 2] and page.total == 6
        assert [j for p in pages for j in p] == cat.list_judgments(s, reference_set.id)
        assert cat.judgments_of(s, reference_set.id, [images[0].id, 999], ["smiles", "wears glasses"]) == {
            images[0].id: {"smiles": True, "wears glasses": False}}
        assert cat.judgments_of(s, reference_set.id, [images[0].id], ["wears glasses", "tall"]) == {
            images[0].id: {"wears glasses": False}}
        # a search's criterion that cannot be a judgment's (PostgreSQL refuses NUL in a query) finds none
        assert cat.judgments_of(s, reference_set.id, [images[0].id], ["a\x00b", "\ud800", " smiles"]) == {}
        with pytest.raises(InvalidInput):
            cat.page_judgments(s, reference_set.id, limit=0)
    with catalog.write() as s:
        gone = cat.delete_judgment(s, reference_set.id, written[0].id)
        assert gone == written[0]
        with pytest.raises(NotFound):
            cat.delete_judgment(s, reference_set.id, written[0].id)
        assert cat.delete_judgments(s, reference_set.id, JudgmentFilter(criterion="wears glasses")) == 3
    with catalog.read() as s:
        assert [j.criterion for j in cat.list_judgments(s, reference_set.id)] == ["smiles", "smiles"]
    with catalog.write() as s:
        assert cat.delete_judgments(s, reference_set.id) == 2
    assert _rows(catalog) == 0


def test_deleting_a_reference_or_a_set_deletes_its_judgments(
    catalog: Catalog, reference_set: SetRecord, images: list[ImageRecord]
) -> None:
    with catalog.write() as s:
        other = cat.create_set(s, "other")
        kept = _image(s, other.id, 0)
        cat.record_judgments(s, reference_set.id, [JudgmentSpec(img.id, "smiles", True) for img in images])
        cat.record_judgment(s, other.id, JudgmentSpec(kept.id, "smiles", False))
    with catalog.write() as s:
        cat.delete_image(s, images[0].id)
    with catalog.read() as s:
        assert {j.image_id for j in cat.list_judgments(s, reference_set.id)} == {images[1].id, images[2].id}
    assert _rows(catalog) == 3
    with catalog.write() as s:
        cat.delete_set(s, reference_set.id)
    with catalog.read() as s:
        assert [j.image_id for j in cat.list_judgments(s, other.id)] == [kept.id]
        with pytest.raises(NotFound):
            cat.list_judgments(s, reference_set.id)
    assert _rows(catalog) == 1
