"""A full disk is a state, not a crash: the data directory on a small tmpfs that the test mounts (and removes),
filled to the last byte. Writes that need space get 507, deletes still work, the running job pauses with its
reason in the job and in /readyz, and once space is freed it resumes without marking a good item failed.
Skipped where mounting is not permitted."""

from __future__ import annotations

import contextlib
import errno
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from rubricsearch.indexer.jobs import IngestionRunner
from tests.api_helpers import ADMIN_KEY, api_settings, bearer
from tests.conftest import noise_png

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]
ADMIN = bearer(ADMIN_KEY)


@pytest.fixture
def small_disk() -> Iterator[Path]:
    mount = Path(tempfile.mkdtemp(prefix="rs-full-"))
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=48m", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()


def fill(path: Path) -> None:
    """Write ``path`` until the filesystem has no byte left."""
    block = b"\xff" * (1 << 20)
    with open(path, "wb", buffering=0) as f:
        for size in (1 << 20, 1 << 12, 1):
            with contextlib.suppress(OSError):
                while f.write(block[:size]):
                    pass
        with pytest.raises(OSError) as full:
            f.write(b"x")
        assert full.value.errno == errno.ENOSPC


def wait_for(check, timeout: float = 60.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while not check():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.1)


def test_a_full_disk_pauses_ingestion_and_answers_507(small_disk: Path, tiny_embedding_dir: Path,
                                                       tiny_reranker_dir: Path) -> None:
    settings = api_settings(small_disk / "data", tiny_embedding_dir, tiny_reranker_dir, ingest={"workers": 0},
                            packages={"memory_bytes": 0})
    state = AppState.build(settings)
    runner = IngestionRunner(state.ingestion, worker_id="full-disk", batch_size=4, poll_interval_s=0.2)
    try:
        client = TestClient(create_app(settings, state=state), raise_server_exceptions=False)
        assert client.post("/v1/sets", json={"name": "full", "dimensions": 64}, headers=ADMIN).status_code == 201
        first = [("files", (f"a{i}.png", noise_png(64, 64, seed=300 + i), "image/png")) for i in range(4)]
        job = client.post("/v1/sets/full/images", files=first, headers=ADMIN).json()
        runner.run_until_idle()
        assert client.get(f"/v1/jobs/{job['id']}").json()["done"] == 4
        later = [("files", (f"b{i}.png", noise_png(160, 160, seed=400 + i), "image/png")) for i in range(12)]
        job = client.post("/v1/sets/full/images", files=later, headers=ADMIN).json()

        fill(small_disk / "filler")
        with open(small_disk / "filler", "r+b") as f:  # room for the catalog's claims, not for the blobs
            f.truncate(f.seek(0, 2) - 300_000)
        runner.start()
        wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["paused"] is not None)
        shown = client.get(f"/v1/jobs/{job['id']}").json()
        assert "disk is full" in shown["paused"] and shown["state"] in ("queued", "running")
        ready = client.get("/readyz")
        assert ready.status_code == 503 and "disk is full" in ready.json()["error"]["message"]

        upload = client.post("/v1/sets/full/images", files=first[:1], headers=ADMIN)
        assert upload.status_code == 507, upload.text
        assert upload.json()["error"]["type"] == "insufficient_storage"
        created = client.post("/v1/sets", json={"name": "another"}, headers=ADMIN)
        assert created.status_code in (201, 507), created.text  # SQLite may still have room in its pages
        listed = client.get("/v1/sets/full/images").json()["data"]
        deleted = client.delete(f"/v1/sets/full/images/{listed[0]['sha256']}", headers=ADMIN)
        assert deleted.status_code == 204, deleted.text

        (small_disk / "filler").unlink()
        wait_for(lambda: client.get(f"/v1/jobs/{job['id']}").json()["state"] == "succeeded")
        final = client.get(f"/v1/jobs/{job['id']}").json()
        assert (final["done"], final["failed"], final["paused"]) == (12, 0, None), final
        assert client.get("/readyz").status_code == 200
        attempts = [i.attempts for i in state.ingestion.job_items(job["id"], limit=100)]
        assert attempts == [1] * 12  # the batches the full disk stopped cost their items no attempt
    finally:
        runner.stop(10)
        runner.processor.close()
        state.close()
