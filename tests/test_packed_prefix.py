"""The packed shared-prefix pass (the reranker's GPU path) equals the padded eager one
(:func:`rerank.prefix.run_shared_prefixes`). Here its attention is the reference loop of
:func:`retrieval.plugins.accelerated.packed.varlen_attention`;
``tests/test_gpu.py`` checks FlashAttention and graph replays."""

from __future__ import annotations

import itertools
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.plugins.accelerated.packed_prefix import PackedPrefixes, _call, chunk_pass
from rubricsearch.rerank.prefix import Group, PaddedRows, RowPasses, run_shared_prefixes, shared_prefix_states
from rubricsearch.rerank.protocol import official_pairs
from rubricsearch.rerank.task import RERANK_MAX_LENGTH
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.plugins.accelerated.packed import Segments, bucket, merge_attention, varlen_attention
from rubricsearch.retrieval.qwen.engine.forward import LMInput
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.core import Truncation


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir: Path) -> LocalScoringRuntime:
    """The local scoring runtime: these tests drive its shortlist passes directly."""
    loaded = load_qwen(tiny_reranker_dir, device="cpu", dtype="float32", lm_rows=("yes", "no"))
    return LocalScoringRuntime(loaded, LocalConfig(), VisionConfig(), role="reranker",
                               packages=VisualPackages(PackageStore(storage_dtype="float32")))


def _group(rr: LocalScoringRuntime, query: dict, docs: list[dict], instruction: str) -> Group:
    pairs = official_pairs(query, docs, instruction)
    images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
    packages = {pkg.image_sha256: pkg for pkg in rr.packages.get_or_encode(images)}
    inputs = [rr._input(pair, packages, Truncation(RERANK_MAX_LENGTH)) for pair in pairs]
    shared = rr._shared_prefix(pairs[0], list(range(len(pairs))), inputs, packages)
    assert shared is not None
    prefix, ok = shared
    return prefix, [LMInput(ids=inputs[r].ids[len(prefix.ids):], packages=inputs[r].packages[len(prefix.packages):])
                    for r in ok]


@pytest.fixture(scope="module")
def groups(reranker: LocalScoringRuntime, make_png) -> list[Group]:  # type: ignore[no-untyped-def]
    docs = [{"image": make_png(64 + 32 * (i % 3), 96, 20 + i)} for i in range(5)]
    one = _group(reranker, {"image": make_png(96, 96, 1), "text": "short fur"}, docs, "Match the candidate")
    two = _group(reranker, {"text": "triangular ears, dark forehead stripes and a long striped tail"},
                 [*docs[:3], {"image": make_png(128, 64, 40)}], "Judge each criterion")
    return [one, two]


