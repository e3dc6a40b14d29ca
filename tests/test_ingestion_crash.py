"""Crash safety: SIGKILL an ingestion worker at random points, resume in new processes, check the result.

After every kill a new process recovers (own claims back, leftovers swept, index reconciled) and goes on;
at the end catalog rows, index vectors and unique images must agree one to one, with no temp files left.
"""

from __future__ import annotations

import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import ImageStatus, JobState
from rubricsearch.indexer.jobs import IngestionService
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore
from tests.conftest import noise_png
from tests.test_ingestion import index_vectors, zip_of

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
REPO = Path(__file__).resolve().parents[1]
SEED = 20240611


class Worker:
    """One worker subprocess whose stdout lines arrive on a queue."""

    def __init__(self, data: Path, model: Path, *args: str) -> None:
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.ingest_worker_main", "--data", str(data), "--model", str(model), *args],
            cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        self.seen: list[str] = []
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line.strip())
        self.lines.put(None)

    def wait_for(self, prefix: str, timeout: float = 120.0) -> bool:
        """True once a line starting with ``prefix`` arrives; False if the process ended first."""
        deadline = time.monotonic() + timeout
        while (left := deadline - time.monotonic()) > 0:
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                break
            if line is None:
                return False
            self.seen.append(line)
            if line.startswith(prefix):
                return True
        raise AssertionError(f"worker printed no {prefix!r} within {timeout}s")

    def kill(self) -> bool:
        """SIGKILL; True if it was still running (a real crash, not a clean exit)."""
        alive = self.proc.poll() is None
        if alive:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=30)
        return alive

    def stderr(self) -> str:
        assert self.proc.stderr is not None
        return self.proc.stderr.read()


def temp_files(data: Path) -> list[Path]:
    found = [p for p in (data / "blobs" / "tmp").iterdir()]
    found += list((data / "staging").iterdir())
    found += [p for p in data.rglob("*") if p.name.endswith((".tmp", ".part"))]
    return found


def test_sigkill_at_random_points_then_resume(tiny_embedding_dir: Path, tmp_path: Path) -> None:
    data = tmp_path / "data"
    uploads = [(f"u{i}.png", noise_png(36 + i, 44 - i % 5, seed=1000 + i)) for i in range(34)]
    uploads += [(f"dup{i}.png", uploads[i * 5][1]) for i in range(6)]  # 40 items, 34 unique
    zipped = {f"z/{i}.png": noise_png(50, 20 + i, seed=2000 + i) for i in range(5)}
    zipped.update({f"z/again{i}.png": uploads[i][1] for i in range(3)})  # 3 already in the uploads
    unique = {decode_image(d).sha256: d for d in [d for _, d in uploads] + list(zipped.values())}
    assert len(unique) == 39

    service = IngestionService.open_local(data)
    ref_set = service.create_set("crashy", embedding_dim=64)
    jobs = [service.create_job_from_uploads(ref_set.id, uploads),
            service.create_job_from_zip(ref_set.id, zip_of(zipped))]
    service.close()
    service.index.close()
    service.catalog.dispose()

    rng = random.Random(SEED)
    crashes = []
    recoveries: list[str] = []
    for _ in range(3):  # 48 items in batches of 4: three runs of <= 3 batches each cannot finish them
        worker = Worker(data, tiny_embedding_dir)
        assert worker.wait_for("READY")
        batches = rng.randint(0, 2)
        delay = rng.uniform(0.0, 0.15)  # the overlapped pipeline can finish 40 items in 0.6 s
        finished = any(not worker.wait_for("BATCH") for _ in range(batches))
        if not finished:
            time.sleep(delay)
        if worker.kill():
            crashes.append((batches, round(delay, 2)))
        recoveries.extend(line for line in worker.seen if line.startswith("READY"))
    assert len(crashes) == 3, crashes

    final = Worker(data, tiny_embedding_dir)
    assert final.wait_for("IDLE", timeout=240), final.stderr()
    assert final.proc.wait(timeout=60) == 0, final.stderr()
    recoveries.extend(line for line in final.seen if line.startswith("READY"))
    print("kills (batches waited, delay s):", crashes, "\nrecoveries:", *recoveries, sep="\n  ")

    service = IngestionService.open_local(data)
    try:
        for job in jobs:
            job = service.get_job(job.id)
            assert job.state == JobState.SUCCEEDED, (job, crashes)
            assert job.failed == 0 and job.done + job.skipped == job.total
        assert sum(service.get_job(j.id).done for j in jobs) == 39
        with service.catalog.read() as s:
            rows = cat.list_images(s, ref_set.id, limit=1000).items
        assert sorted(r.sha256 for r in rows) == sorted(unique)  # one row per unique image
        assert {r.status for r in rows} == {ImageStatus.INDEXED}
        assert service.index.ids(ref_set.id) == set(unique) and service.index.count(ref_set.id) == 39
        assert set(service.blobs.iter_shas()) == set(unique)
        assert temp_files(data) == []

        # Whatever was re-done or re-embedded by reconcile, every vector is the right one.
        embedder = load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))
        shas = sorted(unique)
        expected = embedder.embed([{"image": unique[sha]} for sha in shas], dimensions=64)
        stored = index_vectors(service, ref_set.id)
        np.testing.assert_allclose(np.stack([stored[sha] for sha in shas]), expected, atol=1e-5, rtol=0)
    finally:
        service.index.close()
        service.catalog.dispose()
