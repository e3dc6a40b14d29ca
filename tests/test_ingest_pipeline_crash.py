"""SIGKILL an ingestion worker that overlaps batches, commits in bulk and writes packages behind; resume.

Like ``tests/test_ingestion_crash.py`` (which drives the serial ``run_once`` loop), but the worker runs
``run_until_idle`` with everything the fast path adds. After the kills a last worker finishes the job: rows,
vectors, blobs and unique images must agree one to one, no temp file may remain, and every package file that
made it to disk must be valid. ``python -m tests.test_ingest_pipeline_crash --data DIR --model DIR`` is the worker.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.conftest import noise_png

REPO = Path(__file__).resolve().parents[1]
pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def worker_main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args(argv)
    from rubricsearch.indexer.jobs import IngestionRunner, IngestionService
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(args.data / "packages", storage_dtype="float32", write_behind=True, writer_threads=2)
    service = IngestionService.open_local(args.data, embedder=load_embedder(args.model, store=store))
    runner = IngestionRunner(service, worker_id="pipe-worker", batch_size=4, load_threads=2, max_attempts=10,
                             flush_interval_s=0.5, temp_grace_s=0, prefetch=2)
    report = runner.recover()
    print(f"READY released={report.released} reembedded={sum(r.reembedded for r in report.reconciled)}", flush=True)
    runner.run_until_idle()
    runner.close()
    _close(service)
    print("IDLE", flush=True)
    return 0


def _close(service: Any) -> None:
    service.close()
    service.index.close()
    service.catalog.dispose()


def _worker(data: Path, model: Path) -> subprocess.Popen[str]:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "tests.test_ingest_pipeline_crash", "--data", str(data),
                             "--model", str(model)], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _wait_line(proc: subprocess.Popen[str], prefix: str) -> bool:
    return any(line.startswith(prefix) for line in proc.stdout or [])


def test_sigkill_with_overlap_and_write_behind(tiny_embedding_dir: Path, tmp_path: Path) -> None:
    import rubricsearch.indexer.catalog as cat
    from rubricsearch.indexer.catalog import ImageStatus, JobState
    from rubricsearch.indexer.jobs import IngestionService
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.images import decode_image
    from rubricsearch.retrieval.packages import PackageStore
    from tests.test_ingestion import index_vectors
    from tests.test_ingestion_crash import temp_files

    data = tmp_path / "data"
    uploads = [(f"u{i}.png", noise_png(30 + i, 40 - i % 7, 3000 + i)) for i in range(44)]
    uploads += [(f"again{i}.png", uploads[i * 7][1]) for i in range(4)]
    unique = {decode_image(d).sha256: d for _, d in uploads}
    service = IngestionService.open_local(data)
    ref_set = service.create_set("crashy", embedding_dim=64)
    job = service.create_job_from_uploads(ref_set.id, uploads)
    _close(service)

    rng = random.Random(20261121)
    kills = 0
    for _ in range(3):
        proc = _worker(data, tiny_embedding_dir)
        assert _wait_line(proc, "READY"), proc.stderr.read() if proc.stderr else ""
        time.sleep(rng.uniform(0.2, 1.5))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        proc.wait(timeout=30)
    assert kills >= 1  # at least one worker died with batches in flight
    final = _worker(data, tiny_embedding_dir)
    assert _wait_line(final, "IDLE"), final.stderr.read() if final.stderr else ""
    assert final.wait(timeout=60) == 0

    service = IngestionService.open_local(data)
    try:
        job = service.get_job(job.id)
        assert job.state == JobState.SUCCEEDED and job.failed == 0 and job.done == len(unique)
        with service.catalog.read() as s:
            rows = cat.list_images(s, ref_set.id, limit=1000).items
        assert sorted(r.sha256 for r in rows) == sorted(unique) and {r.status for r in rows} == {ImageStatus.INDEXED}
        assert service.index.ids(ref_set.id) == set(unique) and set(service.blobs.iter_shas()) == set(unique)
        assert temp_files(data) == []
        embedder: Any = load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))
        shas = sorted(unique)
        expected = embedder.embed([{"image": unique[sha]} for sha in shas], dimensions=64)
        stored = index_vectors(service, ref_set.id)
        np.testing.assert_allclose(np.stack([stored[sha] for sha in shas]), expected, atol=1e-5, rtol=0)
        packages = PackageStore(data / "packages", storage_dtype="float32")  # whatever was written is valid
        fp = embedder.packages.fingerprint
        for sha in shas:
            got = packages.get(sha, fp)
            made = embedder.packages.get_or_encode([decode_image(unique[sha])])[0]
            assert got is None or got.grid_thw == made.grid_thw
        assert packages.stats()["corrupt"] == 0
    finally:
        _close(service)


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1:]))
