"""The ``rubricsearch`` data commands in-process on the tiny checkpoints (settings from RUBRICSEARCH_* env),
and ``rubricsearch serve`` as a real process on 127.0.0.1."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rubricsearch.app.cli import main
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import TEST_LABEL, open_state
from rubricsearch.indexer.catalog import resolve_set
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(300)
ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, tiny_embedding_dir: Path,
        tiny_reranker_dir: Path) -> dict[str, str]:
    values = {"RUBRICSEARCH_DATA_DIR": str(tmp_path / "data"),
              "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(tiny_embedding_dir),
              "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(tiny_reranker_dir), "RUBRICSEARCH_MODELS__DTYPE": "float32",
              "RUBRICSEARCH_PACKAGES__STORAGE_DTYPE": "float32"}
    for key, value in values.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)  # no stray .env is read
    return values


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def photos(tmp_path: Path) -> dict[str, Path]:
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(5):
        (folder / f"p{i}.png").write_bytes(noise_png(40 + 4 * i, 48, 40 + i))
    (folder / "broken.jpg").write_bytes(b"not a jpeg")
    archive = tmp_path / "more.zip"
    with zipfile.ZipFile(archive, "w") as zf:
        for i in range(3):
            zf.writestr(f"inner/z{i}.png", noise_png(36, 30 + i, 80 + i))
    single = tmp_path / "single.png"
    single.write_bytes(noise_png(52, 52, 99))
    return {"folder": folder, "zip": archive, "single": single, "dup": folder / "p0.png"}


def test_sets_commands(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "sets", "create", "cats", "--dimensions", "64", "--description", "reference cats")
    assert code == 0 and "created set 'cats'" in out and "dimensions 64" in out
    code, _, err = run(capsys, "sets", "create", "cats")
    assert code == 2 and "error (conflict)" in err
    code, _, err = run(capsys, "sets", "create", "tiny", "--dimensions", "8")
    assert code == 2 and "invalid_input" in err
    code, out, _ = run(capsys, "sets", "list")
    assert code == 0 and out.splitlines()[0].split() == ["id", "name", "dims", "indexed", "pending", "failed",
                                                         "created"]
    assert "cats" in out and " 64 " in out
    code, _, err = run(capsys, "sets", "delete", "cats")  # stdin is not a terminal under pytest
    assert code == 2 and "--yes" in err
    code, out, _ = run(capsys, "sets", "delete", "cats", "--yes")
    assert code == 0 and "deleted set 'cats'" in out
    assert run(capsys, "sets", "list")[1].strip() == "no sets"
    code, _, err = run(capsys, "sets", "delete", "cats", "--yes")
    assert code == 2 and "not_found" in err


def test_ingest_jobs_and_search(env: dict[str, str], capsys: pytest.CaptureFixture[str],
                                photos: dict[str, Path]) -> None:
    assert run(capsys, "sets", "create", "pets", "--dimensions", "64")[0] == 0
    inner = photos["folder"] / "nested" / "inside.zip"  # a zip inside the folder is not skipped silently
    inner.parent.mkdir()
    with zipfile.ZipFile(inner, "w") as zf:
        zf.writestr("deep.png", noise_png(44, 44, 7))
    code, out, err = run(capsys, "ingest", "pets", str(photos["folder"]), str(photos["zip"]), str(photos["dup"]))
    assert code == 1, (out, err)  # broken.jpg failed
    assert "[" + "#" * 30 + "] 100% 11/11" in err
    lines = out.splitlines()
    assert f"{inner}: a zip archive in the folder, ingested as its own job" in lines
    assert sum("(zip): succeeded" in line for line in lines) == 2
    assert any("(folder): completed_with_errors: 5 indexed, 0 skipped" in line and "1 failed, of 6" in line
               for line in lines)
    assert any("(zip): succeeded: 3 indexed" in line for line in lines)
    assert any("(upload): succeeded: 0 indexed, 1 skipped" in line for line in lines)
    assert any(line.strip().startswith("failed: broken.jpg: invalid_image") for line in lines)
    code, out, _ = run(capsys, "ingest", "pets", str(photos["single"]), "--quiet")
    assert code == 0 and "(upload): succeeded: 1 indexed" in out
    code, _, err = run(capsys, "ingest", "pets", str(photos["folder"] / "nope.png"))
    assert code == 2 and "not_found" in err

    code, out, _ = run(capsys, "jobs", "--set", "pets", "--errors")
    assert code == 0 and len(out.splitlines()) >= 6 and "broken.jpg: invalid_image" in out
    code, out, _ = run(capsys, "jobs", "--json", "--limit", "2")
    jobs = json.loads(out)
    assert len(jobs) == 2 and jobs[0]["kind"] == "upload" and jobs[0]["state"] == "succeeded"
    # indexed, pending, failed: broken.jpg never became an image, and counts as failed as its job counts it
    assert run(capsys, "sets", "list")[1].split("\n")[2].split()[3:6] == ["10", "0", "1"]

    # an ingested image as the candidate: its package is on disk, so this process encodes nothing
    code, out, _ = run(capsys, "search", "pets", "--criteria", "short fur", "pointed ears", "--image",
                       str(photos["dup"]), "--top-k", "6", "--top-n", "4", "--json")
    assert code == 0
    body = json.loads(out)
    assert len(body["hits"]) == 4 and body["provenance"]["vision_encodes"] == 0 and body["test_models"]
    assert body["provenance"]["criteria"] == ["short fur", "pointed ears"]
    code, out, _ = run(capsys, "search", "pets", "--image", str(photos["dup"]), "--top-k", "6")
    assert code == 0 and out.splitlines()[2].split()[-4:-2] == ["[identical", "image]"]  # the candidate itself
    assert "[identical image]: the candidate image itself" in out and out.count("[identical image]") == 2
    code, out, _ = run(capsys, "search", "pets", "--criteria", "short fur", "no stripes", "--top-k", "6")
    assert code == 0 and "score: geometric mean of the per-criterion scores" in out
    assert "'no stripes' scored 1 - P(statement) of 'stripes'" in out
    assert set(body["hits"][0]["criteria"]) == {"short fur", "pointed ears"}
    new = photos["folder"].parent / "candidate.png"
    new.write_bytes(noise_png(70, 50, 4321))
    code, out, _ = run(capsys, "search", "pets", "--rubric", "a striped tail", "--image", str(new))
    assert code == 0
    header = out.splitlines()[0].split()
    assert header[:4] == ["rank", "score", "ann", "rerank"] and "vision encoder runs: 1" in out
    assert f"NOTE: {TEST_LABEL}" in out  # the wording of the banner, provenance and the API
    code, out, _ = run(capsys, "search", "pets", "--rubric", "stripes", "--no-rerank", "--top-n", "2")
    assert code == 0 and "rerank: skipped: reranking disabled" in out
    code, _, err = run(capsys, "search", "pets", "--rubric", "x", "--top-k", "0")
    assert code == 2 and "top_k" in err


def test_ingest_urls_and_resume(env: dict[str, str], capsys: pytest.CaptureFixture[str], png_server: str,
                                tmp_path: Path) -> None:
    urls = tmp_path / "urls.txt"
    urls.write_text("".join(f"{png_server}/{'x' * i}.png\n" for i in range(1, 4)) + "# note\n")
    assert run(capsys, "sets", "create", "web")[0] == 0
    code, out, _ = run(capsys, "ingest", "web", "--urls", str(urls))
    assert code == 0 and "(url): succeeded: 3 indexed" in out

    # a job left queued (e.g. by an interrupted run) is finished with --resume
    state = open_state(Settings())
    try:
        with state.catalog.read() as session:
            set_id = resolve_set(session, "web").id
        job = state.ingestion.create_job_from_uploads(set_id, [("late.png", noise_png(33, 33, 7))])
    finally:
        state.close()
    code, out, _ = run(capsys, "ingest", "web", "--resume", job.id)
    assert code == 0 and f"job {job.id} (upload): succeeded: 1 indexed" in out


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _serve(env: dict[str, str], **more: str) -> tuple[subprocess.Popen[bytes], str]:
    """``rubricsearch serve`` in a process, once /readyz answers."""
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; from rubricsearch.app.cli import main; sys.exit(main(sys.argv[1:]))",
         "serve", "--port", str(port), "--log-level", "warning"],
        env={**os.environ, **env, **more, "PYTHONPATH": str(ROOT)}, cwd=ROOT,
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        assert proc.poll() is None, proc.stdout.read().decode() if proc.stdout else ""
        try:
            if httpx.get(f"{base}/readyz", timeout=2).status_code == 200:
                break
        except httpx.TransportError:
            time.sleep(0.2)
    return proc, base


@pytest.fixture
def served(env: dict[str, str], capsys: pytest.CaptureFixture[str]) -> Iterator[str]:
    assert run(capsys, "sets", "create", "served", "--dimensions", "64")[0] == 0
    proc, base = _serve(env)
    try:
        yield base
    finally:
        proc.terminate()
        proc.wait(30)


@pytest.mark.slow  # a server process: imports torch and loads the models (~15 s)
def test_serve_stops_at_once_with_open_event_streams_and_exits_0(env: dict[str, str],
                                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """SIGTERM with two job event streams open (a job that never runs: no workers): the streams end, the
    process exits within a few seconds with status 0 and logs no error."""
    assert run(capsys, "sets", "create", "streams", "--dimensions", "64")[0] == 0
    state = open_state(Settings())
    try:
        with state.catalog.read() as session:
            set_id = resolve_set(session, "streams").id
        job = state.ingestion.create_job_from_uploads(set_id, [("q.png", noise_png(30, 30, 5))])
    finally:
        state.close()
    proc, base = _serve(env, RUBRICSEARCH_INGEST__WORKERS="0")
    ended: list[float] = []

    def stream() -> None:
        with httpx.stream("GET", f"{base}/v1/jobs/{job.id}/events", timeout=60) as response:
            for _ in response.iter_lines():
                pass
        ended.append(time.monotonic())

    readers = [threading.Thread(target=stream, daemon=True) for _ in range(2)]
    for reader in readers:
        reader.start()
    time.sleep(1.5)
    sent = time.monotonic()
    proc.terminate()
    code = proc.wait(30)
    log = proc.stdout.read().decode() if proc.stdout else ""
    for reader in readers:
        reader.join(5)
    assert code == 0, log
    assert time.monotonic() - sent < 8 and len(ended) == 2, log
    assert "ERROR" not in log and "Traceback" not in log, log


@pytest.mark.slow  # a server process: imports torch and loads the models (~15 s)
def test_serve(served: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert httpx.get(f"{served}/readyz").json()["test_models"] is True
    sets = httpx.get(f"{served}/v1/sets").json()["data"]
    assert [s["name"] for s in sets] == ["served"] and sets[0]["dimensions"] == 64
    # the server owns the FAISS directory: the CLI says so instead of corrupting it
    code, _, err = run(capsys, "sets", "list")
    assert code == 2 and "backend_unavailable" in err and "in use" in err


@pytest.mark.parametrize("seeds", [(1, 1), (1, 2)], ids=["shared-tower", "distinct-towers"])
def test_cli_ingest_then_search_never_encodes_a_reference(monkeypatch: pytest.MonkeyPatch, tmp_path: Path,
                                                           capsys: pytest.CaptureFixture[str],
                                                           seeds: tuple[int, int]) -> None:
    """The report behind issue 9, as a new user runs it: checkpoints from ``make-test-model`` with the given
    seeds, 12 photos ingested with ``rubricsearch ingest``, then ``rubricsearch search --image``."""
    from tests.test_towers import photo

    models = {kind: tmp_path / kind for kind in ("embedding", "reranker")}
    for (kind, path), seed in zip(models.items(), seeds, strict=True):
        assert run(capsys, "make-test-model", str(path), "--kind", kind, "--seed", str(seed))[0] == 0
    for key, value in {"RUBRICSEARCH_DATA_DIR": str(tmp_path / "data"), "RUBRICSEARCH_MODELS__DTYPE": "float32",
                       "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(models["embedding"]),
                       "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(models["reranker"])}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.chdir(tmp_path)
    folder = tmp_path / "photos"
    folder.mkdir()
    for i in range(12):
        (folder / f"photo{i}.jpg").write_bytes(photo(700 + i, (96 + 4 * i, 72)))
    assert run(capsys, "sets", "create", "cats")[0] == 0
    code, out, _ = run(capsys, "ingest", "cats", str(folder))
    assert code == 0 and "succeeded: 12 indexed" in out
    packages = tmp_path / "data" / "packages"
    files = set(packages.rglob("*.safetensors"))
    towers = 1 if seeds[0] == seeds[1] else 2
    assert len(files) == 12 * towers  # ingestion made each reference's package for every distinct tower
    candidate = tmp_path / "candidate.jpg"
    candidate.write_bytes(photo(999))
    code, out, _ = run(capsys, "search", "cats", "--criteria", "short fur", "--image", str(candidate),
                       "--top-k", "12", "--top-n", "12", "--json")
    assert code == 0
    vision = json.loads(out)["provenance"]["vision"]
    assert vision["reference"] == 0 and vision["query"] == towers and vision["towers_shared"] is (towers == 1)
    assert set(packages.rglob("*.safetensors")) == files  # no reference re-encoded; the candidate's stay off disk


def test_ctrl_c_is_one_quiet_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """Ctrl-C during any command (here ``demo``, the long one) ends with exit status 130 and a short note."""
    import rubricsearch.app.demo.cli as demo

    def interrupted(_args: object) -> int:
        raise KeyboardInterrupt

    monkeypatch.setattr(demo, "run", interrupted)
    code, out, err = run(capsys, "demo", "--no-serve")
    assert code == 130 and out == ""
    assert "interrupted" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.slow  # the demo server and its training child: torch imports, a few training steps
def test_ctrl_c_while_the_demo_models_train(tmp_path: Path) -> None:
    """Ctrl-C on ``rubricsearch demo`` during training stops the server and the training child quietly and
    removes the half-trained model (the next run trains it again)."""
    from tests.live_server import free_port

    data = tmp_path / "data"
    port = free_port()
    env = {**os.environ, "RUBRICSEARCH_DATA_DIR": str(data), "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": "1",
           "RUBRICSEARCH_MODELS__DTYPE": "float32"}
    for name in ("RUBRICSEARCH_MODELS__EMBEDDING_MODEL", "RUBRICSEARCH_MODELS__RERANKER_MODEL",
                 "RUBRICSEARCH_MODELS__FALLBACK_TO_TEST_MODELS"):
        env.pop(name, None)
    proc = subprocess.Popen([sys.executable, "-m", "tests.demo_server_main", "500", "--port", str(port)],
                            cwd=Path(__file__).resolve().parents[1], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 240
        while not list((data / "demo-models").glob(".demo-train-*/base")):  # the child is training
            assert proc.poll() is None and time.monotonic() < deadline
            time.sleep(0.5)
        status = httpx.get(f"http://127.0.0.1:{port}/warmup", timeout=10).json()
        assert status["ready"] is False and status["progress"]["phase"] == "demo models training"
        proc.send_signal(2)
        out, _ = proc.communicate(timeout=90)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode in (0, 130), out
    assert "Traceback" not in out, out
    assert not list((data / "demo-models").glob(".demo-train-*")), "a half-trained model was left behind"
    assert str(data) not in subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True).stdout
