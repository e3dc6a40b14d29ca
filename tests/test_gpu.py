"""GPU correctness (run on the device machine: ``pytest -m gpu``): same results on CUDA as the reference."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from rubricsearch.rerank import load_reranker
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.runtime.core import Truncation
from tests import gpu_modes
from tests.conftest import pil_item
from tests.reference_qwen import official_embed, official_rerank

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES, _options = gpu_modes.MODES, gpu_modes.options
_reference_kernels_after = gpu_modes._reference_kernels_after


def _items(make_png) -> list[dict]:
    a, b = make_png(448, 448, 1), make_png(320, 640, 2)
    return [{"image": a}, {"image": a, "text": "short fur", "instruction": "Find cats"},
            {"image": [a, b], "text": "two"}, {"text": "stripes"}]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype,min_cos", [("float32", 0.9999), ("bfloat16", 0.99)])
def test_cuda_embedder_matches_cpu_reference(tiny_embedding_dir: Path, make_png, dtype: str,
                                             min_cos: float, mode: str) -> None:
    items = _items(make_png)
    ref = official_embed(str(tiny_embedding_dir), [pil_item(i) for i in items]).numpy()
    emb = load_embedder(str(tiny_embedding_dir), device="cuda", dtype=dtype, **_options(mode),
                        store=PackageStore(storage_dtype=dtype))
    first = emb.embed(items)
    again = emb.embed(items)
    assert emb.stats["vision_encodes"] == 2
    assert np.abs(first - again).max() == 0.0
    assert (ref * first).sum(1).min() >= min_cos


@pytest.mark.parametrize("mode", list(MODES))
def test_cuda_reranker_matches_cpu_reference(tiny_reranker_dir: Path, make_png, mode: str) -> None:
    q = {"image": make_png(448, 448, 3), "text": "ears"}
    docs = [{"image": make_png(448, 448, 10 + i)} for i in range(6)] + [{"text": "a dog"}]
    ref = official_rerank(str(tiny_reranker_dir), pil_item(q), [pil_item(d) for d in docs], "Match")
    rr = load_reranker(str(tiny_reranker_dir), device="cuda", dtype="float32", **_options(mode),
                       store=PackageStore(storage_dtype="float32"))
    ours = rr.score(q, docs, "Match")
    assert np.abs(np.array(ours) - np.array(ref)).max() <= 1e-4
    assert rr.score(q, docs, "Match") == ours


@pytest.mark.slow
def test_2b_shared_prefix_equals_full_passes_fp32(tmp_path: Path, make_png) -> None:
    """At the real 2B architecture in float32, prefix sharing leaves scores unchanged (bf16 adds rounding)."""
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    ckpt = make_test_model(tmp_path / "2b", "reranker", size="2b", dtype="bfloat16")
    store = PackageStore(storage_dtype="float32")
    shared = load_reranker(str(ckpt), device="cuda", dtype="float32", store=store)
    plain = load_reranker(str(ckpt), device="cuda", dtype="float32", store=store, share_prefix=False)
    q = {"image": make_png(448, 448, 3), "text": "short fur, triangular ears"}
    docs = [{"image": make_png(448, 448, 20 + i)} for i in range(8)]
    a, b = shared.score(q, docs, "Match"), plain.score(q, docs, "Match")
    print("2B fp32 shared vs full max |delta|:", float(np.abs(np.array(a) - np.array(b)).max()))
    assert np.abs(np.array(a) - np.array(b)).max() <= 1e-4


@pytest.mark.parametrize("dtype,tol,min_cos", [("float32", 1e-4, 0.9999), ("bfloat16", 0.05, 0.99)])
def test_cuda_graph_passes_match_eager_ones(tiny_embedding_dir: Path, make_png, dtype: str, tol: float,
                                            min_cos: float) -> None:
    """``cuda_graphs``: small passes are captured once per shape and replayed; results equal the eager
    passes at rounding level and the official reference, and a replay repeats its capture exactly."""
    items = _items(make_png)
    ref = official_embed(str(tiny_embedding_dir), [pil_item(i) for i in items]).numpy()
    eager = load_embedder(str(tiny_embedding_dir), device="cuda", dtype=dtype, store=PackageStore(storage_dtype=dtype))
    graphed = load_embedder(str(tiny_embedding_dir), device="cuda", dtype=dtype, cuda_graphs=True,
                            store=PackageStore(storage_dtype=dtype))
    expected = eager.embed(items)
    first, again = graphed.embed(items), graphed.embed(items)
    assert graphed.stats["graph_passes"] >= 2 and graphed.stats["graph_captures"] >= 1
    assert np.array_equal(first, again)
    assert np.abs(first - expected).max() <= tol
    assert (ref * first).sum(1).min() >= min_cos
    # one item alone (another shape): a new capture, the same vector as in the batch
    single = graphed.embed(items[1:2])
    assert graphed.stats["graph_captures"] >= 2
    assert np.abs(single[0] - expected[1]).max() <= tol


@pytest.mark.parametrize("dtype,tol", [("float32", 1e-4), ("bfloat16", 0.05)])
def test_cuda_graph_rerank_matches_eager(tiny_reranker_dir: Path, make_png, dtype: str, tol: float) -> None:
    """On a GPU in half precision shortlists run packed (FlashAttention, rerank/plugins/accelerated/packed_prefix.py),
    replayed as CUDA graphs; they equal the padded pass. In float32 (no FlashAttention) the padded pass serves."""
    q = {"image": make_png(448, 448, 3), "text": "ears"}
    docs = [{"image": make_png(448, 320 + 32 * (i % 3), 10 + i)} for i in range(6)] + [{"text": "a dog"}]
    store = PackageStore(storage_dtype=dtype)
    padded = load_reranker(str(tiny_reranker_dir), device="cuda", dtype=dtype, store=store, packed=False)
    packed = load_reranker(str(tiny_reranker_dir), device="cuda", dtype=dtype, store=store)
    graphed = load_reranker(str(tiny_reranker_dir), device="cuda", dtype=dtype, cuda_graphs=True, store=store)
    expected = padded.score(q, docs, "Match")
    cold = graphed.score(q, docs, "Match")  # a shape's first call runs eagerly, its second captures it
    first, again = graphed.score(q, docs, "Match"), graphed.score(q, docs, "Match")
    eager_packed = packed.score(q, docs, "Match")
    if dtype == "bfloat16":
        assert graphed.stats["packed_calls"] == 3 and packed.stats["packed_calls"] == 1
        assert graphed.stats["prefix_graph_cold_runs"] == 1 and graphed.stats["prefix_graph_captures"] == 1
        assert graphed.stats["prefix_graph_replays"] == 2
        assert np.abs(np.array(cold) - np.array(expected)).max() <= tol
    else:
        assert "packed_calls" not in graphed.stats
    assert first == again
    print(f"{dtype}: packed graphed vs padded max |delta|", np.abs(np.array(first) - np.array(expected)).max(),
          "packed eager vs padded", np.abs(np.array(eager_packed) - np.array(expected)).max())
    assert np.abs(np.array(first) - np.array(expected)).max() <= tol
    assert np.abs(np.array(eager_packed) - np.array(expected)).max() <= tol
    if dtype == "float32":
        ref = official_rerank(str(tiny_reranker_dir), pil_item(q), [pil_item(d) for d in docs], "Match")
        assert np.abs(np.array(first) - np.array(ref)).max() <= 1e-4


def test_merged_shortlists_replay_a_graph_each(tiny_reranker_dir: Path, make_png) -> None:
    """Two searches' shortlists merged into one call (as the scheduler merges concurrent searches) run as a
    chunk and a graph replay each (``PackedPrefixes._alone``), and give what the eager packed pass gives."""
    from rubricsearch.rerank.plugins.accelerated.packed_prefix import PackedPrefixes
    from rubricsearch.rerank.protocol import official_pairs

    model = load_reranker(str(tiny_reranker_dir), device="cuda", dtype="bfloat16", cuda_graphs=True,
                          store=PackageStore(storage_dtype="bfloat16"))
    docs = [{"image": make_png(448, 320 + 32 * (i % 3), 10 + i)} for i in range(6)]
    groups = []
    for seed, text in ((3, "ears"), (4, "short fur, triangular ears and dark forehead stripes")):
        pairs = official_pairs({"image": make_png(448, 448, seed), "text": text}, docs, "Match")
        images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
        packages = {pkg.image_sha256: pkg for pkg in model.packages.get_or_encode(images)}
        _, regular, planned, _ = model.runtime.plan(pairs, packages, Truncation(model.max_length))
        assert not regular
        groups += planned
    graphed = PackedPrefixes(model.runtime.loaded, model.runtime.pad_id, cuda_graphs=True)
    with torch.inference_mode():
        plain = PackedPrefixes(model.runtime.loaded, model.runtime.pad_id)
        expected = torch.cat(plain.run(groups)) @ model.runtime.weight
        runs = [torch.cat(graphed.run(groups)) @ model.runtime.weight for _ in range(3)]  # cold, captured, replayed
    assert graphed.stats["packed_prefix_passes"] == 3 * len(groups)
    assert graphed.stats["prefix_graph_replays"] >= len(groups) and graphed.stats["prefix_graph_cold_runs"] <= 2
    assert torch.equal(runs[1], runs[2])
    for got in runs:
        assert (torch.sigmoid(got) - torch.sigmoid(expected)).abs().max().item() <= 0.05


def test_2b_packed_rerank_bf16_within_batch_noise(tmp_path: Path, make_png) -> None:
    """2B architecture, bf16: packed shortlist scores sit as close to one pair per pass as the padded
    shared-prefix pass does (batch noise); a photo-sized candidate (~1,800 tokens) with 64 documents stays
    within ~2 GB of extra memory."""
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    ckpt = str(make_test_model(tmp_path / "2b", "reranker", size="2b", dtype="bfloat16"))
    store = PackageStore(storage_dtype="bfloat16")
    one_pair = load_reranker(ckpt, device="cuda", dtype="bfloat16", store=store, share_prefix=False, packed=False)
    padded = load_reranker(ckpt, device="cuda", dtype="bfloat16", store=store, packed=False)
    packed = load_reranker(ckpt, device="cuda", dtype="bfloat16", store=store, cuda_graphs=True)
    q = {"image": make_png(448, 448, 3), "text": "short fur, triangular ears"}
    docs = [{"image": make_png(448, 448 - 64 * (i % 3), 20 + i)} for i in range(10)]
    base = np.array(one_pair.score(q, docs, "Match"))
    noise = np.abs(np.array(padded.score(q, docs, "Match")) - base).max()
    delta = np.abs(np.array(packed.score(q, docs, "Match")) - base).max()
    print(f"2B bf16 vs one pair per pass: padded shared prefix {noise:.2e}, packed {delta:.2e}")
    assert packed.stats["packed_calls"] == 1
    assert delta <= max(2 * noise, 0.01)
    photo = {"image": make_png(1536, 1184, 5), "text": "short fur"}
    small = [{"image": make_png(224, 224, 100 + i)} for i in range(64)]
    packed.score(photo, small[:2], "Match")  # the packages exist before the measurement
    one_pair.packages.get_or_encode([decode_image(d["image"]) for d in small])
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    packed.score(photo, small, "Match")
    extra = torch.cuda.max_memory_allocated() - before
    print(f"photo candidate + 64 documents: {extra / 1e9:.2f} GB extra")
    assert extra <= 2.2e9


def test_packed_lm_passes_match_padded(tiny_embedding_dir: Path, make_png) -> None:
    """Passes too large for a graph (ingestion) run packed on a GPU in half precision: the same vectors as
    the padded pass, at bf16 rounding."""
    from rubricsearch.retrieval.plugins.accelerated.packed import last_token_states
    from rubricsearch.retrieval.qwen.engine.forward import last_hidden_states

    items = _items(make_png)
    store = PackageStore(storage_dtype="bfloat16")
    packed = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", store=store)
    padded = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", store=store)
    assert packed.runtime.scheduler._plain is last_token_states  # type: ignore[attr-defined]
    padded.runtime.scheduler._plain = last_hidden_states  # type: ignore[attr-defined]
    a, b = packed.embed(items), padded.embed(items)
    print("packed vs padded LM pass, bf16: min cos", float((a * b).sum(1).min()))
    assert (a * b).sum(1).min() >= 0.999


def test_bulk_graph_passes_match_eager(tiny_embedding_dir: Path, make_png) -> None:
    """A pass too large for the small graphs (an ingestion batch) runs eagerly the first two times its bucketed
    key comes, then as a bulk graph: the same vectors as the eager packed pass at bf16 rounding, replays exact."""
    from rubricsearch.retrieval.plugins.accelerated.graphed_lm import BULK_TOKENS, GraphedLM

    items = _items(make_png)
    store = PackageStore(storage_dtype="bfloat16")
    eager = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", store=store)
    graphed = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", cuda_graphs=True, store=store)
    # every pass here counts as a large one
    bulk = GraphedLM(graphed.runtime.loaded, graphed.runtime.pad_id, max_tokens=16, bulk_tokens=BULK_TOKENS)
    graphed.runtime.scheduler.graphs = bulk
    expected = eager.embed(items)
    before = graphed.stats["passes"]
    cold = graphed.embed(items)
    passes = graphed.stats["passes"] - before  # one per key (the planner may split the items)
    assert np.array_equal(graphed.embed(items), cold)  # the second time: eager too
    assert bulk.counters["bulk_graph_captures"] == 0 and bulk.counters["graph_captures"] == 0
    first, again = graphed.embed(items), graphed.embed(items)
    assert (bulk.counters["bulk_graph_captures"], bulk.counters["bulk_graph_replays"]) == (passes, 2 * passes)
    assert np.array_equal(first, again)
    for got in (cold, first):
        print("bulk graph vs eager, bf16: min cos", float((got * expected).sum(1).min()))
        assert (got * expected).sum(1).min() >= 0.999


@pytest.mark.parametrize("dtype,min_cos", [("float32", 0.9999), ("bfloat16", 0.999)])
def test_bulk_graph_replays_other_batches_of_one_shape(tiny_embedding_dir: Path, make_png, dtype: str,
                                                       min_cos: float) -> None:
    """Replays take each batch's own inputs: batches of one key but other images and orientations (a photo
    set's ingestion: M-RoPE positions differ, token counts do not) give the eager vectors. In float32 there is
    no FlashAttention to read the segments from the device, so no bulk graph: every pass is eager."""
    from rubricsearch.retrieval.plugins.accelerated.graphed_lm import BULK_TOKENS, GraphedLM

    store = PackageStore(storage_dtype=dtype)
    eager = load_embedder(str(tiny_embedding_dir), device="cuda", dtype=dtype, store=store)
    graphed = load_embedder(str(tiny_embedding_dir), device="cuda", dtype=dtype, cuda_graphs=True, store=store)
    bulk = GraphedLM(graphed.runtime.loaded, graphed.runtime.pad_id, max_tokens=16, bulk_tokens=BULK_TOKENS)
    graphed.runtime.scheduler.graphs = bulk

    def batch(seed: int) -> list[dict]:
        rng = np.random.default_rng(seed)
        sizes = [(320, 256) if rng.random() < 0.5 else (256, 320) for _ in range(8)]
        return [{"image": make_png(w, h, 100 * seed + i)} for i, (w, h) in enumerate(sizes)]

    for seed in range(6):
        items = batch(seed)
        got, expected = graphed.embed(items), eager.embed(items)
        print(f"batch {seed}: min cos {float((got * expected).sum(1).min()):.6f}", bulk.counters)
        assert (got * expected).sum(1).min() >= min_cos
    graphed_passes = (1, 4) if dtype == "bfloat16" else (0, 0)
    assert (bulk.counters["bulk_graph_captures"], bulk.counters["bulk_graph_replays"]) == graphed_passes
    assert bulk.counters["bulk_graph_capture_failures"] == 0


def test_bulk_graphs_replay_batches_of_other_sizes(tiny_embedding_dir: Path, make_png) -> None:
    """In half precision a large pass's graph is keyed by its bucketed packed sizes: batches whose images differ
    in size and token count (a mixed-size set's) replay one graph and give the eager vectors, also a batch with
    a text-only row and fewer image tokens than the one captured (other pad tokens and pad rows, spare image
    slots); the three keys are asserted equal first."""
    from rubricsearch.retrieval.plugins.accelerated.graphed_lm import BULK_TOKENS, GraphedLM
    from rubricsearch.retrieval.plugins.accelerated.packed import pack_key
    from rubricsearch.retrieval.qwen.model.prompts import Content

    store = PackageStore(storage_dtype="bfloat16")
    eager = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", store=store)
    graphed = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", cuda_graphs=True, store=store)
    bulk = GraphedLM(graphed.runtime.loaded, graphed.runtime.pad_id, max_tokens=16, bulk_tokens=BULK_TOKENS)
    graphed.runtime.scheduler.graphs = bulk
    shapes = {"a": [(320, 256)] * 4 + [(256, 256)] * 4, "b": [(288, 256)] * 8,  # 80 + 64 vs 72 image tokens
              "c": [(288, 256)] * 7 + [(224, 256)]}  # 560 image tokens in the same 576 slots, and a text row
    texts = {"a": [], "b": [], "c": ["short fur"]}
    contents = {name: [Content(images=[decode_image(make_png(w, h, 0))]) for w, h in sizes]
                + [Content(texts=[t]) for t in texts[name]] for name, sizes in shapes.items()}
    keys = {name: pack_key(graphed.runtime.prepare(c, [graphed.default_instruction] * len(c), None,
                                                     Truncation(graphed.max_length)), bucketed=True)
            for name, c in contents.items()}
    assert keys["a"] == keys["b"] == keys["c"], keys
    for seed, name in enumerate("abcabc"):
        items = [{"image": make_png(w, h, 100 * seed + i)} for i, (w, h) in enumerate(shapes[name])]
        items += [{"text": t} for t in texts[name]]
        got, expected = graphed.embed(items), eager.embed(items)
        print(f"batch {seed} ({name}): min cos {float((got * expected).sum(1).min()):.6f}", bulk.counters)
        assert (got * expected).sum(1).min() >= 0.999
    assert (bulk.counters["bulk_graph_captures"], bulk.counters["bulk_graph_replays"]) == (1, 4)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_merge_kernel_matches_the_torch_merge(dtype: torch.dtype) -> None:
    """The Triton merge that ``merge_attention`` takes on CUDA: no worse than the torch ops it replaces against a
    float32 reference (bf16: it keeps the weight in float32), within 1e-5 in float32, an empty key set's +inf
    kept; a log-sum-exp of the wrong shape is not the kernel's."""
    from rubricsearch.retrieval.plugins.accelerated.kernels import merge_kernel
    from rubricsearch.retrieval.plugins.accelerated.packed import merge_attention

    gen = torch.Generator(device="cpu").manual_seed(6)
    tokens, heads, dim = 3001, 16, 128  # the 2B LM's heads
    a, b = (torch.randn(tokens, heads, dim, generator=gen).to("cuda", dtype) for _ in range(2))
    la = (torch.randn(heads, tokens + 64, generator=gen) * 3).cuda()[:, :tokens]
    lb = (torch.randn(heads, tokens, generator=gen) * 3).cuda()
    la[5, 17] = float("inf")
    assert merge_kernel.usable(a, la, b, lb) and not merge_kernel.usable(a, la[:, : tokens - 1], b, lb)
    want = b.float() + torch.sigmoid(la - lb).T[..., None] * (a.float() - b.float())
    got = merge_attention((a, la), (b, lb)).float()
    torch_ops = torch.lerp(b, a, torch.sigmoid(la - lb).T[..., None].to(dtype)).float()
    assert torch.isfinite(got).all()
    err, old = (got - want).abs(), (torch_ops - want).abs()
    if dtype == torch.float32:
        assert err.max().item() <= 1e-5
    else:
        assert err.mean().item() <= old.mean().item() and err.max().item() <= old.max().item() + 1e-6


@pytest.mark.parametrize(("dtype", "heads"), [(torch.bfloat16, 16), (torch.float32, 16), (torch.bfloat16, 12)])
def test_rope_kernel_equals_transformers_rotary_to_the_bit(tiny_embedding_dir: Path, dtype: torch.dtype,
                                                           heads: int) -> None:
    """The tower's rotary as a model loaded with the fused kernels runs it (``modeling_qwen3_vl``'s patched global):
    the Triton kernel, equal to transformers' ``apply_rotary_pos_emb_vision`` to the bit on a fused qkv product's
    strided views and angles with a token stride (the 2B tower's 16 heads of 64, the 8B's 72 a head; 12 heads: the
    kernel's padded heads), an odd token count; a last dimension that is not contiguous goes to Liger's."""
    pytest.importorskip("liger_kernel", reason="the fused kernels come with the gpu extra (liger-kernel)")
    from liger_kernel.transformers.rope import liger_rotary_pos_emb_vision

    from rubricsearch.retrieval.plugins.accelerated.kernels import fused_kernels, rope_kernel
    from rubricsearch.retrieval.plugins.accelerated.model import accelerate
    from rubricsearch.retrieval.qwen.model.loading import load_qwen
    from rubricsearch.retrieval.runtime.config import LocalConfig

    modeling = fused_kernels._modeling()
    original = fused_kernels._ORIGINAL.get("apply_rotary_pos_emb_vision", modeling.apply_rotary_pos_emb_vision)
    accelerate(load_qwen(tiny_embedding_dir, device="cuda", dtype="bfloat16"), LocalConfig(fused_kernels=True))
    patched = modeling.apply_rotary_pos_emb_vision
    gen = torch.Generator(device="cpu").manual_seed(7)
    for dim in (64, 72):
        tokens = 20_001
        qkv = (torch.randn(tokens, 3, heads, dim, generator=gen) * 4).to("cuda", dtype)
        wide = (torch.randn(tokens, 2 * dim, generator=gen) * 30).cuda()
        q, k, cos, sin = qkv[:, 0], qkv[:, 1], wide.cos()[:, :dim], wide.sin()[:, :dim]  # a token stride of 2 * dim
        assert rope_kernel.usable(q, k, cos, sin)
        for g, w in zip(patched(q, k, cos, sin), original(q, k, cos, sin), strict=True):
            assert g.dtype == w.dtype and torch.equal(g, w), (dim, (g.float() - w.float()).abs().max())
    strided = q.transpose(1, 2).contiguous().transpose(1, 2)  # [T, heads, D] with D's values `heads` apart
    assert not rope_kernel.usable(strided, k, cos, sin)
    for g, w in zip(patched(strided, k, cos, sin), liger_rotary_pos_emb_vision(strided, k, cos, sin), strict=True):
        assert torch.equal(g, w)  # the fallback is Liger's
