"""Metadata arrives by every ingestion route: ``rubricsearch ingest`` in this process and with ``--server`` (a
real uvicorn server on 127.0.0.1), from a folder with its manifest, a zip with its manifest, a JSONL URL list and
``--manifest FILE``; each run says the manifest was applied. A manifest that cannot apply is refused with its
rows listed, never dropped."""

from __future__ import annotations

import json
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rubricsearch.app.main import create_app
from tests.api_helpers import ADMIN_KEY, api_settings, serve_in_thread
from tests.conftest import image_server, noise_png
from tests.test_cli import env, run  # noqa: F401 - the CLI's environment fixture
from tests.test_metadata_ingest import catalog_meta

pytestmark = pytest.mark.timeout(300)
LABELS = {"b0.png": "Chelsea", "boots/b1.png": "Hiker", "boots/b2.png": "Slip-on"}
MANIFEST = "file,label,price\n" + "".join(f"{name},{label},{9 + i}\n" for i, (name, label) in
                                          enumerate(LABELS.items()))


@pytest.fixture(scope="module")
def remote(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
           ) -> Iterator[tuple[str, str]]:
    """(server URL, image server URL): a server that may fetch from the loopback image server."""
    with image_server(lambda path: (200, noise_png(30, 30, len(path)))) as images:
        app = create_app(api_settings(tmp_path_factory.mktemp("routes"), tiny_embedding_dir, tiny_reranker_dir,
                                      ingest={"workers": 1, "url_allowed_hosts": [images.removeprefix("http://")]},
                                      import_root=tmp_path_factory.getbasetemp()))
        with serve_in_thread(app) as url:
            yield url, images


def source(tmp_path: Path, kind: str, seed: int) -> Path:
    """A folder (or a zip of it) with three images, one at the root and two under ``boots/``, and a manifest."""
    folder = tmp_path / f"shop{seed}"
    (folder / "boots").mkdir(parents=True)
    for i, name in enumerate(LABELS):
        (folder / name).write_bytes(noise_png(40 + 4 * i, 44, seed + i))
    (folder / "manifest.csv").write_text(MANIFEST)
    if kind == "folder":
        return folder
    archive = tmp_path / f"shop{seed}.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for path in sorted(folder.rglob("*")):
            if path.is_file():
                zf.write(path, path.relative_to(folder).as_posix())
    return archive


def remote_meta(base: str, set_name: str) -> dict[str, dict[str, Any]]:
    """Each image's metadata as the server holds it, keyed by the label its manifest row gave (or the name)."""
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    set_id = httpx.get(f"{base}/v1/sets/{set_name}", headers=headers).json()["id"]
    page = httpx.get(f"{base}/v1/sets/{set_id}/images", params={"limit": 100}, headers=headers).json()
    return {i["original_name"]: i["metadata"] for i in page["data"]}


def labels(meta: dict[str, dict[str, Any]]) -> list[str]:
    return sorted(m.get("label", "") for m in meta.values())


@pytest.mark.parametrize("kind", ["folder", "zip"])
def test_local_source_manifest(env: dict[str, str], capsys: pytest.CaptureFixture[str],  # noqa: F811
                               tmp_path: Path, kind: str) -> None:
    assert run(capsys, "sets", "create", "local")[0] == 0
    code, out, err = run(capsys, "ingest", "local", str(source(tmp_path, kind, 100)), "--quiet")
    assert code == 0, (out, err)
    assert "manifest manifest.csv: applied, metadata for 3 image(s)" in out and "ignored" not in out
    meta = catalog_meta("local")
    assert labels(meta) == sorted(LABELS.values())
    assert meta["boots/b1.png"] == {"label": "Hiker", "price": 10}


@pytest.mark.parametrize("kind", ["folder", "zip"])
def test_remote_source_manifest(remote: tuple[str, str], capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                kind: str) -> None:
    base, _ = remote
    name = f"remote-{kind}"
    server = ["--server", base, "--api-key", ADMIN_KEY]
    assert run(capsys, "sets", "create", name, *server)[0] == 0
    path = source(tmp_path, kind, 200 if kind == "folder" else 300)
    code, out, err = run(capsys, "ingest", name, str(path), "--quiet", *server)
    assert code == 0, (out, err)
    assert "3 indexed" in out and "ignored" not in out
    assert "applied" in out and ("metadata of 3 image(s) updated" in out or "metadata for 3 image(s)" in out)
    assert labels(remote_meta(base, name)) == sorted(LABELS.values())
    assert any(m == {"label": "Hiker", "price": 10} for m in remote_meta(base, name).values())


def test_server_folder_import(remote: tuple[str, str], tmp_path: Path) -> None:
    """``POST /v1/sets/{set}/imports`` of a folder on the server: the job applies and reports its manifest."""
    from tests.api_helpers import wait_job

    base, _ = remote
    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    assert httpx.post(f"{base}/v1/sets", json={"name": "server-folder"}, headers=headers).status_code == 201
    job = httpx.post(f"{base}/v1/sets/server-folder/imports", headers=headers,
                     json={"folder": str(source(tmp_path, "folder", 600))}).json()
    assert job["manifest"] == {"name": "manifest.csv", "images": 3} and job["ignored_entries"] == []
    with httpx.Client(base_url=base, headers=headers) as client:
        assert wait_job(client, job["id"])["state"] == "succeeded"
    assert remote_meta(base, "server-folder")["boots/b1.png"] == {"label": "Hiker", "price": 10}


