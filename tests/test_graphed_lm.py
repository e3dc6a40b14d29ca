"""The capturable decoder pass behind ``LocalConfig.cuda_graphs`` equals the transformers LM pass the product
runs otherwise. It runs eagerly here (no GPU); ``tests/test_gpu.py`` replays it as CUDA graphs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.retrieval.embedding.task import EMBED_MAX_LENGTH
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.plugins.accelerated.graphed_lm import (
    BULK_TOKENS,
    GraphedLM,
    decoder_pass,
    prepare,
    shape_of,
)
from rubricsearch.retrieval.plugins.accelerated.packed import (
    PackKey,
    last_token_inputs,
    last_token_pass,
    pack_key,
    segment_lengths,
)
from rubricsearch.retrieval.qwen.engine.forward import last_hidden_states
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.qwen.model.prompts import EMBED_DEFAULT_INSTRUCTION, Content
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.core import Truncation
from rubricsearch.retrieval.runtime.local import LocalRuntime


@pytest.fixture(scope="module")
def embedder(tiny_embedding_dir: Path) -> LocalRuntime:
    """The local runtime: these tests drive its LM passes directly."""
    return LocalRuntime(load_qwen(tiny_embedding_dir, device="cpu", dtype="float32"), LocalConfig(), VisionConfig(),
                        role="embedding", packages=VisualPackages(PackageStore(storage_dtype="float32")))


def _inputs(embedder: LocalRuntime, make_png, contents: list[Content]):  # type: ignore[no-untyped-def]
    return embedder.prepare(contents, [EMBED_DEFAULT_INSTRUCTION] * len(contents), None, Truncation(EMBED_MAX_LENGTH))


@pytest.mark.parametrize("case", ["one image", "mixed batch", "text only", "two images in one item"])
def test_decoder_pass_equals_the_transformers_pass(embedder: LocalRuntime, make_png, case: str) -> None:
    a, b = decode_image(make_png(96, 64, 1)), decode_image(make_png(64, 128, 2))
    contents = {
        "one image": [Content(texts=["short fur"], images=[a])],
        "mixed batch": [Content(texts=["short fur"], images=[a]), Content(texts=["stripes, a long tail"]),
                        Content(images=[b])],
        "text only": [Content(texts=["triangular ears"]), Content(texts=["a dark forehead stripe " * 9])],
        "two images in one item": [Content(texts=["both"], images=[a, b])],
    }[case]
    inputs = _inputs(embedder, make_png, contents)
    loaded = embedder.loaded
    with torch.inference_mode():
        expected = last_hidden_states(loaded, inputs, embedder.pad_id)
        shape = shape_of(loaded, inputs)
        got = decoder_pass(loaded.model, prepare(loaded, inputs, embedder.pad_id, shape))[: len(inputs)]
    assert shape.rows >= len(inputs) and shape.width % 32 == 0  # padded to a bucket: pads must not leak in
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-5, rtol=0)


def test_deepstack_matters_here(embedder: LocalRuntime, make_png) -> None:
    """The check above can see DeepStack: dropping it moves the result."""
    inputs = _inputs(embedder, make_png, [Content(texts=["x"], images=[decode_image(make_png(96, 64, 3))])])
    loaded = embedder.loaded
    with torch.inference_mode():
        batch = prepare(loaded, inputs, embedder.pad_id, shape_of(loaded, inputs))
        full = decoder_pass(loaded.model, batch)
        batch.deepstack = batch.deepstack[:0]
        without = decoder_pass(loaded.model, batch)
    assert (full - without).abs().max() > 1e-3


def test_only_small_passes_are_graphed(embedder: LocalRuntime, make_png) -> None:
    """Which passes the graphs take. Bulk graphs need FlashAttention (a GPU in half precision): here they are off
    by themselves, and switched on by hand to check how sightings are counted."""
    graphs = GraphedLM(embedder.loaded, embedder.pad_id, max_tokens=1024, bulk_tokens=BULK_TOKENS)
    short = _inputs(embedder, make_png, [Content(texts=["short fur"])])
    assert not graphs._bulk and not any(graphs.fits(short * 64) for _ in range(4))
    graphs = GraphedLM(embedder.loaded, embedder.pad_id, max_tokens=1024, bulk_tokens=BULK_TOKENS)
    graphs._bulk = True
    assert graphs.fits(short) and graphs.fits(short * 8)
    big = short * 64
    assert not graphs.fits(big) and not graphs.fits(big)  # an ingestion batch runs eagerly twice ...
    assert graphs.fits(big) and graphs.fits(big)  # ... and through the bulk graphs from its third pass on
    assert not graphs.fits(short * 40)  # another key (rows bucketed to 8): its own count
    assert not graphs.fits(short * 4000)  # past bulk_tokens: always eager
    default = GraphedLM(embedder.loaded, embedder.pad_id, max_tokens=1024)  # the class's default: no bulk graphs
    assert not default._bulk and not any(default.fits(big) for _ in range(4))
    wide = GraphedLM(embedder.loaded, embedder.pad_id, max_tokens=1024, bulk_tokens=BULK_TOKENS, bulk_width=16)
    wide._bulk = True
    assert not any(wide.fits(big) for _ in range(4))  # wider than bulk_width (photos): eager


def test_bulk_keys_are_bucketed(embedder: LocalRuntime, make_png) -> None:
    """Large passes are keyed by bucketed packed sizes, so batches of other sizes share a graph; the pad tokens
    go to spare segments none longer than the key's ``max_seqlen``."""
    short = _inputs(embedder, make_png, [Content(texts=["short fur"])])
    longer = _inputs(embedder, make_png, [Content(texts=["short fur, triangular ears"])])
    mixed, other = short * 40 + longer * 24, short * 41 + longer * 23
    key = pack_key(mixed, bucketed=True)
    assert key == pack_key(other, bucketed=True)  # one graph for both
    exact = pack_key(mixed, bucketed=False)
    assert exact.tokens < key.tokens <= exact.tokens + 1 + max(64, exact.tokens // 16) and exact.rows < key.rows
    lengths = [len(x.ids) for x in mixed]
    segments = segment_lengths(lengths, key.tokens, key.rows)
    assert segments[: len(mixed)] == lengths and len(segments) == key.rows and sum(segments) == key.tokens
    assert max(segments) <= key.longest and min(segments[len(mixed):]) >= 0 and segments[len(mixed)] >= 1
    assert pack_key(mixed, bucketed=False) == PackKey(sum(lengths), 64, 0, 0, max(lengths))


@pytest.mark.parametrize("bucketed", [True, False])
def test_packed_pass_equals_the_transformers_pass(embedder: LocalRuntime, make_png, bucketed: bool) -> None:
    """The bulk graphs' pass (bucketed: pad tokens and rows after the real ones) and the eager ingestion pass give
    the transformers pass's states, for images of several sizes, text-only rows and two images in one row."""
    images = [decode_image(make_png(w, h, seed)) for seed, (w, h) in enumerate([(96, 64), (64, 128), (160, 96)])]
    contents = [Content(texts=["short fur"], images=[images[0]]), Content(texts=["stripes, a long tail"]),
                Content(images=[images[1]]), Content(texts=["both"], images=[images[2], images[0]])] * 3
    inputs = _inputs(embedder, make_png, contents)
    loaded = embedder.loaded
    key = pack_key(inputs, bucketed=bucketed)
    with torch.inference_mode():
        expected = last_hidden_states(loaded, inputs, embedder.pad_id)
        tensors, segments = last_token_inputs(loaded, inputs, embedder.pad_id, key)
        got = last_token_pass(loaded.model.language_model, tensors, key, segments)
    assert got.shape[0] == key.rows and (key.rows > len(inputs)) == bucketed
    np.testing.assert_allclose(got[: len(inputs)].numpy(), expected.numpy(), atol=2e-5, rtol=0)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("engine", ["auto", "local"])
@pytest.mark.parametrize("role", ["embedder", "reranker"])
def test_the_engine_setting_reaches_each_model(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                               engine: str, role: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """RUBRICSEARCH_MODELS__ENGINE reaches both local models with the accelerated engine's measured paths: CUDA
    graphs, bulk graphs for the embedder (ingestion), fused kernels where they run, no compiled blocks (no CUDA
    here: both run eagerly on the plain engine whatever it says)."""
    from rubricsearch.app.state import open_state
    from tests.api_helpers import api_settings

    seen: list[tuple[object, ...]] = []
    original = LocalRuntime.__init__

    def spy(self: LocalRuntime, loaded: Any, config: LocalConfig, *args: Any, **kwargs: Any) -> None:
        seen.append((config.engine, config.cuda_graphs, config.bulk_graphs, config.fused_kernels, config.compile))
        original(self, loaded, config, *args, **kwargs)

    monkeypatch.setattr(LocalRuntime, "__init__", spy)
    settings = api_settings(tmp_path, tiny_embedding_dir, tiny_reranker_dir, models={"engine": engine})
    state = open_state(settings, embedder=role == "embedder", reranker=role == "reranker")
    try:
        assert seen == [(engine, True, role == "embedder", "auto", False)]
        model = state.embedder if role == "embedder" else state.reranker
        assert isinstance(model.runtime, LocalRuntime) and not model.runtime.cuda_graphs
    finally:
        state.close()


def test_cold_shapes_run_eagerly_until_they_come_back() -> None:
    """``capture_after``: a shape's first runs are eager (no capture, no CUDA needed here)."""
    from rubricsearch.retrieval.plugins.accelerated.graphed_lm import GraphCache

    cache = GraphCache(torch.device("cpu"), capture_after=3)
    x = {"x": torch.arange(4.0)}
    assert torch.equal(cache.run("a", x, lambda t: t["x"] * 2), torch.arange(4.0) * 2)
    assert torch.equal(cache.run("a", x, lambda t: t["x"] * 2), torch.arange(4.0) * 2)
    cache.run("b", x, lambda t: t["x"])
    assert cache.counters["graph_cold_runs"] == 3 and cache.counters["graph_captures"] == 0
    assert cache._uses == {"a": 2, "b": 1}


def test_ready_counts_sightings_of_shapes_without_graphs() -> None:
    """``ready``: a shape runs through the cache from its ``after``-th sighting; never once found uncapturable."""
    from rubricsearch.retrieval.plugins.accelerated.graphed_lm import GraphCache

    cache = GraphCache(torch.device("cpu"), max_graphs=1)
    assert [cache.ready("a", 3) for _ in range(3)] == [False, False, True]
    assert cache.ready("b", 1) and not cache.ready("c", 2)
    cache._uncapturable.add("c")
    assert not cache.ready("c", 2)
    assert not GraphCache(torch.device("cpu")).check_finite
    for key in range(40):  # the sightings kept are bounded
        cache.ready(key, 2)
    assert len(cache._uses) <= 16
