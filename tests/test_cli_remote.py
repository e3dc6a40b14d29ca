"""The CLI's data commands with ``--server``: they go through ``app.client`` to a real uvicorn server on
127.0.0.1, with the server's auth, errors and resume-by-sha256, and print what the in-process commands print."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from rubricsearch.app.cli import main
from rubricsearch.app.main import create_app
from tests.api_helpers import ADMIN_KEY, api_settings, serve_in_thread

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
         ) -> Iterator[str]:
    app = create_app(api_settings(tmp_path_factory.mktemp("cli-remote"), tiny_embedding_dir, tiny_reranker_dir,
                                  ingest={"workers": 1}, auth={"search_requires_key": True}))
    with serve_in_thread(app) as url:
        yield url


def test_sets_ingest_search_jobs_through_the_api(base: str, tmp_path: Path, make_png,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    folder = tmp_path / "refs"
    (folder / "sub").mkdir(parents=True)
    for i in range(3):
        (folder / ("sub" if i else "") / f"{i}.png").write_bytes(make_png(64, 40 + 9 * i, 70 + 3 * i))
    (folder / "notes.txt").write_text("not an image")
    remote = ["--server", base, "--api-key", ADMIN_KEY]

    assert main(["sets", "create", "remote-refs", "--dimensions", "64", *remote]) == 0
    assert "created set 'remote-refs'" in capsys.readouterr().out
    assert main(["ingest", "remote-refs", str(folder), "--quiet", *remote]) == 0
    out = capsys.readouterr().out
    assert "3 indexed" in out and "of 3" in out
    assert main(["ingest", "remote-refs", str(folder), "--quiet", *remote]) == 0  # resumed: nothing sent
    assert "the set already holds every file" in capsys.readouterr().out

    (tmp_path / "candidate.png").write_bytes(make_png(64, 200, 10))
    assert main(["search", "remote-refs", "--criteria", "short fur", "dark stripes", "--image",
                 str(tmp_path / "candidate.png"), "--top-n", "2", *remote]) == 0
    out = capsys.readouterr().out
    assert "short fur" in out and "dark stripes" in out and "query images 1" in out
    assert sum(line.split()[:1] in (["1"], ["2"]) and ".png" in line for line in out.splitlines()) == 2

    assert main(["jobs", "--set", "remote-refs", *remote]) == 0
    out = capsys.readouterr().out
    assert "succeeded" in out and out.count("upload") == 1
    assert main(["sets", "list", *remote]) == 0
    assert "remote-refs" in capsys.readouterr().out
    assert main(["sets", "delete", "remote-refs", *remote]) == 2  # no terminal to ask: nothing deleted
    assert "refusing to delete without --yes" in capsys.readouterr().err
    assert main(["sets", "delete", "remote-refs", "--yes", *remote]) == 0
    assert "deleted set 'remote-refs'" in capsys.readouterr().out
    assert main(["sets", "list", *remote]) == 0
    assert "remote-refs" not in capsys.readouterr().out


def test_server_errors_come_back_as_cli_errors(base: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setenv("RUBRICSEARCH_CLIENT_URL", base)  # the environment names the server too
    assert main(["sets", "list", "--api-key", "x" * len(ADMIN_KEY)]) == 2
    assert "error (unauthorized)" in capsys.readouterr().err
    monkeypatch.setenv("RUBRICSEARCH_CLIENT_KEY", ADMIN_KEY)
    assert main(["search", "no-such-set", "--rubric", "short fur"]) == 2
    assert "error (not_found)" in capsys.readouterr().err
    assert main(["ingest", "no-such-set", str(tmp_path / "missing.png")]) == 2
    assert "error (not_found)" in capsys.readouterr().err
