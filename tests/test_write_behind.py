"""The package store's write-behind (retrieval/packages/writer.py): files served before they are written,
published atomically, never resurrected by a delete, written from one host copy per batch and shared among the
writers, flushed up to the call (not behind later batches), bounded by back-pressure. No timing assertions."""

from __future__ import annotations

import gc
import threading
import time
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.timeout(300)


def _pkgs(n: int, start: int = 0) -> list[Any]:
    from rubricsearch.retrieval.packages import Fingerprint, VisualPackage

    fp = Fingerprint(tower="t" * 64, min_pixels=4096, max_pixels=1843200, patch_size=16, merge_size=2,
                     temporal_patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, resize="test")
    out = []
    for seed in range(start, start + n):
        g = torch.Generator().manual_seed(seed)
        out.append(VisualPackage(f"{seed:064x}", fp, (1, 4, 8), torch.randn(8, 32, generator=g),
                                 torch.randn(2, 8, 32, generator=g)))
    return out


def test_write_behind_serves_at_once_and_publishes_atomically(tmp_path: Path) -> None:
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", memory_bytes=0, write_behind=True, writer_threads=2)
    pkgs = _pkgs(40)
    for p in pkgs:
        store.put(p)
    for p in pkgs:  # no memory tier: served from the write queue or, once written, from disk
        got = store.get(p.image_sha256, p.fingerprint)
        assert got is not None and torch.equal(got.embeds, p.embeds) and torch.equal(got.deepstack, p.deepstack)
    assert store.flush(timeout=60)
    assert store.stats()["pending_writes"] == 0 and store.stats()["write_errors"] == 0
    assert not list(tmp_path.rglob("*.tmp"))
    fresh = PackageStore(tmp_path, storage_dtype="float32")
    for p in pkgs:
        got = fresh.get(p.image_sha256, p.fingerprint)
        assert got is not None and torch.equal(got.deepstack, p.deepstack) and got.grid_thw == (1, 4, 8)
    store.close()


def test_write_behind_delete_never_resurrects_a_file(tmp_path: Path) -> None:
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1)
    pkgs = _pkgs(30, start=100)
    for p in pkgs:
        store.put(p)
        if p.image_sha256.endswith(("0", "5")):
            store.delete_image(p.image_sha256)  # queued, being written, or written: gone either way
    store.flush(timeout=60)
    on_disk = {f.name.split(".")[0] for f in tmp_path.rglob("*.safetensors")}
    deleted = {p.image_sha256 for p in pkgs if p.image_sha256.endswith(("0", "5"))}
    assert deleted and on_disk == {p.image_sha256 for p in pkgs} - deleted
    assert all(store.get(sha, pkgs[0].fingerprint) is None for sha in deleted)
    store.close()


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "float32"])
def test_write_behind_batches_are_written_as_groups(tmp_path: Path, dtype: str) -> None:
    """put_many queues a tower batch as one group: every file holds exactly what the store serves, and a
    package deleted while its group waits is dropped alone."""
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype=dtype, write_behind=True, writer_threads=1)  # type: ignore[arg-type]
    batches = [_pkgs(12, start=300), _pkgs(12, start=400)]
    for batch in batches:
        store.put_many(batch)
    gone = batches[1][3].image_sha256
    store.delete_image(gone)
    assert store.flush(timeout=60) and store.stats()["write_errors"] == 0
    fresh = PackageStore(tmp_path, storage_dtype=dtype)  # type: ignore[arg-type]
    for p in (p for batch in batches for p in batch):
        hot, cold = store.get(p.image_sha256, p.fingerprint), fresh.get(p.image_sha256, p.fingerprint)
        if p.image_sha256 == gone:
            assert hot is None and cold is None
            continue
        assert hot is not None and cold is not None
        assert torch.equal(hot.embeds, cold.embeds) and torch.equal(hot.deepstack, cold.deepstack)
    assert fresh.stats()["disk_packages"] == 23
    hot = cold = None  # (float32 packages come back as the stored tensors themselves)
    held = [weakref.ref(t) for one in store._memory.values() for t in one.tensors().values()]
    for p in (p for batch in batches for p in batch):
        store.delete_image(p.image_sha256)
    gc.collect()
    assert held and not [r for r in held if r() is not None]  # an idle writer keeps no batch alive
    store.close()