def test_local_url_list(env: dict[str, str], capsys: pytest.CaptureFixture[str],  # noqa: F811
                        png_server: str, tmp_path: Path) -> None:
    urls = tmp_path / "urls.jsonl"
    urls.write_text(json.dumps({"url": f"{png_server}/one.png", "metadata": {"label": "From web"}}) + "\n")
    assert run(capsys, "sets", "create", "web")[0] == 0
    assert run(capsys, "ingest", "web", "--urls", str(urls), "--quiet")[0] == 0
    assert catalog_meta("web") == {f"{png_server}/one.png": {"label": "From web"}}


def test_remote_url_list_and_manifest_flag(remote: tuple[str, str], capsys: pytest.CaptureFixture[str],
                                           tmp_path: Path) -> None:
    base, images = remote
    server = ["--server", base, "--api-key", ADMIN_KEY]
    assert run(capsys, "sets", "create", "remote-web", *server)[0] == 0
    urls = tmp_path / "urls.jsonl"
    urls.write_text(json.dumps({"url": f"{images}/one.png", "metadata": {"label": "From web"}}) + "\n")
    loose = tmp_path / "loose.png"
    loose.write_bytes(noise_png(50, 40, 4242))
    manifest = tmp_path / "extra.csv"
    manifest.write_text("file,label\nloose.png,Loose\n")
    code, out, err = run(capsys, "ingest", "remote-web", str(loose), "--urls", str(urls), "--manifest",
                         str(manifest), "--quiet", *server)
    assert code == 0, (out, err)
    assert f"manifest {manifest}: applied, metadata of 1 image(s) updated" in out
    assert remote_meta(base, "remote-web") == {f"{images}/one.png": {"label": "From web"},
                                               "loose.png": {"label": "Loose"}}


def test_manifests_that_cannot_apply_are_refused(remote: tuple[str, str], capsys: pytest.CaptureFixture[str],
                                                 tmp_path: Path) -> None:
    """A folder manifest naming a file the folder lacks refuses the command before anything is sent, each bad
    row shown; a manifest given among the images, or inside a zip sent with other files, is a 422, not lost."""
    base, _ = remote
    server = ["--server", base, "--api-key", ADMIN_KEY]
    assert run(capsys, "sets", "create", "refused", *server)[0] == 0
    folder = source(tmp_path, "folder", 400)
    (folder / "manifest.csv").write_text(MANIFEST + "boots/ghost.png,Ghost,1\nnope.png,Nope,2\n")
    code, _, err = run(capsys, "ingest", "refused", str(folder), "--quiet", *server)
    assert code == 2 and "2 row(s) are wrong" in err
    assert "line 5: 'boots/ghost.png' is not an image of this source" in err and "line 6: 'nope.png'" in err
    assert remote_meta(base, "refused") == {}
    code, _, err = run(capsys, "ingest", "refused", str(folder / "b0.png"), str(folder / "manifest.csv"), *server)
    assert code == 2 and "a manifest is not an image; give it with --manifest" in err

    headers = {"Authorization": f"Bearer {ADMIN_KEY}"}
    archive = source(tmp_path, "zip", 500)
    with_image = [("files", ("x.png", noise_png(30, 30, 1), "image/png"))]
    loose = httpx.post(f"{base}/v1/sets/refused/images", headers=headers,
                       files=[*with_image, ("files", ("manifest.csv", MANIFEST.encode(), "text/csv"))])
    assert loose.status_code == 422 and "POST /v1/sets/" in loose.json()["error"]["message"]
    mixed = httpx.post(f"{base}/v1/sets/refused/images", headers=headers,
                       files=[*with_image, ("files", ("shop.zip", archive.read_bytes(), "application/zip"))])
    assert mixed.status_code == 422 and "uploaded on its own" in mixed.json()["error"]["message"]
    assert remote_meta(base, "refused") == {}


@pytest.mark.parametrize("where", ["local", "remote"])
def test_a_manifest_below_the_root_is_named(env: dict[str, str], remote: tuple[str, str],  # noqa: F811
                                            capsys: pytest.CaptureFixture[str], tmp_path: Path, where: str) -> None:
    """Only the root's manifest applies; one in a subfolder is reported as ignored, and a zip inside is its own
    job with its own manifest, in this process and with --server alike."""
    server = ["--server", remote[0], "--api-key", ADMIN_KEY] if where == "remote" else []
    folder = source(tmp_path, "folder", 700 if where == "local" else 800)
    (folder / "manifest.csv").rename(folder / "boots" / "manifest.csv")
    archive = source(tmp_path, "zip", 900 if where == "local" else 1000)  # a zip inside: its own job
    archive.rename(folder / "boots" / "more.zip")
    assert run(capsys, "sets", "create", f"nested-{where}", *server)[0] == 0
    code, out, err = run(capsys, "ingest", f"nested-{where}", str(folder), "--quiet", *server)
    assert code == 0, (out, err)
    assert "3 indexed" in out and "manifest manifest.csv: applied, metadata for 3 image(s)" in out  # the zip's
    assert out.count("applied") == 1 and "more.zip: a zip archive in the folder, ingested as its own job" in out
    line = next(line for line in out.splitlines() if "ignored" in line)
    assert "boots/manifest.csv" in line
