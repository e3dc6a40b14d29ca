"""Soak test: searches, ingestions and deletes interleaved against a real server on loopback for a long time,
watching the server process for leaks.

    python bench/soak.py --minutes 30                 # tiny checkpoints on the CPU (the issue's run)
    python bench/soak.py --minutes 3 --clients 4      # a quick look

Starts ``rubricsearch serve`` on 127.0.0.1 with a fresh data dir and a reference set, then until the time is up:
``--clients`` search clients (rubric + a new candidate image each time), one zip ingestion of ``--batch`` new
images every ``--ingest-every`` seconds, and after each ingestion the deletion of as many of the oldest images.
Every ``--sample-every`` seconds it records the server's RSS, open file descriptors and threads (from /proc),
and what its bounded caches hold (query-image packages, the package memory tier; from /metrics): RSS minus
the caches is what must stay flat.
Prints the samples, the growth of each from the end of the warm-up (the first ``--warmup`` of the run) to
the end (target: < 10 %), and the status classes of all requests (target: 0 x 5xx).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import httpx

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import add_settings_args, product_settings, scratch_dir, settings_line  # noqa: E402
from bench.load_search import clients, jpeg, wait_job, zip_of  # noqa: E402
from bench.server import ADMIN, serve  # noqa: E402
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model  # noqa: E402


def proc_sample(pid: int) -> dict[str, float]:
    """RSS (MiB), open file descriptors and threads of a live process, read from /proc."""
    status = Path(f"/proc/{pid}/status").read_text()
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    return {"rss_mib": int(fields["VmRSS"].split()[0]) / 1024, "fds": len(os.listdir(f"/proc/{pid}/fd")),
            "threads": int(fields["Threads"])}


def cache_mib(base: str) -> float:
    """Bytes the server's bounded caches hold now (query-image tier + package memory tier), from /metrics."""
    total = 0.0
    for line in httpx.get(f"{base}/metrics", timeout=30).text.splitlines():
        if line.startswith(("rubricsearch_query_packages_bytes ", 'rubricsearch_package_store_bytes{tier="memory"}')):
            total += float(line.rsplit(" ", 1)[1])
    return total / (1 << 20)


def churn(base: str, set_id: str, stop: threading.Event, args: argparse.Namespace, codes: dict[str, int]) -> None:
    """Ingest a zip of new images, then delete as many of the oldest, until ``stop``."""
    seed = 100_000
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120) as admin:
        while not stop.wait(args.ingest_every):
            batch = [jpeg(args.side, seed + i) for i in range(args.batch)]
            seed += args.batch
            r = admin.post(f"/v1/sets/{set_id}/images", files=[("files", ("churn.zip", zip_of(batch),
                                                                          "application/zip"))])
            codes[f"{r.status_code // 100}xx"] = codes.get(f"{r.status_code // 100}xx", 0) + 1
            if r.status_code != 202:
                continue
            wait_job(admin, r.json()["id"], 600)
            page = admin.get(f"/v1/sets/{set_id}/images", params={"limit": args.batch}).json()
            for image in page["data"]:
                d = admin.delete(f"/v1/sets/{set_id}/images/{image['id']}")
                codes[f"{d.status_code // 100}xx"] = codes.get(f"{d.status_code // 100}xx", 0) + 1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--minutes", type=float, default=30.0)
    ap.add_argument("--warmup", type=float, default=0.2, help="share of the run before growth is measured")
    ap.add_argument("--clients", type=int, default=8)
    ap.add_argument("--side", type=int, default=160)
    ap.add_argument("--references", type=int, default=40)
    ap.add_argument("--batch", type=int, default=16, help="images per ingestion (and deletes after it)")
    ap.add_argument("--ingest-every", type=float, default=10.0)
    ap.add_argument("--sample-every", type=float, default=10.0)
    add_settings_args(ap)
    args = ap.parse_args()

    root = scratch_dir("rs-soak-")
    emb = make_test_model(root / "emb", "embedding", size="tiny")
    rr = make_test_model(root / "rr", "reranker", size="tiny")
    settings = product_settings(args, models__embedding_model=str(emb), models__reranker_model=str(rr))
    print(settings_line(settings), flush=True)
    samples: list[tuple[float, dict[str, float]]] = []
    codes: dict[str, int] = {}
    with serve(root, emb, rr) as (server, base):
        with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120) as admin:
            set_id = admin.post("/v1/sets", json={"name": "soak"}).json()["id"]
            refs = [jpeg(args.side, i) for i in range(args.references)]
            job = admin.post(f"/v1/sets/{set_id}/images", files=[("files", ("refs.zip", zip_of(refs),
                                                                            "application/zip"))]).json()
            wait_job(admin, job["id"], 600)
        stop = threading.Event()
        worker = threading.Thread(target=churn, args=(base, set_id, stop, args, codes), daemon=True)
        worker.start()
        t0 = time.monotonic()
        end = t0 + args.minutes * 60
        seed = 10**9
        while time.monotonic() < end:
            slot = min(args.sample_every, end - time.monotonic())
            results = asyncio.run(clients(base, args.clients, slot, set_id, args.side, seed, 20, 20))
            seed += 10**6
            for status, _ in results:
                codes[f"{status // 100}xx"] = codes.get(f"{status // 100}xx", 0) + 1
            sample = proc_sample(server.pid)
            sample["caches_mib"] = cache_mib(base)
            sample["rss_minus_caches_mib"] = sample["rss_mib"] - sample["caches_mib"]
            samples.append((time.monotonic() - t0, sample))
            s = samples[-1][1]
            print(f"{samples[-1][0]:7.0f}s  rss {s['rss_mib']:7.1f} MiB (bounded caches "
                  f"{s['caches_mib']:6.1f})  fds {s['fds']:4.0f}  threads "
                  f"{s['threads']:4.0f}  searches {len(results):4d} (p50 "
                  f"{statistics.median([r[1] for r in results] or [0]) * 1000:.0f} ms)", flush=True)
        stop.set()
        worker.join(timeout=600)

    warm = next((s for t, s in samples if t >= args.warmup * args.minutes * 60), samples[0][1])
    last = samples[-1][1]
    print(f"\n{args.minutes:.0f} min, {args.clients} search clients, an ingestion of {args.batch} images every "
          f"{args.ingest_every:.0f} s followed by as many deletes; status classes {codes}")
    for key in ("rss_mib", "rss_minus_caches_mib", "fds", "threads"):
        growth = (last[key] - warm[key]) / max(warm[key], 1e-9)
        print(f"  {key:20} after warm-up {warm[key]:8.1f} -> end {last[key]:8.1f}: growth {growth:+.1%}")


if __name__ == "__main__":
    main()