def test_write_behind_a_failed_copy_loses_only_its_package(tmp_path: Path, monkeypatch: Any) -> None:
    """A batch whose copy to the host fails is copied package by package; one that fails again loses its file
    alone (an error counted; it is still served from memory)."""
    from rubricsearch.retrieval.packages import PackageStore
    from rubricsearch.retrieval.packages.storage_form import Joint
    from rubricsearch.retrieval.packages.writer import WriteBehind

    pkgs = _pkgs(6, start=500)
    copy = WriteBehind._host_copy

    def flaky(job: Any, ready: Any, stream: Any) -> Any:
        if job.path.name.startswith(pkgs[2].image_sha256):
            raise OSError("no host memory")
        return copy(job, ready, stream)

    monkeypatch.setattr(WriteBehind, "_host_copy", staticmethod(flaky))
    split = Joint.split

    def joint_copy_fails(self: Any, tensors: Any = None) -> Any:
        if tensors is not None:  # the writer's cut of its host copy: the batch falls back to one by one
            raise OSError("no pinned memory")
        return split(self)

    monkeypatch.setattr(Joint, "split", joint_copy_fails)
    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1)
    store.put_many(pkgs)
    assert store.flush(timeout=60) and store.stats()["write_errors"] == 1
    assert {f.name.split(".")[0] for f in tmp_path.rglob("*.safetensors")} == {
        p.image_sha256 for p in pkgs if p is not pkgs[2]}
    assert store.get(pkgs[2].image_sha256, pkgs[2].fingerprint) is not None  # still served from memory
    store.close()


def test_write_behind_back_pressure_bounds_the_queue(tmp_path: Path) -> None:
    from rubricsearch.retrieval.packages import PackageStore

    one = _pkgs(1)[0].nbytes
    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1,
                         max_pending_bytes=3 * one)
    for p in _pkgs(20, start=200):
        store.put(p)
        assert store.stats()["pending_writes"] <= 3
    store.close()
    assert store.stats()["disk_packages"] == 20


class _Waiting(threading.Condition):
    """The write-behind's condition, noting when somebody waits on it (a flush that has taken its mark)."""

    def __init__(self, lock: Any) -> None:
        super().__init__(lock)
        self.waiting = threading.Event()

    def wait(self, timeout: float | None = None) -> bool:
        self.waiting.set()
        return super().wait(timeout)


def _flush_in_background(store: Any) -> tuple[threading.Thread, list[bool]]:
    """A flush on a thread of its own, returned once it waits (its mark taken)."""
    behind = store._behind
    behind._changed = _Waiting(behind._lock)
    done: list[bool] = []
    flusher = threading.Thread(target=lambda: done.append(store.flush(timeout=30)))
    flusher.start()
    assert behind._changed.waiting.wait(30)
    return flusher, done


def _on_disk(root: Path) -> set[str]:
    return {f.name.split(".")[0] for f in root.rglob("*.safetensors")}


def test_a_batch_is_written_by_several_writers(tmp_path: Path, monkeypatch: Any) -> None:
    """The writer that copies a batch to the host hands most of its files on: with one writer per batch, the
    batch's sync waited for 64 files behind one thread. Fails if one thread writes them all (its first file
    waits for a file written by another thread)."""
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=4)
    write_tmp, names, other = store._behind._write_tmp, [], threading.Event()

    def slow(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
        name = threading.current_thread().name
        names.append(name)
        if name != names[0]:
            other.set()
        elif not other.wait(30):
            raise TimeoutError("no other writer wrote a file of the batch")
        return write_tmp(path, tensors, meta)

    monkeypatch.setattr(store._behind, "_write_tmp", slow)
    pkgs = _pkgs(16, start=600)
    store.put_many(pkgs)
    assert store.flush(timeout=60) and store.stats()["write_errors"] == 0
    assert len(set(names)) >= 2
    assert _on_disk(tmp_path) == {p.image_sha256 for p in pkgs}
    store.close()


def test_flush_waits_for_everything_queued_before_it(tmp_path: Path, monkeypatch: Any) -> None:
    """The other half of the watermark: a flush does wait for every batch queued before it, the last one too."""
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=2)
    write_tmp, later, release = store._behind._write_tmp, _pkgs(3, start=800), threading.Event()
    held = {p.image_sha256 for p in later}

    def gated(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
        if path.name.split(".")[0] in held:
            assert release.wait(30)
        return write_tmp(path, tensors, meta)

    monkeypatch.setattr(store._behind, "_write_tmp", gated)
    first, last = _pkgs(5, start=700), _pkgs(2, start=900)
    store.put_many(first)
    assert store.flush(timeout=60)
    store.put_many(later)  # its files wait for ``release``
    store.put_many(last)
    assert not store.flush(timeout=0.5)  # queued before: the later batch, still held
    release.set()
    assert store.flush(timeout=60)
    assert _on_disk(tmp_path) == {p.image_sha256 for p in first + later + last}  # the last batch too
    store.close()


def test_flush_returns_while_a_later_batch_is_still_written(tmp_path: Path, monkeypatch: Any) -> None:
    """The batch queued after a flush began is still being written when the flush returns, its own files all
    published. Fails if flush waits for every queued file."""
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=4)
    write_tmp, release, gate_first = store._behind._write_tmp, threading.Event(), threading.Event()
    first, later = _pkgs(2, start=1000), _pkgs(4, start=1100)
    held = {p.image_sha256 for p in later}

    def gated(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
        if path.name.split(".")[0] in held:
            assert release.wait(30)
        elif not gate_first.wait(30):
            raise TimeoutError
        return write_tmp(path, tensors, meta)

    monkeypatch.setattr(store._behind, "_write_tmp", gated)
    store.put_many(first)
    flusher, done = _flush_in_background(store)
    store.put_many(later)  # after the flush took its mark
    gate_first.set()
    flusher.join(30)
    assert done == [True]  # the first batch's files are published; the later ones still wait
    assert _on_disk(tmp_path) == {p.image_sha256 for p in first}
    release.set()
    assert store.flush(timeout=60)
    store.close()


def test_a_flush_waits_for_the_write_that_replaced_one_it_waits_for(tmp_path: Path, monkeypatch: Any) -> None:
    """A package queued again while its first write is under way (the next batch made it once more) drops that
    write: a flush that waited for it must wait for the replacement, or the catalog would record a package whose
    file is not written yet. Fails if the replacement counts only for later flushes."""
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=1)
    write_tmp, calls, entered = store._behind._write_tmp, [], threading.Event()
    releases = [threading.Event(), threading.Event()]

    def gated(path: Path, tensors: dict[str, torch.Tensor], meta: dict[str, str]) -> Path:
        calls.append(path)
        entered.set()
        assert releases[len(calls) - 1].wait(30)
        return write_tmp(path, tensors, meta)

    monkeypatch.setattr(store._behind, "_write_tmp", gated)
    pkg = _pkgs(1, start=1200)[0]
    store.put_many([pkg])
    assert entered.wait(30)  # the first write is under way
    flusher, done = _flush_in_background(store)
    store.put_many([pkg])  # queued again: the first write is dropped once it ends
    releases[0].set()
    flusher.join(0.5)
    assert done == []  # still waiting for the replacement
    releases[1].set()
    flusher.join(30)
    assert done == [True] and _on_disk(tmp_path) == {pkg.image_sha256}
    store.close()


