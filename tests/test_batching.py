"""Cross-request batching: concurrent requests share forward passes, results equal unbatched ones, a large
request cannot stall a small one, and a failing request fails alone."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.qwen.engine.batching import LMScheduler, default_workers
from rubricsearch.retrieval.qwen.engine.forward import LMInput


@pytest.fixture(scope="module")
def emb(tiny_embedding_dir: Path) -> Any:
    return load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))


def items(n: int, tag: str) -> list[dict[str, str]]:
    return [{"text": f"{tag} {'cat ' * (1 + i % 7)}", "instruction": f"Find {tag} {i}"} for i in range(n)]


def test_concurrent_requests_merge_and_equal_unbatched(emb: Any) -> None:
    requests = [items(1 + i % 3, f"r{i}") for i in range(16)]
    alone = [emb.embed(r) for r in requests]  # one request at a time
    before = dict(emb.runtime.scheduler.counters)
    emb.runtime.scheduler.max_wait_s = 0.05  # generous, so the 16 threads below surely overlap
    results: list[Any] = [None] * len(requests)
    start = threading.Barrier(len(requests))

    def client(i: int) -> None:
        start.wait()
        results[i] = emb.embed(requests[i])

    threads = [threading.Thread(target=client, args=(i,)) for i in range(len(requests))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    emb.runtime.scheduler.max_wait_s = 0.003
    for got, want in zip(results, alone, strict=True):
        assert np.abs(got - want).max() <= 1e-6
    after = emb.runtime.scheduler.counters
    rows = after["rows"] - before["rows"]
    passes = after["passes"] - before["passes"]
    assert rows == sum(len(r) for r in requests) and passes < len(requests)  # shared passes, not one per request
    assert after["merged_passes"] > before["merged_passes"]


def test_a_large_request_does_not_stall_a_small_one(emb: Any) -> None:
    scheduler = emb.runtime.scheduler
    big = items(400, "big")
    done: dict[str, float] = {}

    def run(name: str, work: list[dict[str, str]]) -> None:
        emb.embed(work)
        done[name] = time.monotonic()

    large = threading.Thread(target=run, args=("large", big))
    large.start()
    while scheduler.depth() == 0:  # the large request is queued
        time.sleep(0.001)
    run("small", items(1, "small"))
    large.join()
    assert done["small"] < done["large"]  # the one-item request got into an early pass


def test_a_failing_request_fails_alone(emb: Any) -> None:
    bad = [LMInput(ids=[10**9], packages=[])]  # an id outside the vocabulary: the pass raises
    with pytest.raises(Exception):  # noqa: B017 - whatever torch raises for the bad index
        emb.runtime.scheduler.run(bad)
    assert emb.embed(items(2, "after")).shape == (2, emb.dimension)  # the worker survived


@pytest.mark.parametrize("workers", [1, 2])
def test_cpu_workers_run_passes_side_by_side(emb: Any, workers: int) -> None:
    """With two workers two requests' passes run at the same time (each waits at a barrier for the other);
    with one they cannot, and the barrier breaks."""
    scheduler = LMScheduler(emb.runtime.loaded, emb.runtime.pad_id, max_batch=1, max_tokens=10**6, workers=workers)
    meet = threading.Barrier(2, timeout=3.0)
    plain = scheduler._plain

    def meeting(loaded: Any, batch: list[LMInput], pad_id: int) -> Any:
        meet.wait()
        return plain(loaded, batch, pad_id)

    scheduler._plain = meeting
    inputs = [LMInput(ids=[11, 12, 13 + i], packages=[]) for i in range(2)]
    errors: list[BaseException] = []

    def one(i: int) -> None:
        try:
            scheduler.run([inputs[i]])
        except BaseException as exc:  # the broken barrier fails the request, not the worker
            errors.append(exc)

    threads = [threading.Thread(target=one, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if workers == 2:
        assert not errors and scheduler.counters["passes"] == 2
    else:
        assert errors and all(isinstance(e, threading.BrokenBarrierError) for e in errors)


def test_default_workers_follow_the_device() -> None:
    assert default_workers(torch.device("cpu")) == len(os.sched_getaffinity(0))
    assert default_workers(torch.device("cuda")) == 1


def test_a_pass_writes_back_one_copy_per_run_of_consecutive_items() -> None:
    """A pass's rows go back to their requests as runs (one copy each); the runs cover every row exactly."""
    from rubricsearch.retrieval.qwen.engine.batching import _Request, _runs

    a, b = (_Request([], torch.empty(0)) for _ in range(2))
    picks = [(a, 0), (a, 1), (a, 2), (b, 0), (a, 3), (b, 1), (b, 2), (a, 5)]
    assert [(first, stop, r is a, index) for first, stop, r, index in _runs(picks)] == [
        (0, 3, True, 0), (3, 4, False, 0), (4, 5, True, 3), (5, 7, False, 1), (7, 8, True, 5)]
    assert [(first, stop) for first, stop, *_ in _runs([(a, i) for i in range(64)])] == [(0, 64)]


