"""Metadata in the catalog on SQLite and PostgreSQL (JSONB, GIN-indexed): bounds, merge patches, all-or-nothing
bulk changes, manifests, and the job item carrying an image's metadata to its row."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path
from typing import cast

import pytest
from sqlalchemy import inspect

from rubricsearch.indexer.catalog import (
    Catalog,
    ImageSource,
    ItemSpec,
    add_image,
    check_metadata,
    create_job,
    create_set,
    iter_metadata,
    list_items,
    parse_manifest,
    update_metadata,
)
from rubricsearch.indexer.jobs.manifests import specs_from_manifest
from rubricsearch.indexer.jobs.metadata import apply_manifest
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index import VectorIndex

SHAS = [f"{i:064x}" for i in range(1, 5)]


def filled(catalog: Catalog) -> tuple[str, list[int]]:
    with catalog.write() as s:
        ref = create_set(s, "meta")
        ids = [add_image(s, ref.id, sha256=sha, byte_size=1, source=ImageSource.ZIP, original_name=f"d/{i}.png",
                         meta={"label": f"L{i}"} if i % 2 == 0 else None)[0].id for i, sha in enumerate(SHAS)]
    return ref.id, ids


def test_merge_patches_are_all_or_nothing(catalog: Catalog) -> None:
    set_id, ids = filled(catalog)
    with catalog.write() as s:
        done = update_metadata(s, set_id, {ids[0]: {"tags": ["x", "y"], "n": 2.5}, SHAS[1].upper(): {"k": True}})
    assert {r.sha256: r.meta for r in done} == {SHAS[0]: {"label": "L0", "tags": ["x", "y"], "n": 2.5},
                                                SHAS[1]: {"k": True}}
    with pytest.raises(InvalidMetadata) as bad, catalog.write() as s:
        update_metadata(s, set_id, {ids[0]: {"label": None}, "f" * 64: {"a": 1},
                                    ids[2]: {f"k{i}": i for i in range(64)}})
    assert [e["image"] for e in bad.value.details["errors"]] == ["f" * 64, ids[2]]
    with catalog.read() as s:
        after = {r.sha256: r.meta for r in iter_metadata(s, set_id, page=2)}
    assert after[SHAS[0]] == {"label": "L0", "tags": ["x", "y"], "n": 2.5}  # the good change was not applied
    assert after[SHAS[2]] == {"label": "L2"} and after[SHAS[3]] == {}
    with catalog.write() as s:
        update_metadata(s, set_id, {ids[0]: {"label": None}, ids[3]: {"z": "w"}})
        update_metadata(s, set_id, {ids[2]: {"only": 1}}, replace=True)
    with catalog.read() as s:
        after = {r.sha256: r.meta for r in iter_metadata(s, set_id)}
    assert after[SHAS[0]] == {"tags": ["x", "y"], "n": 2.5} and after[SHAS[2]] == {"only": 1}


def test_job_items_carry_metadata(catalog: Catalog) -> None:
    with catalog.write() as s:
        ref = create_set(s, "jobs")
        job = create_job(s, ref.id, "zip", [ItemSpec("a.png", meta={"label": "A"}), ItemSpec("b.png"), "c.png"])
        items = list_items(s, job.id)
    assert [i.meta for i in items] == [{"label": "A"}, None, None]


def test_postgres_keeps_jsonb_with_a_gin_index(catalog: Catalog) -> None:
    if catalog.engine.dialect.name != "postgresql":
        pytest.skip("JSONB and GIN are PostgreSQL's")
    indexes = {ix["name"]: ix for ix in inspect(catalog.engine).get_indexes("images")}
    assert "ix_images_meta" in indexes
    columns = {c["name"]: c for c in inspect(catalog.engine).get_columns("images")}
    assert type(columns["meta"]["type"]).__name__ == "JSONB"


@pytest.mark.parametrize(("raw", "says"), [
    ({"k" + str(i): 1 for i in range(65)}, "at most 64 keys"),
    ({"x": "y" * 17_000}, "16384-byte bound"),
    ({"x": {"y": 1}}, "not dict"),
    ({"x": [1, [2]]}, "metadata.x[1]"),
    ({"x.y": 1}, "invalid key"),
    ({"tags": "a"}, "tags are a list of strings"),
    ({"x": float("nan")}, "finite"),
    ({"x": None}, "null only removes"),
    ([1, 2], "must be a JSON object"),
])
def test_bounds(raw: object, says: str) -> None:
    with pytest.raises(InvalidMetadata) as err:
        check_metadata(raw)
    assert says in err.value.message


def test_manifests_parse_by_type_and_name_bad_rows() -> None:
    csv_text = "file,sha256,label,n,flag,tags,code\na.png,,A,3,true,x;y,007\n,,nobody,1,,,\nb.png,,B,,,,,extra\n"
    parsed = parse_manifest(csv_text.encode(), "manifest.csv")
    assert [(r.file, r.change) for r in parsed.rows] == [
        ("a.png", {"label": "A", "n": 3, "flag": True, "tags": ["x", "y"], "code": "007"})]
    assert [e["line"] for e in parsed.errors] == [3, 4]
    lines = [json.dumps({"sha256": SHAS[0], "label": None}), "[1]", json.dumps({"file": "a.png", "x": {"y": 1}}),
             json.dumps({"file": "./c.png"}), json.dumps({"file": "c.png", "again": 1})]
    parsed = parse_manifest("\n".join(lines).encode(), "manifest.jsonl")
    assert [(r.sha256, r.file, r.change) for r in parsed.rows] == [(SHAS[0], None, {"label": None}),
                                                                 (None, "c.png", {}), (None, "c.png", {"again": 1})]
    assert [e["line"] for e in parsed.errors] == [2, 3, 5]
    with pytest.raises(InvalidMetadata, match=r"a \.csv or \.jsonl"):
        parse_manifest(b"", "manifest.xlsx")


class _NoIndex:
    """No set in the index: only the catalog's side of a manifest is exercised."""

    def has_set(self, set_id: str) -> bool:
        return False