def _eager(reranker: LocalScoringRuntime, groups: list[Group]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.cat(run_shared_prefixes(reranker.loaded, groups, reranker.pad_id, max_batch=64))


@pytest.mark.parametrize("padded", [False, True], ids=["exact", "padded for a graph"])
@pytest.mark.parametrize("which", ["one group", "two groups"])
def test_packed_pass_equals_the_padded_one(reranker: LocalScoringRuntime, groups: list[Group], which: str,
                                           padded: bool) -> None:
    chosen = groups[:1] if which == "one group" else groups
    rows = [(g, c) for g, (_, conts) in enumerate(chosen) for c in conts]
    expected = _eager(reranker, chosen)
    call = _call(reranker.loaded, chosen, rows, reranker.pad_id, padded=padded)
    with torch.inference_mode():
        got = chunk_pass(reranker.loaded.model.language_model, [(call.tensors, call.key, call.lengths)])
    if padded:  # pad tokens, segments and image slots were added: none may leak into real rows
        assert len(call.lengths["c"]) > len(rows) and call.lengths["p"][len(chosen)] >= 1
        assert call.tensors["c_image_index"].shape[0] % 64 == 0
    np.testing.assert_allclose(got[: call.rows].numpy(), expected.numpy(), atol=2e-5, rtol=0)


def test_rows_attend_to_their_own_groups_prefix(reranker: LocalScoringRuntime, groups: list[Group]) -> None:
    """The equality above depends on the prefix segments: rows given the other group's prefix differ."""
    rows = [(g, c) for g, (_, conts) in enumerate(groups) for c in conts]
    call = _call(reranker.loaded, groups, rows, reranker.pad_id, padded=False)
    text = reranker.loaded.model.language_model
    with torch.inference_mode():
        right = chunk_pass(text, [(call.tensors, call.key, call.lengths)])
        swapped = dict(call.lengths, p=call.lengths["p"][::-1])
        cu = torch.zeros(3, dtype=torch.int32)
        cu[1:] = torch.tensor(swapped["p"]).cumsum(0)
        wrong = chunk_pass(text, [({**call.tensors, "p_cu": cu}, call.key, swapped)])
    assert (right - wrong).abs().max() > 1e-3


def test_continuation_positions_follow_the_prefix(reranker: LocalScoringRuntime, groups: list[Group]) -> None:
    """Rows' M-RoPE positions start after their prefix: restarted at zero, the states change."""
    rows = [(0, c) for c in groups[0][1]]
    call = _call(reranker.loaded, groups[:1], rows, reranker.pad_id, padded=False)
    text = reranker.loaded.model.language_model
    with torch.inference_mode():
        right = chunk_pass(text, [(call.tensors, call.key, call.lengths)])
        shifted = call.tensors["c_positions"] - call.tensors["c_positions"].min()
        wrong = chunk_pass(text, [({**call.tensors, "c_positions": shifted}, call.key, call.lengths)])
    assert (right - wrong).abs().max() > 1e-3


def test_small_budgets_split_groups_and_rows_without_changing_results(
        reranker: LocalScoringRuntime, groups: list[Group], monkeypatch: pytest.MonkeyPatch) -> None:
    import rubricsearch.rerank.plugins.accelerated.packed_prefix as packed_prefix

    expected = _eager(reranker, groups)
    prefix_runs: list[int] = []
    real = packed_prefix.prefix_pass
    monkeypatch.setattr(packed_prefix, "prefix_pass", lambda *a: prefix_runs.append(1) or real(*a))
    whole = PackedPrefixes(reranker.loaded, reranker.pad_id)
    tiny = PackedPrefixes(reranker.loaded, reranker.pad_id, max_bytes=1)  # one group per chunk, one row per pack
    assert len(whole.chunks(groups)) == 1 and len(tiny.chunks(groups)) == 2
    assert all(len(rows) == 1 for _, packs in tiny.chunks(groups) for rows in packs)
    for packed in (whole, tiny):
        got = torch.cat(packed.run(groups))
        np.testing.assert_allclose(got.numpy(), expected.numpy(), atol=2e-5, rtol=0)
    assert tiny.counters["packed_passes"] == sum(len(c) for _, c in groups)
    assert tiny.counters["packed_prefix_passes"] == 2
    assert len(prefix_runs) == 1 + 2  # once per chunk (whole: one; tiny: two), not once per pack


def test_a_chunks_packs_padded_for_one_graph_equal_the_padded_pass(reranker: LocalScoringRuntime,
                                                                    groups: list[Group]) -> None:
    """What one graph captures for a chunk split into packs: the prefixes once, each pack after them."""
    rows = [(g, c) for g, (_, conts) in enumerate(groups) for c in conts]
    packs = [rows[:3], rows[3:7], rows[7:]]
    first = _call(reranker.loaded, groups, packs[0], reranker.pad_id, padded=True)
    calls = [first] + [_call(reranker.loaded, groups, pack, reranker.pad_id, padded=True, prefix=first.prefix)
                       for pack in packs[1:]]
    assert all(c.tensors["p_ids"] is first.tensors["p_ids"] for c in calls)  # built once for the chunk
    with torch.inference_mode():
        out = chunk_pass(reranker.loaded.model.language_model, [(c.tensors, c.key, c.lengths) for c in calls])
    got = torch.cat([part[: c.rows] for part, c in zip(torch.split(out, [c.key[3] for c in calls]), calls,
                                                           strict=True)])
    np.testing.assert_allclose(got.numpy(), _eager(reranker, groups).numpy(), atol=2e-5, rtol=0)


def test_merged_attention_is_attention_over_both_key_sets() -> None:
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 8, generator=gen)
    ka, va, kb, vb = (torch.randn(n, 2, 8, generator=gen) for n in (5, 5, 3, 3))
    seg = Segments.of([6], torch.device("cpu"))
    a = varlen_attention(q, ka, va, seg, Segments.of([5], torch.device("cpu")), causal=False, scale=0.3)
    b = varlen_attention(q, kb, vb, seg, Segments.of([3], torch.device("cpu")), causal=False, scale=0.3)
    k, v = torch.cat([ka, kb]).repeat_interleave(2, dim=1), torch.cat([va, vb]).repeat_interleave(2, dim=1)
    want = torch.nn.functional.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                                            scale=0.3).transpose(0, 1)
    torch.testing.assert_close(merge_attention(a, b), want, atol=1e-5, rtol=1e-5)
    assert (merge_attention(a, b) - a[0]).abs().max() > 1e-2  # b's keys matter