def _queued_while_locked(vision: Any, jobs: list[Any]) -> list[Any]:
    """Start one thread per job while the tower is busy (its lock held here), so they queue; then release."""
    results: list[Any] = [None] * len(jobs)

    def run(i: int) -> None:
        try:
            results[i] = jobs[i]()
        except Exception as exc:
            results[i] = exc

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(jobs))]
    with vision._batcher._lock:
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(vision._batcher._queue) < len(jobs) and time.monotonic() < deadline:
            time.sleep(0.001)
        assert len(vision._batcher._queue) == len(jobs), "the requests did not queue"
    for t in threads:
        t.join()
    return results


def test_concurrent_tower_requests_share_one_pass(tiny_embedding_dir: Path, make_png: Any) -> None:
    """Concurrent searches' candidate images run in one tower pass, with the packages each would get alone."""
    from rubricsearch.retrieval.images import decode_image
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    vision = VisionEncoder(load_qwen(str(tiny_embedding_dir), device="cpu", dtype="float32"))
    images = [decode_image(make_png(48 + 16 * (i % 3), 64, seed=500 + i)) for i in range(5)]
    alone = [vision.encode([im])[0] for im in images]
    before = vision.stats()
    merged = _queued_while_locked(vision, [lambda im=im: vision.encode([im])[0] for im in images])
    after = vision.stats()
    assert after["tower_batches"] - before["tower_batches"] == 1  # five requests, one pass
    assert after["merged_chunks"] - before["merged_chunks"] == 5
    for got, want in zip(merged, alone, strict=True):
        assert got.image_sha256 == want.image_sha256 and got.grid_thw == want.grid_thw
        assert (got.embeds - want.embeds).abs().max() <= 1e-5
        assert (got.deepstack - want.deepstack).abs().max() <= 1e-5


def test_a_bad_tower_chunk_fails_alone(tiny_embedding_dir: Path, make_png: Any) -> None:
    """A merged pass that fails is retried chunk by chunk: the good request still gets its package."""
    from rubricsearch.retrieval.images import decode_image
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    vision = VisionEncoder(load_qwen(str(tiny_embedding_dir), device="cpu", dtype="float32"))
    good = decode_image(make_png(64, 64, seed=7))
    pixels, grids = vision.preprocess([good])
    grid = tuple(int(x) for x in grids[0])
    bad_grid = (grid[0], grid[1] * 2, grid[2])  # claims twice the patches it has: the tower raises
    results = _queued_while_locked(vision, [
        lambda: vision._batcher.run(pixels, [bad_grid], ["0" * 64]),
        lambda: vision.encode([good])[0],
    ])
    assert isinstance(results[0], Exception)
    assert not isinstance(results[1], Exception), results[1]
    assert results[1].image_sha256 == good.sha256


def test_lm_workers_option_reaches_both_schedulers(tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                                    tmp_path: Path) -> None:
    """The Python API's option sets the workers (a bench varies them); the server's models run the default."""
    from rubricsearch.app.model_loading import model_config
    from rubricsearch.app.settings import Settings
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval.packages import VisualPackages

    packages = VisualPackages(PackageStore(storage_dtype="float32"))
    with load_embedder(str(tiny_embedding_dir), dtype="float32", lm_workers=3, packages=packages) as emb, \
            load_reranker(str(tiny_reranker_dir), dtype="float32", lm_workers=3, packages=packages) as rr:
        assert emb.runtime.scheduler.workers == 3 and rr.runtime.scheduler.workers == 3
    served = model_config(Settings(data_dir=tmp_path, models={"dtype": "float32"}), "embedding", "local")
    with load_embedder(str(tiny_embedding_dir), served, packages=packages) as fresh:
        assert fresh.runtime.scheduler.workers == default_workers(torch.device("cpu"))


