"""Which kernels hold the GPU passes back, measured before choosing what to fuse or swap (GPU only).

A) Attention at the tower's shapes: the variable-length FlashAttention call the tower uses now vs cuDNN's fused
   attention (SDPA's cuDNN backend) over the same images as a dense batch, for 12-MP photos at the official
   max_pixels (16 images of ~7,200 patches: attention is about half the tower's FLOPs there) and for 448 px (64
   images of 784 patches); and the LM's causal grouped-query attention at the photos' length. TFLOP/s and the
   largest difference to the current kernel.
B) Rerank of K image documents from cached packages (new candidate excluded): GPU time by kernel class
   (matrix products, attention, norms/rotary, element-wise, copies), the top kernels, matrix-product TFLOP/s and
   the MFU of the whole pass, eager and as the CUDA-graph replay search uses.
C) The LM's MLP at that pass's token count: transformers' ``down(silu(gate(x)) * up(x))`` vs Liger's fused
   SiLU-multiply, and residual add + RMSNorm vs Liger's fused add-RMSNorm.

    python3 bench/kernel_probe.py --checkpoint CKPT [--k 50] [--only attention,rerank,mlp]
"""

from __future__ import annotations

import argparse
import itertools
import json
import sys
import tempfile
from collections import Counter
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16, the MFU denominator the other benches use


def ms(fn: Callable[[], Any], repeats: int = 20) -> float:
    """Median CUDA-event time of ``fn`` in ms after two warm-ups."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return sorted(times)[len(times) // 2]


def attention(loaded: Any) -> None:
    from qwen_vl_utils.vision_process import smart_resize
    vis, text = loaded.config.vision_config, loaded.config.text_config
    heads, dim = int(vis.num_heads), int(vis.hidden_size) // int(vis.num_heads)
    h, w = smart_resize(3024, 4032, factor=32, min_pixels=65536, max_pixels=1843200)
    photo = (h // 16) * (w // 16)
    print(f"A) attention, bf16; tower {heads} heads x {dim}; a 12-MP photo is {h}x{w} px = {photo} patches")
    shapes = [("tower 12 MP", 16, photo, heads, heads, dim, False), ("tower 448 px", 64, 784, heads, heads, dim, False),
              ("LM 12 MP (causal, GQA)", 16, photo // 4 + 32, int(text.num_attention_heads),
               int(text.num_key_value_heads), int(text.head_dim), True)]
    for shape in shapes:
        print(attention_row(*shape))
    print(plan_cost(heads, dim, photo))
    print("   cuDNN variable-length (ragged) vs FlashAttention varlen, first call (plan) and steady:")
    for name, lengths, hq, hk, d, causal in (
            ("tower 448 + mixed", [784] * 40 + [1200] * 10 + [560] * 14, heads, heads, dim, False),
            ("rerank rows (causal, GQA)", [256] * 50, int(text.num_attention_heads), int(text.num_key_value_heads),
             int(text.head_dim), True)):
        print(ragged_row(name, lengths, hq, hk, d, causal))


def attention_row(name: str, n: int, length: int, hq: int, hk: int, d: int, causal: bool) -> str:
    """One shape: the current variable-length FlashAttention call vs SDPA's backends on a dense batch."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    q = torch.randn(n * length, hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(n * length, hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.arange(0, n * length + 1, length, device="cuda", dtype=torch.int32)
    flops = 4 * n * length * length * hq * d / (2 if causal else 1)

    def varlen() -> torch.Tensor:
        out: torch.Tensor = torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, length, length, 0.0, causal,
                                                                    False, scale=None)[0]
        return out

    qd, kd, vd = (t.view(n, length, t.shape[1], d).transpose(1, 2) for t in (q, k, v))

    def dense(backend: Any) -> torch.Tensor:
        with sdpa_kernel([backend]):
            out = torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, is_causal=causal, enable_gqa=hq != hk)
        return out.transpose(1, 2).reshape(n * length, hq, d)

    ref = varlen().float()
    t = ms(varlen)
    line = f"   {name:24s} {n} x {length}: flash varlen {t:7.2f} ms ({flops / t / 1e9:5.0f} TFLOP/s)"
    for label, backend in (("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash dense", SDPBackend.FLASH_ATTENTION),
                           ("efficient", SDPBackend.EFFICIENT_ATTENTION)):
        try:
            t = ms(partial(dense, backend))
            diff = (dense(backend).float() - ref).abs().max().item()
            line += f"; {label} {t:7.2f} ms ({flops / t / 1e9:5.0f} TFLOP/s, max|diff| {diff:.1e})"
        except RuntimeError as exc:
            line += f"; {label} refused ({str(exc).splitlines()[0][:60]})"
    return line


