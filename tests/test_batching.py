"""Cross-request batching: concurrent requests share forward passes, results equal unbatched ones, a large
request cannot stall a small one, and a failing request fails alone."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from retrieval import load_embedder
from retrieval.packages import PackageStore
from retrieval.qwen.forward import LMInput


@pytest.fixture(scope="module")
def emb(tiny_embedding_dir: Path) -> Any:
    return load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))


def items(n: int, tag: str) -> list[dict[str, str]]:
    return [{"text": f"{tag} {'cat ' * (1 + i % 7)}", "instruction": f"Find {tag} {i}"} for i in range(n)]


def test_concurrent_requests_merge_and_equal_unbatched(emb: Any) -> None:
    requests = [items(1 + i % 3, f"r{i}") for i in range(16)]
    alone = [emb.embed(r) for r in requests]  # one request at a time
    before = dict(emb.scheduler.counters)
    emb.scheduler.max_wait_s = 0.05  # generous, so the 16 threads below surely overlap
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
    emb.scheduler.max_wait_s = 0.003
    for got, want in zip(results, alone, strict=True):
        assert np.abs(got - want).max() <= 1e-6
    after = emb.scheduler.counters
    rows = after["rows"] - before["rows"]
    passes = after["passes"] - before["passes"]
    assert rows == sum(len(r) for r in requests) and passes < len(requests)  # shared passes, not one per request
    assert after["merged_passes"] > before["merged_passes"]


def test_a_large_request_does_not_stall_a_small_one(emb: Any) -> None:
    scheduler = emb.scheduler
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
        emb.scheduler.run(bad)
    assert emb.embed(items(2, "after")).shape == (2, emb.dimension)  # the worker survived