def test_causal_segments_match_sdpa() -> None:
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(9, 2, 8, generator=gen) for _ in range(3))
    seg = Segments.of([4, 5], torch.device("cpu"))
    out, _ = varlen_attention(q, k, v, seg, seg, causal=True, scale=0.25)
    for start, n in ((0, 4), (4, 5)):
        part = [t[start:start + n].transpose(0, 1) for t in (q, k, v)]
        want = torch.nn.functional.scaled_dot_product_attention(*part, is_causal=True, scale=0.25).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n], want, atol=1e-5, rtol=1e-5)


def test_buckets_pad_little_and_reuse_shapes() -> None:
    assert [bucket(n, 64) for n in (1, 64, 65, 5300, 5301)] == [64, 64, 128, 5632, 5632]
    assert all(n <= bucket(n, 4) <= n * 1.13 + 4 for n in range(1, 5000))


def test_packed_last_token_states_equal_the_padded_pass(reranker: LocalScoringRuntime, groups: list[Group]) -> None:
    """The embedder's packed pass (ingestion on a GPU) gives each sequence's last state as the padded one."""
    from rubricsearch.retrieval.plugins.accelerated.packed import last_token_states
    from rubricsearch.retrieval.qwen.engine.forward import last_hidden_states

    batch = [LMInput(ids=p.ids + c.ids, packages=p.packages + c.packages) for p, conts in groups for c in conts[:2]]
    batch.append(LMInput(ids=groups[1][0].ids, packages=groups[1][0].packages))  # text only, another length
    with torch.inference_mode():
        want = last_hidden_states(reranker.loaded, batch, reranker.pad_id)
        got = last_token_states(reranker.loaded, batch, reranker.pad_id)
    np.testing.assert_allclose(got.numpy(), want.numpy(), atol=2e-5, rtol=0)


def test_the_graph_inputs_of_a_chunk_give_the_padded_pass(reranker: LocalScoringRuntime, groups: list[Group]) -> None:
    """With graphs on, a chunk of several packs hands the graph one input set (the shared prefix once, each
    pack's own); its first call runs that very function eagerly (captures need CUDA), and equals the padded pass."""
    from rubricsearch.retrieval.plugins.accelerated.packed import token_bytes

    one = groups[:1]
    budget = 2 * token_bytes(reranker.loaded) * max(len(c.ids) for c in one[0][1])  # a pack per row
    packed = PackedPrefixes(reranker.loaded, reranker.pad_id, max_bytes=budget, cuda_graphs=True)
    ((_, packs),) = packed.chunks(one)
    assert len(packs) > 1
    got = torch.cat(packed.run(one))
    assert packed.stats["prefix_graph_cold_runs"] == 1 and packed.stats["packed_prefix_passes"] == 1
    np.testing.assert_allclose(got.numpy(), _eager(reranker, one).numpy(), atol=2e-5, rtol=0)


