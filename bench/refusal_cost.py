"""What refusing hostile input costs the server: wall time and server memory for over-limit requests.

    python bench/refusal_cost.py          # tiny checkpoints on the CPU, server on 127.0.0.1

Each hostile request (a 50 MiB text to /v1/embeddings, one just under the JSON body cap, a 50 MiB rerank
instruction, criteria nested 100,000 deep, an out-of-range cursor) is sent once; the line shows its status,
the time to the answer and the growth of the server's peak RSS (VmHWM) while it was handled. Target: < 1 s
and < 100 MB each, and a 4xx.
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.server import serve
from retrieval.qwen.model.checkpoint import make_test_model

MIB = 1 << 20


def peak_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def main() -> None:
    root = Path(tempfile.mkdtemp(prefix="rs-refusal-"))
    emb = make_test_model(root / "emb", "embedding", size="tiny")
    rr = make_test_model(root / "rr", "reranker", size="tiny")
    with serve(root, emb, rr, RUBRICSEARCH_DTYPE="float32") as (server, base):
        big = "a" * (50 * MIB)
        cases = {
            "/v1/embeddings, 50 MiB text": ("POST", "/v1/embeddings", f'{{"input": "{big}"}}'),
            "/v1/embeddings, 23.9 MiB text (under the JSON cap)": ("POST", "/v1/embeddings",
                                                                  f'{{"input": "{big[: 24 * MIB - 100_000]}"}}'),
            "/v1/rerank, 50 MiB instruction": ("POST", "/v1/rerank",
                                               f'{{"query": "q", "documents": ["d"], "instruction": "{big}"}}'),
            "/v1/search, criteria nested 100,000 deep": ("POST", "/v1/search",
                                                         '{"set_id": "x", "criteria": %s}' % ("[" * 100_000
                                                                                              + "]" * 100_000)),
            "/v1/sets/x/images?after=10**30": ("GET", "/v1/sets/x/images?after=" + "1" + "0" * 30, None),
        }
        with httpx.Client(base_url=base, timeout=120) as client:
            client.post("/v1/embeddings", json={"input": "warm-up"})
            print(f"{'request':<50} {'status':>6} {'seconds':>8} {'peak RSS growth':>16}")
            for name, (method, path, body) in cases.items():
                before = peak_rss_mib(server.pid)
                t0 = time.perf_counter()
                r = client.request(method, path, content=body, headers={"content-type": "application/json"})
                took = time.perf_counter() - t0
                grew = peak_rss_mib(server.pid) - before
                print(f"{name:<50} {r.status_code:>6} {took:>8.3f} {grew:>13.1f} MiB  {r.json()['error']['type']}")
            assert client.get("/healthz").status_code == 200
            print("server still answers /healthz")


if __name__ == "__main__":
    main()
