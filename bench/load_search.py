"""Load test: concurrent search clients against a real server on loopback while an ingestion job runs.

    python bench/load_search.py                                  # 1, 4, 16, 64 clients, tiny checkpoints
    python bench/load_search.py --clients 1,16 --seconds 30 --size small
    python3 bench/load_search.py --size 2b --side 448 --references 400   # on a GPU box

Starts ``rubricsearch serve`` on 127.0.0.1 (a free port) with a fresh data dir, ingests a reference set,
then keeps an ingestion (zip uploads) running while, for each client count in turn, the clients search for
``--seconds``: every search is a rubric plus a NEW candidate image (never seen before, so it is encoded),
top_k 20 and rerank 20 (``--top-k``/``--top-n``); the rubric is two criteria, each judged apart (``--criteria
2``, the default: three judgements per reference), or one rubric text (``--criteria 0``: one judgement, issue
14's load workload). Prints searches/s, p50/p99 latency, the status classes, the mean GPU utilisation (NVML,
where a GPU is) and the busy cores of the server and of this load generator (CPU time over the wall: on a small
box they share the cores) per client count, with throughput
relative to one client (target: zero 5xx). Traffic goes to 127.0.0.1
only; the run is bounded in time and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import os
import statistics
import sys
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.baselines import GpuUtil  # noqa: E402
from bench.common import add_settings_args, product_settings, scratch_dir, setting, settings_line  # noqa: E402
from bench.server import ADMIN, serve  # noqa: E402
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model  # noqa: E402


def jpeg(side: int, seed: int) -> bytes:
    """A photo-like JPEG: smooth colour fields plus noise (random-noise PNGs take ~30 ms each to encode at
    448 px and weigh ~600 KB, which made the client, not the server, the bottleneck)."""
    rng = np.random.default_rng(seed)
    small = rng.integers(0, 255, (8, 8, 3), dtype=np.uint8)
    base = np.asarray(Image.fromarray(small).resize((side, side), Image.Resampling.BILINEAR), dtype=np.int16)
    base = base + rng.integers(-12, 13, base.shape, dtype=np.int16)
    buf = io.BytesIO()
    Image.fromarray(np.clip(base, 0, 255).astype(np.uint8)).save(buf, "JPEG", quality=90)
    return buf.getvalue()


def zip_of(images: list[bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i, data in enumerate(images):
            zf.writestr(f"ref-{i:04d}.jpg", data)
    return buf.getvalue()


def wait_job(client: httpx.Client, job_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not finish in {timeout_s}s")


FAILURES: dict[int, str] = {}  # the first response body per failing status: printed with the table


CRITERIA = ["short fur", "dark forehead stripes"]


async def clients(base: str, n: int, seconds: float, set_id: str, side: int, first_seed: int,
                  top_k: int, top_n: int, criteria: int = 2) -> list[tuple[int, float]]:
    """``n`` clients search back to back for ``seconds``, each with a candidate image never sent before."""
    results: list[tuple[int, float]] = []
    deadline = time.monotonic() + seconds
    counter = iter(range(first_seed, 10**12))

    async def one() -> None:
        async with httpx.AsyncClient(base_url=base, timeout=120.0) as http:
            while time.monotonic() < deadline:
                image = data_url(await asyncio.to_thread(jpeg, side, next(counter)))
                rubric = {"criteria": CRITERIA[:criteria]} if criteria else {"rubric": "; ".join(CRITERIA)}
                body = {"set_id": set_id, **rubric, "image": image, "top_k": top_k, "top_n": top_n}
                t0 = time.perf_counter()
                try:
                    r = await http.post("/v1/search", json=body)
                    status = r.status_code
                    if status >= 400:
                        FAILURES.setdefault(status, r.text[:300])
                except httpx.HTTPError as exc:
                    status = 599  # transport failure counts as a server error
                    FAILURES.setdefault(status, repr(exc)[:300])
                results.append((status, time.perf_counter() - t0))

    await asyncio.gather(*(one() for _ in range(n)))
    return results


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system, every thread) the process has used so far: cores busy = its delta / wall."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def data_url(data: bytes) -> str:
    import base64

    return "data:image/jpeg;base64," + base64.b64encode(data).decode()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", default="1,4,16,64", help="client counts, one run each")
    ap.add_argument("--seconds", type=float, default=20.0, help="per client count")
    ap.add_argument("--size", choices=["tiny", "small", "2b"], default="tiny")
    ap.add_argument("--side", type=int, default=160, help="image side in pixels")
    ap.add_argument("--references", type=int, default=40)
    ap.add_argument("--top-k", type=int, default=20)
    ap.add_argument("--top-n", type=int, default=20)
    ap.add_argument("--criteria", type=int, choices=range(len(CRITERIA) + 1), default=2,
                    help="criteria judged apart (0: one rubric text, one judgement per reference)")
    ap.add_argument("--ingest-during", type=int, default=200, help="images per zip uploaded while clients run")
    ap.add_argument("--checkpoint", help="an existing checkpoint dir for both models (default: write two)")
    ap.add_argument("--json", default=os.environ.get("OUT") and os.path.join(os.environ["OUT"], "load.json"))
    add_settings_args(ap)
    args = ap.parse_args()
    levels = [int(c) for c in args.clients.split(",")]

    root = scratch_dir("rs-load-")
    dtype = "bfloat16" if args.size == "2b" else "float32"
    emb = args.checkpoint or make_test_model(root / "emb", "embedding", size=args.size, dtype=dtype)
    rr = args.checkpoint or make_test_model(root / "rr", "reranker", size=args.size, dtype=dtype)
    # the server runs the product's settings (``--set`` exported to it) with one ingestion worker, as by default
    settings = product_settings(args, models__embedding_model=str(emb), models__reranker_model=str(rr))
    print(settings_line(settings, workers=setting(settings, "ingest.workers")), flush=True)
    with serve(root, emb, rr) as (server, base):
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120.0)
        set_id = admin.post("/v1/sets", json={"name": "load"}).json()["id"]
        refs = [jpeg(args.side, i) for i in range(args.references)]
        files = [("files", ("refs.zip", zip_of(refs), "application/zip"))]
        job = admin.post(f"/v1/sets/{set_id}/images", files=files).json()
        wait_job(admin, job["id"], 1800)
        print(f"server ready and {args.references} references ingested", flush=True)
        asyncio.run(clients(base, 2, 3.0, set_id, args.side, 10**11, args.top_k, args.top_n,
                            args.criteria))  # warm-up, discarded
        rows = []
        for batch, n in enumerate(levels):
            more = [jpeg(args.side, 10_000 + batch * args.ingest_during + i) for i in range(args.ingest_during)]
            files = [("files", (f"more{batch}.zip", zip_of(more), "application/zip"))]
            background = admin.post(f"/v1/sets/{set_id}/images", files=files).json()  # an ingestion meanwhile
            cpu0, own0, t0 = cpu_seconds(server.pid), cpu_seconds(os.getpid()), time.perf_counter()
            with GpuUtil() as util:  # NVML where a GPU is: the share of the phase some kernel ran
                results = asyncio.run(clients(base, n, args.seconds, set_id, args.side, 1_000_000 * (batch + 1),
                                              args.top_k, args.top_n, args.criteria))
            elapsed = time.perf_counter() - t0
            cores = ((cpu_seconds(server.pid) - cpu0) / elapsed, (cpu_seconds(os.getpid()) - own0) / elapsed)
            job_after = admin.get(f"/v1/jobs/{background['id']}").json()
            rows.append((n, results, elapsed, job_after, util.mean, cores))
            print(f"{n} clients: {len(results)} searches in {elapsed:.1f}s", flush=True)

    what = f"{args.criteria} criteria" if args.criteria else "a rubric (no criteria)"
    print(f"\nsearch = {what} + a new candidate image, top_k {args.top_k}, rerank {args.top_n}; "
          f"{args.size} checkpoints, {args.side}px, {args.references} references, an ingestion running")
    print(f"{'clients':>7} {'searches':>8} {'per s':>7} {'vs 1':>5} {'p50 ms':>7} {'p99 ms':>7} {'5xx':>4} "
          f"{'GPU %':>5} {'cores':>5} {'(load)':>6}  other statuses   ingestion meanwhile")
    base_rate = None
    for n, results, elapsed, job_after, gpu, cores in rows:
        lat = sorted(r[1] * 1000 for r in results) or [0.0]
        codes: dict[str, int] = {}
        for status, _ in results:
            codes[f"{status // 100}xx"] = codes.get(f"{status // 100}xx", 0) + 1
        rate = len(results) / elapsed
        base_rate = base_rate or rate
        others = {k: v for k, v in codes.items() if k not in ("2xx", "5xx")}
        print(f"{n:>7} {len(results):>8} {rate:>7.2f} {rate / base_rate:>5.2f} {statistics.median(lat):>7.0f} "
              f"{lat[int(0.99 * (len(lat) - 1))]:>7.0f} {codes.get('5xx', 0):>4} "
              f"{'-' if gpu is None else f'{gpu:.0f}':>5} {cores[0]:>5.2f} {cores[1]:>6.2f}  {others or '-'!s:<16} "
              f"{job_after['done']}/{job_after['total']} ({job_after['state']})")
    if args.json:
        Path(args.json).write_text(json.dumps([
            {"clients": n, "searches_per_s": len(results) / elapsed,
             "p50_ms": statistics.median([r[1] * 1000 for r in results] or [0.0]),
             "p99_ms": sorted(r[1] * 1000 for r in results)[int(0.99 * (len(results) - 1))] if results else 0.0,
             "5xx": sum(1 for s, _ in results if s >= 500), "gpu_util": gpu}
            for n, results, elapsed, _, gpu, _ in rows], indent=2))
    for status, text in sorted(FAILURES.items()):
        print(f"first {status} response: {text}")
    for n, _, _, job_after, _, _ in rows:
        for error in job_after.get("errors", [])[:3]:
            print(f"ingestion during {n} clients, item error: {error}")


if __name__ == "__main__":
    main()
