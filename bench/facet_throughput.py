"""Facet throughput: references x values judged per second from cached packages, beside what the same facets
cost when every reference is encoded first, and the H100 arithmetic at the 2B model.

Measured here (CPU, tiny checkpoint unless ``--reranker``): ``--refs`` generated faces get their packages as
ingestion builds them (timed: the encode a facet job never pays), then :func:`indexer.jobs.facets.compute_facets`
judges ``--attributes`` x ``--values`` values per reference (timed), counting vision encodes (must be 0) and LM
tokens per pass. Printed side by side: facet passes/s from packages, and (encode + facets) as a ratio.

Arithmetic (no GPU needed): the 2B reranker's LM FLOPs per pass (:func:`bench.flops.lm_flops` on the 2B config,
built on the meta device) at a 448 px reference (196 visual tokens) + ``--text-tokens`` of prompt, against the
H100's bf16 peak (:data:`bench.flops.PEAK_TFLOPS`): the FLOP limit in (references x values)/s, and what a schema
change of one attribute of ``--values`` values costs for 1M references; the tower FLOPs it avoids beside it.

    .venv/bin/python bench/facet_throughput.py [--reranker DIR] [--refs 16] [--attributes 2] [--values 8]
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

from app.demo.faces import demo_images
from indexer.catalog.facets import check_schema
from indexer.jobs.facets import compute_facets
from retrieval.images import decode_image
from retrieval.packages import Usage

VISUAL_TOKENS_448 = 196  # (448 / 16)^2 patches, merged 2x2
REFERENCES = 1_000_000


def h100_arithmetic(values: int, text_tokens: int) -> dict[str, float]:
    """FLOP limit of facet passes on the H100 at the 2B model, and a schema change's cost for 1M references."""
    import torch
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLModel

    from bench.flops import PEAK_TFLOPS, lm_flops, vision_flops
    from retrieval.qwen.model.checkpoint import _config

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
    ap.add_argument("--reranker", default=None, help="reranker checkpoint (default: the tiny test checkpoint)")
    ap.add_argument("--refs", type=int, default=16)
    ap.add_argument("--attributes", type=int, default=2)
    ap.add_argument("--values", type=int, default=8)
    ap.add_argument("--text-tokens", type=int, default=60, help="prompt tokens besides the package, per pass")
    args = ap.parse_args()
    from rerank import load_reranker
    from retrieval.packages import PackageStore, VisualPackages

    with tempfile.TemporaryDirectory() as tmp:
        path = args.reranker
        if path is None:
            from retrieval.qwen.model.checkpoint import make_test_model

            path = str(make_test_model(Path(tmp) / "tiny-reranker", "reranker", size="tiny"))
        print(f"settings: reranker={'tiny' if args.reranker is None else path} refs={args.refs} "
              f"attributes={args.attributes} values={args.values} size=128px device=cpu "
              "package_storage_dtype=float32   (facets from cached packages, one LM pass per reference x value)")
        packages = VisualPackages(PackageStore(storage_dtype="float32"))
        reranker: Any = load_reranker(path, device="cpu", packages=packages)
        try:
            images = [decode_image(data) for _, data in demo_images(args.refs, seed=11)]
            schema = check_schema({"attributes": [
                {"name": f"attr{a}", "values": [f"value {a}.{v}" for v in range(args.values)]}
                for a in range(args.attributes)]})
            t0 = time.perf_counter()
            packages.build(images)  # ingestion's encode: what facets from packages never pay again
            encode_s = time.perf_counter() - t0
            usage = Usage()
            t0 = time.perf_counter()
            compute_facets(reranker, schema.attributes, [img.sha256 for img in images], usage=usage)
            facets_s = time.perf_counter() - t0
        finally:
            reranker.close()
    passes = args.refs * args.attributes * args.values
    print(f"facets from packages: {passes} passes in {facets_s:.3f} s = {passes / facets_s:.1f} "
          f"(references x values)/s, {usage.lm_tokens / passes:.0f} LM tokens/pass, vision encodes {usage.total()}")
    print(f"encode first + facets: {encode_s + facets_s:.3f} s = {(encode_s + facets_s) / facets_s:.2f}x "
          "the facets from packages")
    h = h100_arithmetic(args.values, args.text_tokens)
    print(f"H100 arithmetic, 2B at 448 px ({VISUAL_TOKENS_448} + {args.text_tokens} tokens per pass): "
          f"{h['lm_gflops_per_pass']:.0f} GFLOP per pass (the tower's encode it avoids: "
          f"{h['tower_gflops_per_image']:.0f} GFLOP per image)")
    print(f"FLOP limit: {h['passes_s']:.0f} (references x values)/s = {h['refs_s_per_attribute']:.0f} references/s "
          f"per attribute of {args.values} values")
    print(f"schema change (one attribute of {args.values} values) for {REFERENCES:,} references: "
          f"{h['schema_change_s']:.0f} s at the FLOP limit ({h['schema_change_s'] / 3600:.2f} h; at 40 % MFU "
          f"{h['schema_change_s'] / 0.4 / 3600:.2f} h)")


if __name__ == "__main__":
    main()
