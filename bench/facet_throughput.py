"""Facet throughput: references x values judged per second from cached packages, beside what the same facets
cost when every reference is encoded first, and the H100 arithmetic at the 2B model.

Measured at the product's settings (``--set NAME=VALUE`` changes one) on a random-weight checkpoint written now
(2B-shaped on a GPU, at 448 px; tiny on a CPU, at 128 px) unless ``--reranker``: ``--refs`` generated faces get
their packages as ingestion builds them (timed: the encode a facet job never pays), then
:func:`indexer.jobs.facets.compute_facets` judges ``--attributes`` x ``--values`` values per reference (timed after
a one-reference warm-up), counting vision encodes (must be 0) and LM tokens per pass. Printed side by side: facet
passes/s from packages, (encode + facets) as a ratio, and the MFU of the measured rate (the loaded model's LM
FLOPs per pass at the measured tokens, against the H100's bf16 peak).

Arithmetic (no GPU needed): the 2B reranker's LM FLOPs per pass (:func:`bench.flops.lm_flops` on the 2B config,
built on the meta device) at a 448 px reference (196 visual tokens) + ``--text-tokens`` of prompt, against the
H100's bf16 peak (:data:`bench.flops.PEAK_TFLOPS`): the FLOP limit in (references x values)/s, and what a schema
change of one attribute of ``--values`` values costs for 1M references; the tower FLOPs it avoids beside it.

    .venv/bin/python bench/facet_throughput.py [--reranker DIR] [--refs 16] [--attributes 2] [--values 8]
    python3 bench/facet_throughput.py --refs 256 --attributes 1 --values 8        # on the GPU box: 2B, 448 px
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* from any working directory

from bench.common import add_settings_args, engine, product_settings, settings_line
from rubricsearch.app.demo.faces import demo_images
from rubricsearch.indexer.catalog.facets import check_schema
from rubricsearch.indexer.jobs.facets import compute_facets
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import Usage

VISUAL_TOKENS_448 = 196  # (448 / 16)^2 patches, merged 2x2
REFERENCES = 1_000_000


def h100_arithmetic(values: int, text_tokens: int) -> dict[str, float]:
    """FLOP limit of facet passes on the H100 at the 2B model, and a schema change's cost for 1M references."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    from bench.flops import PEAK_TFLOPS, lm_flops, vision_flops
    from rubricsearch.retrieval.qwen.model.checkpoint import _config

    ids: Any = {t: i for i, t in enumerate(
        ["<|endoftext|>", "<|image_pad|>", "<|video_pad|>", "<|vision_start|>", "<|vision_end|>"])}
    config: Any = _config("2b", 151936, ids, True)
    with torch.device("meta"):
        model = Qwen3VLModel(config)
    per_pass = lm_flops(model.language_model, config.text_config, [VISUAL_TOKENS_448 + text_tokens])
    tower = vision_flops(model.visual, [(1, 28, 28)])
    peak = PEAK_TFLOPS * 1e12
    passes_s = peak / per_pass
    change = REFERENCES * values * per_pass / peak
    return {"lm_gflops_per_pass": per_pass / 1e9, "tower_gflops_per_image": tower / 1e9, "passes_s": passes_s,
            "refs_s_per_attribute": passes_s / values, "schema_change_s": change}


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--reranker", default=None,
                    help="reranker checkpoint (default: a random-weight one written now, 2B-shaped on a GPU, tiny on "
                         "a CPU, as bench/gpu_report.py writes it)")
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default=None, help="the random checkpoint's shape")
    ap.add_argument("--refs", type=int, default=16)
    ap.add_argument("--attributes", type=int, default=2)
    ap.add_argument("--values", type=int, default=8)
    ap.add_argument("--side", type=int, default=None, help="reference side in px (default: 448 on a GPU, 128 on a CPU)")
    ap.add_argument("--text-tokens", type=int, default=60, help="prompt tokens besides the package, per pass")
    add_settings_args(ap)
    args = ap.parse_args()
    from bench.flops import PEAK_TFLOPS, lm_flops
    from rubricsearch.app.model_loading import model_config
    from rubricsearch.app.state import _storage_dtype
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval.packages import PackageStore, VisualPackages
    from rubricsearch.retrieval.qwen.model.loading import resolve_device

    settings = product_settings(args)
    gpu = resolve_device(settings.models.device).type == "cuda"
    side = args.side or (448 if gpu else 128)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.reranker
        size = args.size or ("2b" if gpu else "tiny")
        if path is None:
            from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

            path = str(make_test_model(Path(tmp) / "reranker", "reranker", size=size,  # type: ignore[arg-type]
                                       dtype="bfloat16" if size == "2b" else "float32"))
        packages = VisualPackages(PackageStore(storage_dtype=_storage_dtype(settings)))
        reranker: Any = load_reranker(path, model_config(settings, "reranker", "local"), packages=packages)
        print(settings_line(settings, reranker=size if args.reranker is None else path, refs=args.refs,
                            attributes=args.attributes, values=args.values, side=side,
                            device_in_use=engine(reranker).loaded.device)
              + "   (facets from cached packages, one LM pass per reference x value)")
        schema = check_schema({"attributes": [
            {"name": f"attr{a}", "values": [f"value {a}.{v}" for v in range(args.values)]}
            for a in range(args.attributes)]})
        try:
            images = [decode_image(data) for _, data in demo_images(args.refs + 1, seed=11, size=side)]
            packages.build(images[-1:])  # warm-up of the encode; that reference is only used to warm up facets
            compute_facets(reranker, schema.attributes, [images.pop().sha256])
            t0 = time.perf_counter()
            packages.build(images)  # ingestion's encode: what facets from packages never pay again
            encode_s = synced(gpu, t0)
            usage = Usage()
            t0 = time.perf_counter()
            compute_facets(reranker, schema.attributes, [img.sha256 for img in images], usage=usage)
            facets_s = synced(gpu, t0)
            model = engine(reranker).loaded.model
            passes = args.refs * args.attributes * args.values
            tokens = usage.lm_tokens / passes
            limit = PEAK_TFLOPS * 1e12 / lm_flops(model.language_model, model.config.text_config, [round(tokens)])
        finally:
            reranker.close()
    print(f"facets from packages: {passes} passes in {facets_s:.3f} s = {passes / facets_s:.1f} "
          f"(references x values)/s, {tokens:.0f} LM tokens/pass, vision encodes {usage.total()}")
    print(f"encode first + facets: {encode_s + facets_s:.3f} s = {(encode_s + facets_s) / facets_s:.2f}x "
          "the facets from packages")
    rate = passes / facets_s
    print(f"this model's FLOP limit at {tokens:.0f} tokens/pass: {limit:.0f} (references x values)/s at the H100's "
          f"bf16 peak ({PEAK_TFLOPS:.0f} TFLOP/s); measured {rate:.1f}/s = MFU {100 * rate / limit:.3g}%"
          + ("" if gpu else " (a CPU run: the arithmetic checked, not the H100)"))
    h = h100_arithmetic(args.values, args.text_tokens)
    print(f"H100 arithmetic, 2B at 448 px ({VISUAL_TOKENS_448} + {args.text_tokens} tokens per pass): "
          f"{h['lm_gflops_per_pass']:.0f} GFLOP per pass (the tower's encode it avoids: "
          f"{h['tower_gflops_per_image']:.0f} GFLOP per image)")
    print(f"FLOP limit: {h['passes_s']:.0f} (references x values)/s = {h['refs_s_per_attribute']:.0f} references/s "
          f"per attribute of {args.values} values")
    print(f"schema change (one attribute of {args.values} values) for {REFERENCES:,} references: "
          f"{h['schema_change_s']:.0f} s at the FLOP limit ({h['schema_change_s'] / 3600:.2f} h; at 40 % MFU "
          f"{h['schema_change_s'] / 0.4 / 3600:.2f} h)")


def synced(gpu: bool, t0: float) -> float:
    """Seconds since ``t0`` once the GPU's queued work is done."""
    if gpu:
        import torch

        torch.cuda.synchronize()
    return time.perf_counter() - t0


if __name__ == "__main__":
    main()
