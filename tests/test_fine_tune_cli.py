"""``rubricsearch train SET --out DIR`` in a data dir with the tiny offline checkpoints: a set ingested by the CLI,
judgments recorded in its catalog, then a short fine-tune whose version folder, card and printout are checked;
and the refusals (no judgments, an existing folder, out-of-range settings) leave nothing behind."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from rubricsearch.app.cli import main
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import open_state
from rubricsearch.indexer.catalog import JudgmentSpec, delete_judgments, list_images, record_judgments, resolve_set
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
             tiny_reranker_dir: Path) -> Iterator[Path]:
    """One ingested set for the module (ingestion is most of the time); each test records its own judgments."""
    with pytest.MonkeyPatch.context() as monkeypatch:
        yield _ingested(monkeypatch, tmp_path_factory.mktemp("train-cli"), tiny_embedding_dir, tiny_reranker_dir)


def _ingested(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_embedding_dir: Path,
              tiny_reranker_dir: Path) -> Path:
    for key, value in {"RUBRICSEARCH_DATA_DIR": str(tmp_path / "data"),
                       "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(tiny_embedding_dir),
                       "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(tiny_reranker_dir),
                       "RUBRICSEARCH_MODELS__DTYPE": "float32", "RUBRICSEARCH_MODELS__DEVICE": "cpu",
                       "RUBRICSEARCH_PACKAGES__STORAGE_DTYPE": "float32"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    photos = tmp_path / "photos"
    photos.mkdir()
    for i in range(8):
        (photos / f"p{i}.png").write_bytes(noise_png(40 + 4 * (i % 3), 48, 500 + i))
    assert main(["sets", "create", "parts"]) == 0
    assert main(["ingest", "parts", str(photos), "--quiet"]) == 0
    return tmp_path


def _judge(holds: list[bool]) -> None:
    state = open_state(Settings())
    try:
        with state.catalog.write() as session:
            record = resolve_set(session, "parts")
            images = list_images(session, record.id, limit=100).items
            delete_judgments(session, record.id)
            specs = [JudgmentSpec(img.id, "a hairline crack at the weld", h) for img, h in zip(images, holds,
                                                                                                 strict=False)]
            record_judgments(session, record.id, specs)
    finally:
        state.close()


def test_train_writes_a_version_with_its_card(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    _judge([i % 2 == 0 for i in range(8)])
    out = data_dir / "versions" / "parts-v1"
    code = main(["train", "parts", "--out", str(out), "--steps", "3", "--batch", "4", "--seed", "1"])
    printed, progress = capsys.readouterr()
    assert code == 0
    card = json.loads((out / "card.json").read_text())
    assert card["data"]["set_name"] == "parts" and card["data"]["judgments"] == 8
    assert card["settings"]["steps"] == 3 and card["settings"]["seed"] == 1 and card["vision_encodes"] == 0
    assert "vision encodes 0" in printed and "held out" in printed and str(out) in printed
    assert "step 3/3" in progress or "validation log-loss" in progress
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))

    code = main(["train", "parts", "--out", str(out), "--steps", "3"])
    assert code == 2 and "error (conflict)" in capsys.readouterr().err


@pytest.mark.parametrize("model", ["reranker", "embedder"])
@pytest.mark.parametrize(("holds", "args", "kind"), [
    ([], [], "invalid_input"),  # no judgments
    ([True] * 8, [], "invalid_input"),  # one answer only
    ([True, False] * 4, ["--rank", "0"], "invalid_input"),
    ([True, False] * 4, ["--lr", "5"], "invalid_input"),
    ([True, False] * 4, ["--steps", "0"], "invalid_input"),
])
def test_refusals_write_nothing(data_dir: Path, capsys: pytest.CaptureFixture[str], holds: list[bool],
                                args: list[str], kind: str, model: str) -> None:
    _judge(holds)
    versions = data_dir / "refused"
    code = main(["train", "parts", "--model", model, "--out", str(versions / "v"), *args])
    assert code == 2 and f"error ({kind})" in capsys.readouterr().err
    assert not versions.exists() or not any(versions.iterdir())


def test_activate_refuses_a_reranker_version_no_better_than_the_active_one(data_dir: Path,
                                                                          capsys: pytest.CaptureFixture[str]) -> None:
    """``--activate`` runs the API's guard for a reranker too: a version that learned nothing (an lr too small to
    move a weight) measures the same as the base on every metric, so it is refused with the table printed, and it
    stays registered, inactive."""
    from rubricsearch.indexer.catalog.versions import active_version_id, list_versions

    _judge([i % 2 == 0 for i in range(8)])
    out = data_dir / "versions" / "parts-unchanged"
    code = main(["train", "parts", "--out", str(out), "--steps", "2", "--batch", "4", "--lr", "1e-12", "--seed", "1",
                 "--activate"])
    err = capsys.readouterr().err
    assert code == 2 and "error (conflict)" in err and "does not beat the active reranker" in err, err
    assert "base (active)" in err and "auc" in err and "candidate is" in err and "better" not in err.split("auc")[1]
    state = open_state(Settings())
    try:
        with state.catalog.read() as session:
            record = resolve_set(session, "parts")
            assert [v.path for v in list_versions(session, record.id)][-1] == str(out.resolve())
            assert active_version_id(session, record.id, "reranker") is None
    finally:
        state.close()
