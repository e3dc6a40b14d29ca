"""The capturable shared-prefix pass behind ``RUBRICSEARCH_CUDA_GRAPHS`` equals the reranker's eager one
(:func:`rerank.prefix.run_shared_prefixes`): run eagerly here, replayed as CUDA graphs in ``tests/test_gpu.py``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rerank.graphed_prefix import GraphedPrefixes, prepare, shared_prefix_pass
from rerank.local import LocalReranker
from rerank.prefix import Group, run_shared_prefixes
from rerank.protocol import official_pairs
from retrieval.packages import PackageStore, VisualPackages
from retrieval.qwen.forward import LMInput
from retrieval.qwen.loading import load_qwen


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir: Path) -> LocalReranker:
    loaded = load_qwen(tiny_reranker_dir, device="cpu", dtype="float32", lm_rows=("yes", "no"))
    return LocalReranker(loaded, packages=VisualPackages(PackageStore(storage_dtype="float32")))


def _group(rr: LocalReranker, query: dict, docs: list[dict], instruction: str) -> Group:
    pairs = official_pairs(query, docs, instruction)
    images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
    packages = {pkg.image_sha256: pkg for pkg in rr.packages.get_or_encode(images)}
    inputs = [rr._input(pair, packages) for pair in pairs]
    shared = rr._shared_prefix(pairs[0], list(range(len(pairs))), inputs, packages)
    assert shared is not None
    prefix, ok = shared
    return prefix, [LMInput(ids=inputs[r].ids[len(prefix.ids):], packages=inputs[r].packages[len(prefix.packages):])
                    for r in ok]


@pytest.fixture(scope="module")
def groups(reranker: LocalReranker, make_png) -> list[Group]:  # type: ignore[no-untyped-def]
    docs = [{"image": make_png(64 + 32 * (i % 3), 96, 20 + i)} for i in range(5)]
    one = _group(reranker, {"image": make_png(96, 96, 1), "text": "short fur"}, docs, "Match the candidate")
    two = _group(reranker, {"text": "triangular ears, dark forehead stripes and a long striped tail"},
                 [*docs[:3], {"image": make_png(128, 64, 40)}], "Judge each criterion")
    return [one, two]


@pytest.mark.parametrize("which", ["one group", "two groups"])
def test_shared_prefix_pass_equals_the_eager_one(reranker: LocalReranker, groups: list[Group], which: str) -> None:
    chosen = groups[:1] if which == "one group" else groups
    loaded = reranker.loaded
    with torch.inference_mode():
        expected = torch.cat(run_shared_prefixes(loaded, chosen, reranker.pad_id, max_batch=64))
        key, tensors = prepare(loaded, chosen, reranker.pad_id)
        got = shared_prefix_pass(loaded.model, tensors)[: expected.shape[0]]
    assert key[0] >= len(chosen) and key[1] % 32 == 0  # groups and widths padded: pads must not leak in
    np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-5, rtol=0)


def test_prefix_keys_are_what_rows_attend_to(reranker: LocalReranker, groups: list[Group]) -> None:
    """The check above sees the prefix: giving every row the other group's prefix changes the states."""
    loaded = reranker.loaded
    with torch.inference_mode():
        _, tensors = prepare(loaded, groups, reranker.pad_id)
        right = shared_prefix_pass(loaded.model, tensors)
        tensors["c_group"] = 1 - tensors["c_group"].clamp(max=1)
        wrong = shared_prefix_pass(loaded.model, tensors)
    assert (right - wrong).abs().max() > 1e-3


def test_large_shortlists_take_the_eager_path(reranker: LocalReranker, groups: list[Group]) -> None:
    graphed = GraphedPrefixes(reranker.loaded, reranker.pad_id, max_batch=64, graph_bytes=1 << 16)
    assert not graphed.fits(groups)
    with torch.inference_mode():
        expected = run_shared_prefixes(reranker.loaded, groups, reranker.pad_id, max_batch=64)
    got = graphed.run(groups)  # no CUDA needed: nothing is captured
    assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True))
    assert graphed.graphs.counters["graph_captures"] == 0
