"""Memory of the served models at the product's defaults: loaded, after an ingestion, after a search.

The app (``create_app`` at the defaults, both models local) loads the two checkpoints, ingests ``--images``
noise images of ``--size`` px through ``POST /v1/sets/{set}/images`` and answers one rubric search with a
candidate. On a CUDA box it prints what ``nvidia-smi`` reports for the device (sampled every 0.2 s for the peak)
beside torch's allocated bytes; elsewhere the process's peak RSS. With ``rubricsearch make-test-model DIR --size
2b`` checkpoints the memory is that of the real 2B architecture (weights' values do not change it).

    python bench/gpu_memory.py --embedding E2B --reranker R2B [--images 32] [--size 448]
"""

from __future__ import annotations

import argparse
import io
import resource
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = "bench-admin-key-0123456789abcdef"
CRITERIA = "short fur\ntriangular ears\ndark forehead stripes"


def device_mib() -> int | None:
    """Memory in use on the first GPU as nvidia-smi reports it (None without one)."""
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True, check=False).stdout.split()
    return int(out[0]) if out else None


def rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def png(seed: int, size: int) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 255, (size, size, 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, "PNG")
    return buf.getvalue()


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", required=True)
    ap.add_argument("--reranker", required=True)
    ap.add_argument("--images", type=int, default=32)
    ap.add_argument("--size", type=int, default=448)
    args = ap.parse_args()

    import torch
    from fastapi.testclient import TestClient
    from pydantic import SecretStr

    from rubricsearch.app.main import create_app
    from rubricsearch.app.settings import Settings

    cuda = torch.cuda.is_available() and device_mib() is not None
    peak = [device_mib() or 0]
    done = threading.Event()

    def sample() -> None:
        while not done.wait(0.2):
            peak[0] = max(peak[0], device_mib() or 0)

    def line(stage: str) -> None:
        if cuda:
            peak[0] = max(peak[0], device_mib() or 0)
            allocated, most = torch.cuda.memory_allocated() / 2**20, torch.cuda.max_memory_allocated() / 2**20
            print(f"{stage}: device {device_mib()} MiB (nvidia-smi), torch allocated {allocated:.0f} MiB, max "
                  f"{most:.0f} MiB", flush=True)
        else:
            print(f"{stage}: peak RSS {rss_mib():.0f} MiB", flush=True)

    print(f"settings: defaults, {args.images} images of {args.size} px, device {'cuda' if cuda else 'cpu'}; "
          f"idle {peak[0]} MiB")
    threading.Thread(target=sample, daemon=True).start()
    data = Path(tempfile.mkdtemp(prefix="rubricsearch-memory-"))
    settings = Settings(_env_file=None, data_dir=data, models={"embedding_model": args.embedding,
                                                               "reranker_model": args.reranker},
                                                               auth={"admin_api_keys": [SecretStr(KEY)],
                                                                     "search_api_keys": [SecretStr(KEY)]})
    auth = {"Authorization": f"Bearer {KEY}"}
    try:
        with TestClient(create_app(settings), raise_server_exceptions=False) as client:
            line("loaded")
            client.post("/v1/sets", json={"name": "memory"}, headers=auth).raise_for_status()
            files = [("files", (f"i{i}.png", png(i, args.size), "image/png")) for i in range(args.images)]
            job = client.post("/v1/sets/memory/images", files=files, headers=auth).json()
            while job["state"] in ("queued", "running"):
                time.sleep(0.2)
                job = client.get(f"/v1/jobs/{job['id']}", headers=auth).json()
            assert job["state"] == "succeeded", job
            line(f"ingested {args.images}")
            r = client.post("/v1/search", data={"set_id": "memory", "criteria": CRITERIA, "top_k": "20", "top_n": "5"},
                            files={"image": ("c.png", png(10**6, args.size), "image/png")}, headers=auth)
            assert r.status_code == 200, r.text
            line("searched")
    finally:
        done.set()
        shutil.rmtree(data, ignore_errors=True)
    if cuda:
        print(f"peak device memory {peak[0]} MiB (nvidia-smi, sampled every 0.2 s and at each stage)")


if __name__ == "__main__":
    main()