def test_a_large_manifest_is_checked_and_refused_in_bounded_memory(catalog: Catalog, tmp_path: Path) -> None:
    """Each row's image reference (the duplicate check) and each failing row (the apply) used to be held:
    ~16 MiB of Python objects at 30 000 rows; the references now go to a scratch SQLite file and the failures
    listed are the first 1000."""
    set_id, _ = filled(catalog)
    rows = 30_000
    path = tmp_path / "manifest.jsonl"
    path.write_text("".join(json.dumps({"sha256": f"{i:064x}", "label": "x"}) + "\n" for i in range(100, 100 + rows)))
    with path.open("rb") as fh:
        tracemalloc.start()
        try:
            with pytest.raises(InvalidMetadata) as exc:  # none of these images is in the set: found when applied
                apply_manifest(catalog, cast(VectorIndex, _NoIndex()), set_id, fh, path.name)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
    assert f"{rows} row(s) cannot be applied" in exc.value.message
    lines = [e["line"] for e in exc.value.details["errors"]]
    assert lines == list(range(1, 1001))
    assert peak < 4 * 2**20, f"peak {peak / 2**20:.1f} MiB"


def test_a_source_manifest_is_read_a_row_at_a_time() -> None:
    """A zip's or folder's manifest becomes its items' metadata; parsing every row first held them all besides
    (peak 2.1x what the items keep at 20 000 rows; now 1.35x). Duplicate and unknown rows are still refused."""
    refs = [f"dir/img{i}.png" for i in range(20_000)]
    body = "".join(json.dumps({"file": r, "label": f"L{i}", "price": i}) + "\n" for i, r in enumerate(refs)).encode()
    tracemalloc.start()
    try:
        specs = specs_from_manifest(refs, ("manifest.jsonl", body))
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(specs) == len(refs) and specs[7].meta == {"label": "L7", "price": 7}
    assert peak < 1.6 * kept, f"peak {peak / 2**20:.1f} MiB for {kept / 2**20:.1f} MiB kept"
    bad = b'{"file": "./dir/img1.png", "label": "a"}\n{"file": "dir/img1.png"}\n{"file": "ghost.png"}\n'
    with pytest.raises(InvalidMetadata) as exc:
        specs_from_manifest(refs, ("manifest.jsonl", bad))
    assert [(e["line"], e["error"]) for e in exc.value.details["errors"]] == [
        (2, "names the same image as line 1"), (3, "'ghost.png' is not an image of this source")]
