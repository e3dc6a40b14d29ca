"""Load test: concurrent search clients against a real server on loopback while an ingestion job runs.

    python bench/load_search.py                      # 50 clients, 60 s, tiny offline checkpoints
    python bench/load_search.py --clients 50 --seconds 60 --size small

Starts ``rubricsearch serve`` on 127.0.0.1 (a free port) with a fresh data dir, ingests a reference set,
then starts a second ingestion (a zip upload) and runs the clients for the given time. Prints requests/s,
latency percentiles and the count of each status class (target: zero 5xx). Traffic goes to 127.0.0.1 only;
the run is bounded in time and stops by itself.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

import httpx
import numpy as np
from PIL import Image

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from retrieval.qwen.checkpoint import make_test_model  # noqa: E402

ADMIN = "bench-admin-key-0123456789abcdef"


def png(side: int, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (side, side, 3), dtype=np.uint8)).save(buf, "PNG")
    return buf.getvalue()


def zip_of(images: list[bytes]) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for i, data in enumerate(images):
            zf.writestr(f"ref-{i:04d}.png", data)
    return buf.getvalue()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_job(client: httpx.Client, job_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        job = client.get(f"/v1/jobs/{job_id}").json()
        if job["state"] not in ("queued", "running"):
            return job
        time.sleep(0.5)
    raise TimeoutError(f"job {job_id} did not finish in {timeout_s}s")


async def clients(base: str, n: int, seconds: float, set_id: str, candidate_sha: str) -> list[tuple[int, float]]:
    results: list[tuple[int, float]] = []
    deadline = time.monotonic() + seconds
    bodies = [
        {"set_id": set_id, "rubric": "short fur, triangular ears", "top_k": 10, "top_n": 5},
        {"set_id": set_id, "criteria": ["short fur", "dark forehead stripes"], "image": {"image_id": candidate_sha},
         "top_k": 10, "top_n": 5},
        {"set_id": set_id, "rubric": "round ears", "top_k": 10, "rerank": False},
    ]

    async def one(i: int) -> None:
        async with httpx.AsyncClient(base_url=base, timeout=120.0) as http:
            k = i
            while time.monotonic() < deadline:
                t0 = time.perf_counter()
                try:
                    r = await http.post("/v1/search", json=bodies[k % len(bodies)])
                    status = r.status_code
                except httpx.HTTPError:
                    status = 599  # transport failure counts as a server error
                results.append((status, time.perf_counter() - t0))
                k += 1

    await asyncio.gather(*(one(i) for i in range(n)))
    return results


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--clients", type=int, default=50)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--size", choices=["tiny", "small"], default="tiny")
    ap.add_argument("--references", type=int, default=40)
    ap.add_argument("--ingest-during", type=int, default=120, help="images uploaded while the clients run")
    args = ap.parse_args()

    root = Path(tempfile.mkdtemp(prefix="rs-load-"))
    emb = make_test_model(root / "emb", "embedding", size=args.size)
    rr = make_test_model(root / "rr", "reranker", size=args.size)
    port = free_port()
    env = {**os.environ, "RUBRICSEARCH_DATA_DIR": str(root / "data"), "RUBRICSEARCH_EMBEDDING_MODEL": str(emb),
           "RUBRICSEARCH_RERANKER_MODEL": str(rr), "RUBRICSEARCH_ADMIN_API_KEYS": ADMIN,
           "RUBRICSEARCH_PORT": str(port), "RUBRICSEARCH_HOST": "127.0.0.1", "RUBRICSEARCH_WORKERS": "1",
           "RUBRICSEARCH_DTYPE": "float32"}
    log = open(root / "server.log", "w")  # noqa: SIM115 - closed after the server stops
    server = subprocess.Popen([sys.executable, "-m", "app.cli", "serve"], cwd=REPO, env=env, stdout=log,
                              stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{port}"
    try:
        admin = httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN}"}, timeout=120.0)
        for _ in range(240):
            try:
                if admin.get("/readyz").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        else:
            raise SystemExit(f"server did not become ready; see {root / 'server.log'}")
        set_id = admin.post("/v1/sets", json={"name": "load"}).json()["id"]
        refs = [png(160, i) for i in range(args.references)]
        files = [("files", ("refs.zip", zip_of(refs), "application/zip"))]
        job = admin.post(f"/v1/sets/{set_id}/images", files=files).json()
        wait_job(admin, job["id"], 600)
        sha = admin.get(f"/v1/sets/{set_id}/images", params={"limit": 1}).json()["data"][0]["sha256"]
        more = [png(160, 10_000 + i) for i in range(args.ingest_during)]
        files = [("files", ("more.zip", zip_of(more), "application/zip"))]
        background = admin.post(f"/v1/sets/{set_id}/images", files=files).json()

        t0 = time.perf_counter()
        results = asyncio.run(clients(base, args.clients, args.seconds, set_id, sha))
        elapsed = time.perf_counter() - t0
        job_after = admin.get(f"/v1/jobs/{background['id']}").json()
    finally:
        server.terminate()
        try:
            server.wait(timeout=30)
        except subprocess.TimeoutExpired:
            server.kill()
        log.close()

    lat = sorted(r[1] * 1000 for r in results)
    codes: dict[str, int] = {}
    for status, _ in results:
        cls = f"{status // 100}xx"
        codes[cls] = codes.get(cls, 0) + 1
    print(f"\n{args.clients} clients for {elapsed:.1f}s on 127.0.0.1 ({args.size} checkpoints, "
          f"{args.references} references, ingesting {args.ingest_during} more meanwhile)")
    print(f"requests: {len(results)}  ->  {len(results) / elapsed:.2f} requests/s")
    print(f"latency ms: p50 {statistics.median(lat):.0f}  p90 {lat[int(0.9 * (len(lat) - 1))]:.0f}  "
          f"p99 {lat[int(0.99 * (len(lat) - 1))]:.0f}  max {lat[-1]:.0f}")
    print(f"status classes: {codes}  (5xx: {codes.get('5xx', 0)})")
    print(f"background ingestion during the run: {job_after['done']} done, {job_after['failed']} failed "
          f"of {job_after['total']} ({job_after['state']})")


if __name__ == "__main__":
    main()
