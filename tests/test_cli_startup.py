"""How the CLI starts: ``--help`` answers without importing the model, web or database stack, and an in-process
command that cannot open its data dir or its models says so at once, with the next step."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
HEAVY = ("torch", "transformers", "fastapi", "sqlalchemy", "faiss", "PIL", "numpy")
PROBE = """
import contextlib, io, json, sys
from rubricsearch.app.cli import main
with contextlib.redirect_stdout(io.StringIO()) as out:
    try:
        main(sys.argv[2:])
    except SystemExit:
        pass
print(json.dumps({"help": out.getvalue(), "loaded": [m for m in sys.argv[1].split(",") if m in sys.modules]}))
"""


@pytest.mark.parametrize("argv", [["--help"], ["ingest", "--help"], ["search", "--help"], ["worker", "--help"],
                                  ["judgments", "derive", "--help"], ["train", "--help"]],
                         ids=lambda a: " ".join(a))
def test_help_imports_no_heavy_module(argv: list[str]) -> None:
    done = subprocess.run([sys.executable, "-c", PROBE, ",".join(HEAVY), *argv], cwd=ROOT, capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120, check=True)
    report = json.loads(done.stdout)
    assert "usage: rubricsearch" in report["help"]
    assert report["loaded"] == []


@pytest.fixture
def local_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_embedding_dir: Path,
              tiny_reranker_dir: Path) -> Path:
    data = tmp_path / "data"
    for key, value in {"RUBRICSEARCH_DATA_DIR": str(data),
                       "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(tiny_embedding_dir),
                       "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(tiny_reranker_dir),
                       "RUBRICSEARCH_MODELS__DTYPE": "float32"}.items():
        monkeypatch.setenv(key, value)
    for key in ("RUBRICSEARCH_CLIENT_URL", "RUBRICSEARCH_MODELS__FALLBACK_TO_TEST_MODELS"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.chdir(tmp_path)
    return data


def test_a_held_data_dir_suggests_server(local_env: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A server holding the data dir (here: this test holding its FAISS directory) makes an in-process command
    fail with the next step: the same command through the server with --server."""
    from rubricsearch.app.cli import main
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import open_state

    state = open_state(Settings())
    try:
        assert main(["sets", "list"]) == 2
    finally:
        state.close()
    err = capsys.readouterr().err
    assert "error (backend_unavailable)" in err and "in use" in err
    assert "add --server URL" in err


@pytest.fixture
def no_hub(local_env: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """An empty Hugging Face cache and a hub endpoint nothing listens on (the probe is refused at once)."""
    import socket

    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)


def test_a_missing_model_with_no_hub_fails_at_once(no_hub: None, monkeypatch: pytest.MonkeyPatch,
                                                    capsys: pytest.CaptureFixture[str]) -> None:
    """A model that is neither here nor in the cache, and a hub that does not answer: the command stops after
    the demo's one connect probe, saying what to do, instead of handing the hub id to transformers' retries."""
    from rubricsearch.app.cli import main

    assert main(["sets", "create", "pets"]) == 0
    monkeypatch.setenv("RUBRICSEARCH_MODELS__EMBEDDING_MODEL", "Qwen/Not-Downloaded-Embedding")
    assert main(["search", "pets", "--rubric", "short fur", "--no-rerank"]) == 2
    err = capsys.readouterr().err
    assert "error (backend_unavailable)" in err
    assert "'Qwen/Not-Downloaded-Embedding' is neither a local checkpoint nor in the Hugging Face cache" in err
    assert "the hub does not answer" in err and "add --server URL" in err


def test_ingest_without_the_reranker_tower_or_a_hub(no_hub: None, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture,
                                                     capsys: pytest.CaptureFixture[str]) -> None:
    """An in-process ingest whose reranker is neither here nor fetchable skips its tower after the same probe
    (a server's backfill job makes those packages later) and ingests."""
    from rubricsearch.app.cli import main
    from tests.conftest import noise_png

    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(2):
        (folder / f"p{i}.png").write_bytes(noise_png(40, 40 + i, 900 + i))
    monkeypatch.setenv("RUBRICSEARCH_MODELS__RERANKER_MODEL", "Qwen/Not-Downloaded-Reranker")
    assert main(["sets", "create", "pets"]) == 0
    with caplog.at_level("WARNING", logger="rubricsearch.app"):
        assert main(["ingest", "pets", str(folder), "--quiet"]) == 0
    assert "2 indexed" in capsys.readouterr().out
    assert any("Not-Downloaded-Reranker" in r.getMessage() and "the hub does not answer" in r.getMessage()
               for r in caplog.records)