def test_more_than_one_worker_is_refused_off_the_cpu() -> None:
    """A GPU's passes share one stream and its graphs' static inputs: a second worker would overwrite them."""
    from types import SimpleNamespace

    from rubricsearch.retrieval.errors import InvalidInput

    on_gpu: Any = SimpleNamespace(device=torch.device("cuda"))
    with pytest.raises(InvalidInput, match="only on a CPU"):
        LMScheduler(on_gpu, 0, max_batch=8, max_tokens=1024, workers=2)


def _texts(emb: Any, n: int, tag: str) -> list[LMInput]:
    """Text-only LM inputs of distinct lengths (so a row given to the wrong request shows)."""
    ids = emb.runtime.loaded.processor.tokenizer(f"{tag} " + "word " * 40)["input_ids"]
    return [LMInput(ids=list(ids[: 3 + 2 * i + len(tag)]), packages=[]) for i in range(n)]


def test_one_pass_of_interleaved_requests_gives_each_its_own_rows(emb: Any) -> None:
    """Picks of three requests in a scrambled order, run as one merged pass on this thread (no worker threads,
    no timing): every request gets exactly the rows it would get alone, each in its own input order."""
    from rubricsearch.retrieval.qwen.engine.batching import _Request

    scheduler = LMScheduler(emb.runtime.loaded, emb.runtime.pad_id, max_batch=64, max_tokens=10**6, workers=1)
    inputs = {tag: _texts(emb, n, tag) for tag, n in (("a", 4), ("bb", 3), ("ccc", 2))}
    alone = {tag: torch.stack([scheduler._plain(emb.runtime.loaded, [x], emb.runtime.pad_id)[0] for x in xs])
             for tag, xs in inputs.items()}
    requests = {tag: _Request(xs, torch.full((len(xs), emb.runtime.loaded.hidden_size), float("nan")), left=len(xs))
                for tag, xs in inputs.items()}
    a, b, c = requests.values()
    picks = [(b, 1), (a, 0), (a, 1), (c, 0), (b, 0), (a, 3), (a, 2), (c, 1), (b, 2)]
    scheduler._run_batch(picks)
    for tag, request in requests.items():
        assert request.done.is_set() and request.error is None and request.left == 0
        torch.testing.assert_close(request.out, alone[tag].to(torch.float32), rtol=0, atol=1e-5)


def test_the_fair_pick_hands_each_request_its_next_items(emb: Any) -> None:
    """``_pick`` over queued requests (no worker started): round-robin, each request's items in order, and the
    pass built from the picks fills every request's rows with its own results."""
    from rubricsearch.retrieval.qwen.engine.batching import _Request

    scheduler = LMScheduler(emb.runtime.loaded, emb.runtime.pad_id, max_batch=5, max_tokens=10**6, workers=1)
    inputs = [_texts(emb, n, tag) for tag, n in (("p", 3), ("qq", 1), ("rrr", 4))]
    requests = [_Request(xs, torch.full((len(xs), emb.runtime.loaded.hidden_size), float("nan")), left=len(xs))
                for xs in inputs]
    scheduler._requests.extend(requests)
    picks = scheduler._pick()
    assert [(requests.index(r), i) for r, i in picks] == [(0, 0), (1, 0), (2, 0), (0, 1), (2, 1)]
    scheduler._run_batch(picks)
    while picks := scheduler._pick():
        scheduler._run_batch(picks)
    for request, xs in zip(requests, inputs, strict=True):
        want = torch.stack([scheduler._plain(emb.runtime.loaded, [x], emb.runtime.pad_id)[0]
                            for x in xs]).to(torch.float32)
        assert request.done.is_set()
        torch.testing.assert_close(request.out, want, rtol=0, atol=1e-5)