def test_with_graphs_each_shortlist_that_fits_one_is_a_chunk_of_its_own(reranker: LocalScoringRuntime,
                                                                       groups: list[Group]) -> None:
    """Merged shortlists (several searches' groups in one scheduler call) replay one graph each: one search's
    shape comes back, a merged one rarely does. Groups too large for a graph stay merged, and run eagerly."""
    sizes = [len(p.ids) + sum(len(c.ids) for c in conts) for p, conts in groups]
    three = [groups[0], groups[1], groups[0]]
    graphed = PackedPrefixes(reranker.loaded, reranker.pad_id, cuda_graphs=True)
    assert [len(chunk) for chunk, _ in graphed.chunks(three)] == [1, 1, 1]
    assert sizes[0] != sizes[1]
    small, large = sorted(groups, key=lambda g: len(g[0].ids) + sum(len(c.ids) for c in g[1]))
    some_fit = PackedPrefixes(reranker.loaded, reranker.pad_id, cuda_graphs=True, graph_tokens=min(sizes))
    assert [len(chunk) for chunk, _ in some_fit.chunks([small, large, large, small])] == [1, 2, 1]
    none_fit = PackedPrefixes(reranker.loaded, reranker.pad_id, cuda_graphs=True, graph_tokens=min(sizes) - 1)
    assert [len(chunk) for chunk, _ in none_fit.chunks(three)] == [3]
    assert [len(chunk) for chunk, _ in PackedPrefixes(reranker.loaded, reranker.pad_id).chunks(three)] == [3]
    got = torch.cat(graphed.run(groups))  # first sightings of their shapes: eager (captures need CUDA)
    assert graphed.stats["packed_prefix_passes"] == 2 and graphed.stats["prefix_graph_cold_runs"] == 2
    np.testing.assert_allclose(got.numpy(), _eager(reranker, groups).numpy(), atol=2e-5, rtol=0)


@pytest.mark.parametrize("graphs", [False, True])
def test_the_final_layer_runs_for_each_rows_last_token_only(reranker: LocalScoringRuntime, groups: list[Group],
                                                            graphs: bool) -> None:
    """Both passes read one state per sequence, so the final layer's MLP sees one token per row (graph inputs:
    per padded row); the layer before it sees every token. This test checks sizes only: the values of these very
    passes are checked against the padded pass by the tests above (here with the reference attention loop; with
    FlashAttention in ``tests/test_gpu.py``)."""
    from rubricsearch.retrieval.plugins.accelerated.packed import last_token_states

    seen: list[int] = []
    layers = reranker.loaded.model.language_model.layers
    hooks = [layer.mlp.register_forward_hook(lambda _m, args, _o: seen.append(args[0].shape[0]))
             for layer in (layers[-2], layers[-1])]
    chosen = groups[:1] if graphs else groups  # with graphs each group is a chunk of its own
    try:
        with torch.inference_mode():
            PackedPrefixes(reranker.loaded, reranker.pad_id, cuda_graphs=graphs).run(chosen)
            rows = [c for _, conts in chosen for c in conts]
            tokens = sum(len(c.ids) for c in rows)
            prefix_tokens = sum(len(p.ids) for p, _ in chosen)
            n_rows = bucket(len(rows) + 1, 4) if graphs else len(rows)
            assert seen[:2] == [bucket(prefix_tokens + 1, 64) if graphs else prefix_tokens] * 2  # the prefix pass
            assert seen[2] >= tokens and seen[3] == n_rows
            seen.clear()
            batch = [LMInput(ids=p.ids + c.ids, packages=p.packages + c.packages) for p, conts in chosen for c in conts]
            last_token_states(reranker.loaded, batch, reranker.pad_id)
            assert seen == [sum(len(x.ids) for x in batch), len(batch)]
    finally:
        for hook in hooks:
            hook.remove()


