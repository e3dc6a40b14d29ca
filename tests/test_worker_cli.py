"""``rubricsearch worker``: exclusive stable ids, ``--once``, and a graceful SIGTERM in a real subprocess."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.app.cli.worker import WorkerLease, acquire_worker_id
from rubricsearch.indexer.catalog import Catalog, ItemState, JobState
from rubricsearch.indexer.jobs import IngestionService
from rubricsearch.retrieval.errors import Conflict
from tests.conftest import noise_png

REPO = Path(__file__).resolve().parents[1]
MAIN = "import sys; from rubricsearch.app.cli import main; sys.exit(main())"


def test_worker_ids_are_stable_and_exclusive(catalog: Catalog, tmp_path: Path) -> None:
    first, second, third = (WorkerLease(catalog, tmp_path / "workers") for _ in range(3))
    try:
        assert acquire_worker_id(first, None, hostname="box") == "box:0"
        assert acquire_worker_id(second, None, hostname="box") == "box:1"  # slot 0 is live
        with pytest.raises(Conflict):
            acquire_worker_id(third, "box:0")
        first.close()  # the process holding slot 0 ended
        assert acquire_worker_id(third, "box:0") == "box:0"
        assert acquire_worker_id(first, None, hostname="box") == "box:2"
    finally:
        for lease in (first, second, third):
            lease.close()


def worker_env(data: Path, model: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RUBRICSEARCH_")}
    env.update(
        PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
        RUBRICSEARCH_DATA_DIR=str(data), RUBRICSEARCH_MODELS__EMBEDDING_MODEL=str(model),
        RUBRICSEARCH_MODELS__DEVICE="cpu",
        RUBRICSEARCH_PACKAGES__STORAGE_DTYPE="float32", **extra,
    )
    return env


def start_worker(data: Path, model: Path, *args: str, **env: str) -> subprocess.Popen[str]:
    """``rubricsearch worker`` run from an empty directory (so no .env file is read)."""
    cwd = data.parent / "cwd"
    cwd.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", MAIN, "worker", *args], cwd=cwd, env=worker_env(data, model, **env),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def read_line(proc: subprocess.Popen[str], prefix: str) -> str:
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line; exit {proc.wait()}; stderr:\n{proc.stderr.read()[-3000:]}")  # type: ignore[union-attr]


def make_jobs(data: Path, n: int) -> tuple[str, list[str], set[str]]:
    """A set with an upload job of ``n`` images (plus repeats) and a zip job; returns set id, job ids, shas."""
    from rubricsearch.retrieval.images import decode_image
    from tests.test_ingestion import zip_of

    uploads = [(f"u{i}.png", noise_png(30 + i % 9, 28 + i % 7, seed=500 + i)) for i in range(n)]
    uploads += [(f"again{i}.png", uploads[i][1]) for i in range(3)]
    zipped = {f"z/{i}.png": noise_png(40, 24 + i, seed=900 + i) for i in range(4)}
    service = IngestionService.open_local(data)
    try:
        ref = service.create_set("cli", embedding_dim=64)
        jobs = [service.create_job_from_uploads(ref.id, uploads), service.create_job_from_zip(ref.id, zip_of(zipped))]
    finally:
        service.close()
        service.index.close()
        service.catalog.dispose()
    shas = {decode_image(d).sha256 for d in [d for _, d in uploads] + list(zipped.values())}
    return ref.id, [j.id for j in jobs], shas


def progress(catalog: Catalog, job_ids: list[str]) -> int:
    with catalog.read() as s:
        return sum(cat.get_job(s, j).processed for j in job_ids)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_sigterm_finishes_the_batch_then_once_resumes(tiny_embedding_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    set_id, job_ids, shas = make_jobs(data, 30)
    catalog = Catalog.open(f"sqlite:///{data / 'catalog.db'}")
    try:
        proc = start_worker(data, tiny_embedding_dir, "--batch-size", "2", "--poll-interval", "0.2")
        ready = read_line(proc, "READY")
        deadline = time.monotonic() + 120
        while progress(catalog, job_ids) < 1 and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.05)
        proc.send_signal(signal.SIGTERM)  # most likely mid-batch
        stopped = read_line(proc, "STOPPED")
        assert proc.wait(timeout=120) == 0, proc.stderr.read()  # type: ignore[union-attr]
        with catalog.read() as s:
            for job_id in job_ids:  # the batch in flight was finished, not abandoned
                assert not cat.list_items(s, job_id, states=[ItemState.CLAIMED])
        partial = progress(catalog, job_ids)

        again = start_worker(data, tiny_embedding_dir, "--once", "--threads", "2", "--batch-size", "3")
        ready_again = read_line(again, "READY")
        idle = read_line(again, "IDLE")
        assert again.wait(timeout=120) == 0, again.stderr.read()  # type: ignore[union-attr]
        print(ready, stopped, f"progress at stop: {partial}", ready_again, idle, sep="\n")
        worker_id = ready.split()[1]
        assert worker_id == ready_again.split()[1] and worker_id.endswith(":0")  # the same stable id
        assert "released=0" in ready_again  # nothing was left claimed

        with catalog.read() as s:
            jobs = [cat.get_job(s, j) for j in job_ids]
            items = [i for j in job_ids for i in cat.list_items(s, j, limit=1000)]
            rows = cat.list_images(s, set_id, limit=1000).items
        assert [j.state for j in jobs] == [JobState.SUCCEEDED] * 2
        assert all(i.attempts == 1 for i in items)  # no item was claimed twice
        assert sum(j.done for j in jobs) == len(shas) == len(rows)
        assert {r.sha256 for r in rows} == shas
    finally:
        catalog.dispose()
    service = IngestionService.open_local(data)
    try:
        assert service.index.ids(set_id) == shas
    finally:
        service.index.close()
        service.catalog.dispose()