def test_submits_racing_past_back_pressure_keep_their_own_tickets(tmp_path: Path) -> None:
    """Two threads submitting while the queue is full (ingestion's pack stage and a tower's lone put) each wait,
    then queue: every write ends, its accounting clears and a flush after them all returns. Fails if a write's
    ticket is taken before the wait (it then belongs to another submit, and its writer dies on the count)."""
    from rubricsearch.retrieval.packages import PackageStore

    one = _pkgs(1)[0].nbytes
    store = PackageStore(tmp_path, storage_dtype="float32", write_behind=True, writer_threads=2,
                         max_pending_bytes=2 * one)
    batches = [_pkgs(2, start=1300 + 10 * k) for k in range(8)]
    submitters = [threading.Thread(target=store.put_many, args=(batch,)) for batch in batches]
    for t in submitters:
        t.start()
    deadline = time.monotonic() + 60
    for t in submitters:
        t.join(max(0.0, deadline - time.monotonic()))
    assert not [t for t in submitters if t.is_alive()]  # (with a writer dead, they wait for room for ever)
    assert store.flush(timeout=60) and store.stats()["write_errors"] == 0
    assert not store._behind._left and store.stats()["pending_writes"] == 0
    assert _on_disk(tmp_path) == {p.image_sha256 for batch in batches for p in batch}
    store.close()


def test_a_put_while_the_writers_stop_neither_hangs_close_nor_is_lost(tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """A put that comes while close() is stopping the writers (it has queued their stops, not joined them) must not
    start writers that could take those stops (an old writer would then never stop, and close would wait for it for
    ever); its file is still written: by an old writer, or (when the put comes after the last join) by writers close
    starts once the old ones are gone. Without the guard the first case hangs in most rounds (which writer takes a
    stop is up to the scheduler); without the restart the second never writes its file."""
    from rubricsearch.retrieval.packages import PackageStore

    for round_ in range(8):
        root = tmp_path / str(round_)
        store = PackageStore(root, storage_dtype="float32", write_behind=True, writer_threads=3)
        first, late = _pkgs(2, start=1500 + 10 * round_)
        store.put(first)
        assert store.flush(timeout=60)
        behind = store._behind
        injected: list[threading.Thread] = []

        def late_put(store: Any = store, late: Any = late, injected: list[threading.Thread] = injected) -> None:
            if not injected:
                injected.append(threading.Thread(target=store.put, args=(late,)))
                injected[0].start()
                injected[0].join(30)

        if round_ % 2 == 0:  # at the first stop, the old writers alive
            real_put = behind._queue.put
            monkeypatch.setattr(behind._queue, "put", lambda item, *a, real_put=real_put, late_put=late_put: (
                late_put() if item[3] is None else None, real_put(item, *a))[1])
        else:  # after the last old writer is joined
            last = behind._writers[-1]
            real_join = last.join
            monkeypatch.setattr(last, "join", lambda *a, real_join=real_join, late_put=late_put: (
                real_join(*a), late_put())[0])
        closer = threading.Thread(target=store.close, daemon=True)
        closer.start()
        closer.join(20)
        assert not closer.is_alive(), f"close() hung in round {round_}"
        monkeypatch.undo()
        assert injected and not injected[0].is_alive()
        assert store.flush(timeout=20) and _on_disk(root) == {first.image_sha256, late.image_sha256}
        store.close()