def _trained_through(passes: RowPasses, groups: list[Group], leaves: list[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """The states of every row after its group's prefix, prefixes and rows under one graph (a trainer's forward),
    and the gradient of their logits' sum with respect to ``leaves``."""
    states = torch.cat(shared_prefix_states(passes, groups, max_batch=3))  # rows split over passes
    logits = states @ torch.linspace(-1, 1, states.shape[1])
    return (states.detach(), *torch.autograd.grad(logits.sum(), leaves))


@pytest.mark.parametrize("broken", [None, "own keys only", "prefix keys of the other group"])
def test_packed_passes_with_gradients_equal_the_padded_ones(reranker: LocalScoringRuntime, groups: list[Group],
                                                            broken: str | None,
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """What the trainers and the evidence maps run on a GPU (:class:`PackedRows`) gives the padded passes' states and
    gradients: with respect to the rows' packages, the prefix's candidate package (through the kept keys, as a
    trainer's adapters get theirs) and a weight of every layer's attention. Broken copies of the joined keys fail."""
    import rubricsearch.rerank.plugins.accelerated.packed_rows as packed_rows

    loaded = reranker.loaded
    weights = [layer.self_attn.k_proj.weight for layer in loaded.model.language_model.layers]
    leaves: list[torch.Tensor] = []

    def on_leaves(group: Group) -> Group:
        def leaf(pkg: Any) -> Any:
            pkg = replace(pkg, embeds=pkg.embeds.detach().clone().requires_grad_(True))
            leaves.append(pkg.embeds)
            return pkg
        prefix, conts = group
        return (LMInput(ids=prefix.ids, packages=[leaf(p) for p in prefix.packages]),
                [LMInput(ids=c.ids, packages=[leaf(p) for p in c.packages]) for c in conts])

    chosen = [on_leaves(g) for g in groups]
    assert len(leaves) == 1 + sum(len(c) for _, c in groups)  # the candidate and every reference
    if broken == "own keys only":
        def own_keys(starts: Any, p_lengths: Any, groups: Any, lengths: Any) -> tuple[np.ndarray, list[int]]:
            total, starts = sum(p_lengths), np.cumsum([0, *lengths])
            return (np.concatenate([np.arange(total + a, total + b) for a, b in itertools.pairwise(starts)]),
                    list(lengths))
        monkeypatch.setattr(packed_rows, "joined_keys", own_keys)
    elif broken == "prefix keys of the other group":
        real_rows = packed_rows.PackedRows.rows
        monkeypatch.setattr(packed_rows.PackedRows, "rows", lambda self, kept, rows: real_rows(
            self, kept, [(1 - g, c) for g, c in rows]))
    for w in weights:
        w.requires_grad_(True)
    try:
        padded = _trained_through(PaddedRows(loaded, reranker.pad_id), chosen, leaves + weights)
        packed = _trained_through(packed_rows.PackedRows(loaded), chosen, leaves + weights)
    finally:
        for w in weights:
            w.requires_grad_(False)
    assert padded[1 + len(leaves)].abs().sum() > 0  # the weights' gradients are not trivially equal
    close = [torch.allclose(a, b, atol=2e-5, rtol=1e-3) for a, b in zip(padded, packed, strict=True)]
    assert all(close) == (broken is None), close



def test_the_gradient_probe_refuses_a_kernel_whose_gradients_differ(monkeypatch: pytest.MonkeyPatch) -> None:
    """The accelerated runtime packs its passes with gradients only where the kernel's gradients match the reference
    loop's: here bfloat16 stands in for the kernel (the same loop, rounded), then a kernel that ignores causality."""
    import rubricsearch.retrieval.plugins.accelerated.packed as packed

    assert packed._flash_varlen_grad_probe("cpu", torch.bfloat16, 4, 2, 16)
    real = packed.varlen_attention

    def acausal(q: torch.Tensor, *a: Any, causal: bool, **kw: Any) -> Any:
        return real(q, *a, causal=causal and q.dtype == torch.float32, **kw)

    monkeypatch.setattr(packed, "varlen_attention", acausal)
    assert not packed._flash_varlen_grad_probe.__wrapped__("cpu", torch.bfloat16, 4, 2, 16)
