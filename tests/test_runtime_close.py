"""Closing a local runtime stops and joins every thread it started (LM workers, the tower's preprocessing pool):
a daemon thread of ours still running at interpreter exit is torn down under torch's C++ threads, which aborted
a bench with ``terminate called without an active exception`` after its last output."""

from __future__ import annotations

import threading
from pathlib import Path

from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.images import EncodedImage
from rubricsearch.retrieval.qwen.model.prompts import Content
from tests.fixtures_images import BLUE, RED, png


def _started_since(before: set[threading.Thread]) -> list[str]:
    return sorted(t.name for t in threading.enumerate() if t not in before and t.is_alive())


def test_closed_runtime_leaves_no_thread(tiny_embedding_dir: Path) -> None:
    before = set(threading.enumerate())
    with load_embedder(tiny_embedding_dir, device="cpu", lm_workers=2) as embedder:
        images = [EncodedImage(png(color=RED)), EncodedImage(png(64, 64, color=BLUE))]
        embedder.embed_contents([Content(images=[im]) for im in images], [None, None])
        embedder.embed(["a red square", "a blue square"])
        running = _started_since(before)
        # the threads this test is about exist while the model is open
        assert "lm-scheduler" in running and any(n.startswith("vision-preprocess") for n in running), running
    assert _started_since(before) == []
    # closed is not broken: a later call starts the workers again, and closing again stops them
    embedder.embed(["a red square"])
    assert "lm-scheduler" in _started_since(before)
    embedder.close()
    assert _started_since(before) == []
