"""Metadata that comes with ingestion (a folder's manifest, a JSONL URL list, per-file upload metadata,
``--manifest``) and ``--filter``, through the CLI in this process on tiny real checkpoints; a bad manifest
refuses the job with every bad row named and queues nothing."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from rubricsearch.app.settings import Settings
from rubricsearch.app.state import open_state
from rubricsearch.indexer.catalog import list_images, list_jobs, resolve_set
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.images import decode_image
from tests.conftest import noise_png
from tests.test_cli import env, run  # noqa: F401 - the CLI's environment fixture

pytestmark = pytest.mark.timeout(300)


def catalog_meta(set_name: str) -> dict[str, dict[str, Any]]:
    state = open_state(Settings())
    try:
        with state.catalog.read() as session:
            set_id = resolve_set(session, set_name).id
            return {i.original_name: i.meta for i in list_images(session, set_id, limit=1000).items}
    finally:
        state.close()


def test_folder_manifest_urls_and_filter(env: dict[str, str], capsys: pytest.CaptureFixture[str],  # noqa: F811
                                         png_server: str, tmp_path: Path) -> None:
    folder = tmp_path / "shop"
    (folder / "boots").mkdir(parents=True)
    for i in range(4):
        (folder / "boots" / f"b{i}.png").write_bytes(noise_png(40 + 4 * i, 44, 500 + i))
    (folder / "manifest.jsonl").write_text("\n".join(json.dumps(r) for r in [
        {"file": "boots/b0.png", "label": "Chelsea", "category": "boots", "price": 120},
        {"file": "boots/b1.png", "label": "Hiker", "category": "boots", "price": 90, "tags": ["outdoor"]},
        {"file": "boots/b2.png", "label": "Slip-on", "category": "loafers"},
    ]) + "\n")
    assert run(capsys, "sets", "create", "shop")[0] == 0
    code, out, err = run(capsys, "ingest", "shop", str(folder), "--quiet")
    assert code == 0, (out, err)
    meta = catalog_meta("shop")
    assert meta["boots/b1.png"] == {"label": "Hiker", "category": "boots", "price": 90, "tags": ["outdoor"]}
    assert meta["boots/b3.png"] == {}

    flt = json.dumps({"must": [{"key": "category", "match": {"value": "boots"}}],
                      "must_not": [{"key": "price", "range": {"gt": 100}}]})
    code, out, _ = run(capsys, "search", "shop", "--rubric", "a boot", "--no-rerank", "--filter", flt, "--json")
    assert code == 0
    assert [h["image"]["metadata"]["label"] for h in json.loads(out)["hits"]] == ["Hiker"]
    code, out, _ = run(capsys, "search", "shop", "--rubric", "a boot", "--no-rerank", "--filter",
                       json.dumps({"must": [{"key": "category", "match": {"value": "sandals"}}]}))
    assert code == 0 and "no hits (the filter matches no reference in this set)" in out
    code, _, err = run(capsys, "search", "shop", "--rubric", "x", "--filter", '{"must": [{"key": "a", "geo": 1}]}')
    assert code == 2 and "'geo'" in err

    # a manifest row naming no file of the folder refuses the job: nothing is queued
    (folder / "manifest.jsonl").write_text(json.dumps({"file": "boots/b9.png", "label": "ghost"}) + "\n{oops\n")
    code, _, err = run(capsys, "ingest", "shop", str(folder), "--quiet")
    assert code == 2 and "invalid_metadata" in err
    state = open_state(Settings().model_copy(update={"import_root": Path("/")}))
    try:
        with state.catalog.read() as session:
            set_id = resolve_set(session, "shop").id
            assert len(list_jobs(session, set_id=set_id)) == 1
        with pytest.raises(InvalidMetadata) as bad:
            state.ingestion.create_job_from_folder(set_id, folder)
        assert [e["line"] for e in bad.value.details["errors"]] == [1, 2]
    finally:
        state.close()

    urls = tmp_path / "urls.jsonl"
    urls.write_text(f"{png_server}/a.png\n"
                    + json.dumps({"url": f"{png_server}/bb.png", "metadata": {"label": "From web"}}) + "\n")
    code, out, _ = run(capsys, "ingest", "shop", "--urls", str(urls), "--quiet")
    assert code == 0 and "(url): succeeded: 2 indexed" in out
    meta = catalog_meta("shop")
    assert meta[f"{png_server}/bb.png"] == {"label": "From web"}
    assert meta[f"{png_server}/a.png"] == {}


def test_loose_files_with_manifest_flag(env: dict[str, str], capsys: pytest.CaptureFixture[str],  # noqa: F811
                                        tmp_path: Path) -> None:
    files = []
    for i in range(3):
        files.append(tmp_path / f"loose{i}.png")
        files[-1].write_bytes(noise_png(50, 40 + 4 * i, 700 + i))
    sha2 = decode_image(files[2].read_bytes()).sha256
    manifest = tmp_path / "extra.csv"
    manifest.write_text(f"file,sha256,label,size\nloose0.png,,First,7\n,{sha2},Third,9.5\n")
    assert run(capsys, "sets", "create", "loose")[0] == 0
    code, out, err = run(capsys, "ingest", "loose", *map(str, files), "--manifest", str(manifest), "--quiet")
    assert code == 0 and "metadata of 2 image(s) updated" in out, (out, err)
    meta = catalog_meta("loose")
    assert meta == {"loose0.png": {"label": "First", "size": 7}, "loose1.png": {},
                    "loose2.png": {"label": "Third", "size": 9.5}}
    code, out, _ = run(capsys, "search", "loose", "--rubric", "x", "--no-rerank", "--json", "--filter",
                       json.dumps({"must": [{"key": "size", "range": {"gte": 8}}]}))
    assert [h["image"]["original_name"] for h in json.loads(out)["hits"]] == ["loose2.png"]
    manifest.write_text("label\nno image named\n")
    code, _, err = run(capsys, "ingest", "loose", str(files[0]), "--manifest", str(manifest), "--quiet")
    assert code == 2 and "`file` or `sha256` column" in err


def test_upload_metadata_field(tmp_path: Path, tiny_embedding_dir: Path, reranker_dir_for: Any) -> None:
    from tests.api_helpers import ADMIN_KEY, api_settings, bearer, client_for
    from tests.conftest import TOWERS

    state = open_state(api_settings(tmp_path / "d", tiny_embedding_dir, reranker_dir_for(TOWERS[0]),
                                    ingest={"workers": 0}))
    try:
        client = client_for(state)
        admin = bearer(ADMIN_KEY)
        assert client.post("/v1/sets", json={"name": "up"}, headers=admin).status_code == 201
        files = [("files", (f"f{i}.png", noise_png(30 + i, 30, 60 + i), "image/png")) for i in range(2)]
        bad = client.post("/v1/sets/up/images", headers=admin, files=files,
                          data={"metadata": json.dumps({"f0.png": {"label": "A"}, "nope.png": {"label": "B"}})})
        assert bad.status_code == 422 and "nope.png" in bad.text
        over = client.post("/v1/sets/up/images", headers=admin, files=files,
                           data={"metadata": json.dumps({"f0.png": {"label": ["not", "a", "string"]}})})
        assert over.status_code == 422 and "label" in over.text
        job = client.post("/v1/sets/up/images", headers=admin, files=files,
                          data={"metadata": json.dumps({"f1.png": {"label": "B", "tags": ["x"]}})})
        assert job.status_code == 202
        items = state.ingestion.job_items(job.json()["id"])
        assert {i.source_ref: i.meta for i in items} == {"f0.png": None, "f1.png": {"label": "B", "tags": ["x"]}}
        with state.catalog.read() as session:
            assert len(list_jobs(session)) == 1  # the refused requests created nothing
    finally:
        state.close()
