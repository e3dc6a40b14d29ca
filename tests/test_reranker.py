"""Reranker: equals the official one-pair-per-pass scores, batched and from cached packages."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.protocol import official_pairs
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.runtime.core import Truncation
from tests.conftest import pil_item
from tests.reference_qwen import official_rerank


@pytest.fixture(scope="module")
def imgs(make_png) -> list[bytes]:
    return [make_png(200, 120, 11), make_png(64, 300, 12), make_png(90, 90, 13), make_png(128, 64, 14)]


def _docs(imgs: list[bytes]) -> list[dict]:
    return [{"image": imgs[1]}, {"image": imgs[2], "text": "tabby cat"}, {"text": "a dog"},
            {"image": [imgs[1], imgs[3]]}, {}]


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir: Path):
    return load_reranker(str(tiny_reranker_dir), store=PackageStore(storage_dtype="float32"))


def test_matches_official_one_pair_per_pass(reranker, imgs, tiny_reranker_dir: Path) -> None:
    query = {"image": imgs[0], "text": "short fur, triangular ears"}
    docs = _docs(imgs)
    instruction = "Retrieve references whose markings match"
    ref = official_rerank(str(tiny_reranker_dir), pil_item(query), [pil_item(d) for d in docs], instruction)
    ours = reranker.score(query, docs, instruction)
    assert np.abs(np.array(ref) - np.array(ours)).max() <= 1e-5
    text_ref = official_rerank(str(tiny_reranker_dir), {"text": "cats"}, [{"text": "a cat"}],
                               "Given a search query, retrieve relevant candidates that answer the query.")
    assert abs(reranker.score("cats", ["a cat"])[0] - text_ref[0]) <= 1e-5


def test_cached_scores_identical_and_no_tower(tiny_reranker_dir: Path, imgs, count_tower) -> None:
    rr = load_reranker(str(tiny_reranker_dir), store=PackageStore(storage_dtype="float32"))
    counter = count_tower(rr.runtime.loaded.model.visual)
    query = {"image": imgs[0], "text": "stripes"}
    first = rr.score(query, _docs(imgs), "Match")
    assert counter.images == 4
    calls = counter.calls
    second = rr.score(query, _docs(imgs), "Match")
    other_instruction = rr.score(query, _docs(imgs), "A different rubric")
    assert counter.calls == calls
    assert first == second
    assert len(other_instruction) == 5
    fresh = load_reranker(str(tiny_reranker_dir), store=PackageStore(storage_dtype="float32"))
    assert fresh.score(query, _docs(imgs), "Match") == first


def test_batched_equals_single_pairs(reranker, imgs) -> None:
    query = {"text": "triangular ears", "image": imgs[3]}
    docs = _docs(imgs)
    batched = reranker.score(query, docs, "Match")
    singles = [reranker.score(query, [d], "Match")[0] for d in docs]
    assert np.abs(np.array(batched) - np.array(singles)).max() <= 1e-5
    assert all(0.0 <= s <= 1.0 for s in batched)


def test_official_tuple_query_and_errors(reranker) -> None:
    assert reranker.score(("Judge colour", "red"), ["red"]) == reranker.score("red", ["red"], "Judge colour")
    with pytest.raises(InvalidInput):
        reranker.score({"text": "q", "bogus": 1}, ["d"])
    assert reranker.score("q", []) == []


def test_shared_prefix_equals_full_passes(tiny_reranker_dir: Path, imgs) -> None:
    """The query prefix runs once for a shortlist; scores equal one full pass per pair."""
    store = PackageStore(storage_dtype="float32")
    shared = load_reranker(str(tiny_reranker_dir), store=store)
    plain = load_reranker(str(tiny_reranker_dir), store=store, share_prefix=False)
    query = {"image": imgs[0], "text": "dark forehead stripes"}
    docs = [*_docs(imgs), {"image": imgs[2]}, {"image": imgs[3], "text": "fox"}]
    a = shared.score(query, docs, "Match")
    b = plain.score(query, docs, "Match")
    assert np.abs(np.array(a) - np.array(b)).max() <= 1e-5
    assert shared.stats["shared_prefix_pairs"] >= 5 and plain.stats["shared_prefix_pairs"] == 0


def test_a_document_that_merges_across_the_boundary_leaves_the_shared_path(tiny_reranker_dir: Path, imgs) -> None:
    """``(...`` merges with ``<Document>:`` into one token (">:("), so that row's ids do not start with the
    prefix's ids: it must take the plain path and get the plain score."""
    store = PackageStore(storage_dtype="float32")
    shared = load_reranker(str(tiny_reranker_dir), store=store)
    plain = load_reranker(str(tiny_reranker_dir), store=store, share_prefix=False)
    query = {"image": imgs[0], "text": "stripes"}
    docs = [{"image": imgs[1]}, {"text": "(a red cat)"}, {"image": imgs[2]}, {"text": "a dog"}]
    tokens = shared.runtime.loaded.processor.tokenizer  # type: ignore[attr-defined]
    assert ">:(" in tokens.convert_ids_to_tokens(tokens.encode("<Document>:(a", add_special_tokens=False))
    a = shared.score(query, docs, "Match")
    b = plain.score(query, docs, "Match")
    assert np.abs(np.array(a) - np.array(b)).max() <= 1e-5
    assert shared.stats["shared_prefix_pairs"] == 3  # every row but the "(" one


def test_shared_prefix_in_bf16_is_within_batch_noise(tiny_reranker_dir: Path, imgs) -> None:
    """bf16 rounding differs between a shared-prefix batch and one pair per pass; the difference must stay
    within the noise that batching alone causes."""
    store = PackageStore(storage_dtype="bfloat16")
    shared = load_reranker(str(tiny_reranker_dir), store=store, dtype="bfloat16")
    plain = load_reranker(str(tiny_reranker_dir), store=store, dtype="bfloat16", share_prefix=False)
    query = {"image": imgs[0], "text": "dark forehead stripes"}
    docs = [*_docs(imgs), {"image": imgs[2]}, {"image": imgs[3], "text": "fox"}]
    one_by_one = np.array([plain.score(query, [d], "Match")[0] for d in docs])
    batched = np.array(plain.score(query, docs, "Match"))
    prefix = np.array(shared.score(query, docs, "Match"))
    noise = float(np.abs(batched - one_by_one).max())
    assert shared.stats["shared_prefix_pairs"] >= 5
    assert float(np.abs(prefix - one_by_one).max()) <= max(2 * noise, 2e-2), (noise, prefix - one_by_one)


def test_the_score_direction_is_yes_minus_no_of_the_checkpoint(tiny_reranker_dir: Path) -> None:
    """The relevance direction is the checkpoint's own LM-head row of "yes" minus the row of "no", read here
    from the files (not through the loader), so a swap anywhere between the vocabulary and the weight fails."""
    tensors = load_file(str(tiny_reranker_dir / "model.safetensors"))
    head = tensors["lm_head.weight"].to(torch.float32)
    vocab = json.loads((tiny_reranker_dir / "tokenizer.json").read_text())["model"]["vocab"]
    yes, no = head[vocab["yes"]], head[vocab["no"]]
    assert not torch.equal(yes, no)
    rr: Any = load_reranker(str(tiny_reranker_dir), dtype="float32", device="cpu")
    torch.testing.assert_close(rr.runtime.loaded.lm_rows["yes"].cpu(), yes)
    torch.testing.assert_close(rr.runtime.loaded.lm_rows["no"].cpu(), no)
    torch.testing.assert_close(rr.runtime.weight.cpu(), yes - no)


def test_a_score_is_the_sigmoid_of_the_yes_no_logit_gap(tiny_reranker_dir: Path) -> None:
    """Scores from the reranker equal sigmoid(h · (w_yes - w_no)) of the last hidden state the scheduler returns
    for the same input, with the rows taken from the checkpoint; and the pairs scored below 0.5 are exactly those
    whose gap is negative (a swapped difference would flip them all)."""
    tensors = load_file(str(tiny_reranker_dir / "model.safetensors"))
    head = tensors["lm_head.weight"].to(torch.float32)
    vocab = json.loads((tiny_reranker_dir / "tokenizer.json").read_text())["model"]["vocab"]
    rr: Any = load_reranker(str(tiny_reranker_dir), dtype="float32", device="cpu", share_prefix=False)
    pairs = [{"text": f"query {i}"} for i in range(6)]
    docs = [{"text": f"document {'x' * i} about {i}"} for i in range(6)]
    scores = [rr.score(q, [d])[0] for q, d in zip(pairs, docs, strict=True)]
    gaps = []
    for q, d in zip(pairs, docs, strict=True):
        (pair,) = official_pairs(q, [d], None)
        inputs, _, _, _ = rr.runtime.plan([pair], {}, Truncation(rr.max_length))
        h = rr.runtime.scheduler.run(inputs)[0].cpu()
        gaps.append(float(h @ (head[vocab["yes"]] - head[vocab["no"]])))
    np.testing.assert_allclose(scores, 1 / (1 + np.exp(-np.array(gaps))), rtol=0, atol=1e-5)
    assert [s > 0.5 for s in scores] == [g > 0 for g in gaps]