def plan_cost(heads: int, dim: int, length: int) -> str:
    """What a new image count costs cuDNN (its first call builds an execution plan) and each count's steady time
    per image: why the tower cuts runs of photos into power-of-two counts (``tower_attention.cudnn_blocks``)."""
    import time

    from retrieval.qwen.cudnn_attention import dense_attention

    parts = []
    for count in (1, 2, 4, 8, 13):
        q, k, v = (torch.randn(count * length, heads, dim, device="cuda", dtype=torch.bfloat16) for _ in range(3))
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dense_attention(q, k, v, length, None)
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        steady = ms(partial(dense_attention, q, k, v, length, None))
        parts.append(f"{count}: first call {first:.0f} ms, then {steady / count:.3f} ms/image")
    return f"   cuDNN dense, tower photos of {length} patches, per image count: " + "; ".join(parts)


def ragged_row(name: str, lengths: list[int], hq: int, hk: int, d: int, causal: bool) -> str:
    import time

    q = torch.randn(sum(lengths), hq, d, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(sum(lengths), hk, d, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], device="cuda", dtype=torch.int32)
    longest = max(lengths)

    def flash() -> Any:
        return torch.ops.aten._flash_attention_forward(q, k, v, cu, cu, longest, longest, 0.0, causal, False,
                                                       scale=None)

    def cudnn() -> Any:
        return torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, longest, longest, True, 0.0, causal,
                                                       False, scale=None)

    line = f"   {name:26s} {len(lengths)} segments, {sum(lengths)} tokens: flash {ms(flash):.3f} ms"
    try:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        got = cudnn()
        torch.cuda.synchronize()
        first = (time.perf_counter() - t0) * 1e3
        ref = flash()
        diff = (got[0].float() - ref[0].float()).abs().max().item()
        line += (f"; cuDNN {ms(cudnn):.3f} ms (first call {first:.1f} ms), max|diff| {diff:.1e}, log-sum-exp "
                 f"{tuple(got[1].shape)} vs flash {tuple(ref[1].shape)}")
    except (RuntimeError, AttributeError) as exc:
        line += f"; cuDNN refused ({str(exc).splitlines()[0][:80]})"
    return line


CLASSES = (("attention", ("flash", "fmha", "attn", "sdpa", "cudnn")), ("norm/rotary", ("rms_norm", "rope", "norm")),
           ("matrix products", ("gemm", "nvjet", "xmma", "cutlass", "sm90", "splitk")),
           ("copies/index", ("copy", "memcpy", "memset", "index", "cat", "gather", "scatter")),
           ("element-wise", ("elementwise", "vectorized", "unrolled", "reduce", "silu", "mul", "add", "lerp")))


def kernel_classes(prof: Any) -> tuple[Counter[str], Counter[str]]:
    """GPU time (us) by kernel class and by kernel name, from the Chrome trace (kernels inside graph replays
    included where CUPTI reports them)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    by_class: Counter[str] = Counter()
    by_name: Counter[str] = Counter()
    for e in events:
        if e.get("ph") != "X" or e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset"):
            continue
        name = e["name"].lower()
        cls = next((c for c, keys in CLASSES if any(k in name for k in keys)), "other")
        by_class[cls] += e.get("dur", 0)
        by_name[e["name"][:90]] += e.get("dur", 0)
    return by_class, by_name


def rerank(loaded: Any, k: int) -> None:
    from torch.profiler import ProfilerActivity, profile

    from bench.core_reuse import png
    from rerank.local import LocalReranker
    from retrieval.embedding.local import LocalEmbedder
    from retrieval.images import ReferenceImage, decode_image
    from retrieval.packages import PackageStore, VisualPackages

    packages = VisualPackages(PackageStore(storage_dtype="bfloat16", memory_bytes=16 << 30))
    embedder = LocalEmbedder(loaded, packages=packages)
    data = [png(448, 100 + j) for j in range(k)]
    docs = [decode_image(b) for b in data]
    packages.build(docs)  # references were ingested earlier: known by sha256, their packages cached
    items = [{"image": ReferenceImage(d.sha256, lambda b=b: b)} for d, b in zip(docs, data, strict=True)]
    query = {"image": png(448, 999), "text": "short fur, triangular ears, dark forehead stripes"}
    instruction = "Retrieve reference images that match the candidate by these criteria."
    for graphs in (False, True):
        reranker = LocalReranker(loaded, packages=packages, vision=embedder.vision, cuda_graphs=graphs)
        reranker.score(query, items, instruction)  # the candidate's package is cached from here on

        run = partial(reranker.score, query, items, instruction)
        wall = ms(run, 10)
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_flops=True) as prof:
            run()
            torch.cuda.synchronize()
        by_class, by_name = kernel_classes(prof)
        gpu = sum(by_class.values()) / 1e3
        gemm_flops = sum(e.flops or 0 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU)
        label = "CUDA graph replay" if graphs else "eager"
        print(f"B) rerank {k} documents, all cached, {label}: wall {wall:.1f} ms, GPU kernels {gpu:.1f} ms")
        for cls, t in by_class.most_common():
            print(f"   {cls:16s} {t / 1e3:7.2f} ms  {100 * t / 1e3 / max(gpu, 1e-9):5.1f}%")
        if gemm_flops:
            mm = by_class["matrix products"] / 1e6
            print(f"   matrix-product FLOPs {gemm_flops / 1e12:.2f} T: {gemm_flops / 1e12 / mm:.0f} TFLOP/s in their "
                  f"kernels; MFU over the wall {gemm_flops / 1e12 / (wall / 1e3) / PEAK_TFLOPS:.2f}")
        for name, t in by_name.most_common(12):
            print(f"     {t / 1e3:7.2f} ms  {name}")
    host_split(reranker, query, items, instruction)


def host_split(reranker: Any, query: Any, items: Any, instruction: str) -> None:
    """Where a graphed rerank's wall time goes besides the replay: the steps of ``score_pairs`` timed one by one
    on this thread (the scheduler's queue skipped), then a cProfile of the packed pass."""
    import cProfile
    import pstats
    import time

    from rerank.protocol import official_pairs

    pairs = official_pairs(query, items, instruction, max_bytes=reranker.image_max_bytes,
                           max_pixels=reranker.image_max_pixels)
    images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
    stamps = []
    for _ in range(5):
        torch.cuda.synchronize()
        t = [time.perf_counter()]
        packages = {p.image_sha256: p for p in reranker.packages.get_or_encode(images)}
        t.append(time.perf_counter())
        _, _, groups, _ = reranker.plan(pairs, packages)
        t.append(time.perf_counter())
        reranker._run_groups(groups)
        t.append(time.perf_counter())
        torch.cuda.synchronize()
        t.append(time.perf_counter())
        stamps.append([1e3 * (b - a) for a, b in itertools.pairwise(t)])
    med = [sorted(col)[len(col) // 2] for col in zip(*stamps, strict=True)]
    print(f"   host split (median of 5): packages {med[0]:.2f} ms, plan {med[1]:.2f} ms, packed pass launched "
          f"{med[2]:.2f} ms, then GPU {med[3]:.2f} ms")
    prof = cProfile.Profile()
    prof.enable()
    reranker._run_groups(groups)
    torch.cuda.synchronize()
    prof.disable()
    pstats.Stats(prof).sort_stats("tottime").print_stats(14)


def mlp(loaded: Any, tokens: int) -> None:
    from liger_kernel.ops.fused_add_rms_norm import LigerFusedAddRMSNormFunction
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    layer = loaded.model.language_model.layers[1]
    m, norm = layer.mlp, layer.post_attention_layernorm
    x = torch.randn(tokens, m.gate_proj.in_features, device="cuda", dtype=loaded.dtype)
    r = torch.randn_like(x)
    with torch.inference_mode():
        hf = ms(lambda: m(x))
        fused = ms(lambda: m.down_proj(LigerSiLUMulFunction.apply(m.gate_proj(x), m.up_proj(x))))
        swiglu = m.down_proj(LigerSiLUMulFunction.apply(m.gate_proj(x), m.up_proj(x)))
        diff = (m(x).float() - swiglu.float()).abs().max()
        print(f"C) MLP at {tokens} tokens: transformers {hf:.3f} ms, fused SiLU-multiply {fused:.3f} ms "
              f"(max|diff| {diff.item():.1e})")
        plain = ms(lambda: norm(x + r))
        eps = float(getattr(norm, "variance_epsilon", 1e-6))
        both = ms(lambda: LigerFusedAddRMSNormFunction.apply(x, r, norm.weight, eps, 0.0, "llama", False))
        print(f"   residual add + RMSNorm {plain:.3f} ms vs fused add-RMSNorm {both:.3f} ms; per layer x "
              f"{2 * len(loaded.model.language_model.layers)} per pass")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--checkpoint", required=True)
    ap.add_argument("--k", type=int, default=50)
    ap.add_argument("--tokens", type=int, default=12800, help="MLP tokens (~ a 50-document shortlist)")
    ap.add_argument("--only", default="attention,rerank,mlp")
    args = ap.parse_args()
    from retrieval.qwen.loading import load_qwen

    loaded = load_qwen(args.checkpoint, device="cuda", lm_rows=("yes", "no"), fused_kernels=True)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    parts = args.only.split(",")
    if "attention" in parts:
        attention(loaded)
    if "rerank" in parts:
        rerank(loaded, args.k)
    if "mlp" in parts:
        mlp(loaded, args.tokens)


if __name__ == "__main__":
    main()
