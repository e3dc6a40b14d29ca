"""What refusing hostile input costs the server: time, peak memory and event-loop stall per hostile request.

    python bench/refusal_cost.py                 # tiny checkpoints on the CPU, server on 127.0.0.1
    python bench/refusal_cost.py --cap-mib 1     # the smoke size (tests/test_refusal_cost_bench.py)

Each hostile request is sent once: over-limit texts, and JSON bodies of adversarial shapes filling the JSON body
cap (a million unknown keys, millions of empty arrays or numbers, nesting 100,000 deep, one string of escapes,
unknown keys and escapes just under their limits). The line shows its status, the time to the answer, the growth of the
server's peak RSS (VmHWM, reset before each request) over its RSS before, and the event-loop stall: the slowest
/healthz answer while the request was handled, next to the slowest one over the same time with no hostile
request (a thread polls /healthz every 5 ms): the median of five sends, and the largest of their RSS peaks.
Targets: a 4xx, < 100 MB and a stall < 100 ms each. Last, 16 clients at once each send an image of 7000 x 7000
pixels: the peak RSS growth, bounded by the decoded-pixel budget rather than by the number of clients, next to
the server's RSS before them (the baseline); ``--pixel-budget`` runs it at another budget (named non-default).
"""

from __future__ import annotations

import argparse
import base64
import io
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import scratch_dir
from bench.server import serve
from rubricsearch.app.http_limits import MAX_REQUEST_BYTES
from rubricsearch.app.jsonbody import MAX_ESCAPES, MAX_JSON_DEPTH, MAX_JSON_VALUES
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import DECODE_WAIT_S
from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

MIB = 1 << 20
REPEATS = 5  # each request is sent this many times: the median stall and the largest peak RSS are shown


def _status_kb(pid: int, field: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) / 1024
    return float("nan")


def reset_peak(pid: int) -> bool:
    """Reset the process's VmHWM to its current RSS (Linux ``clear_refs`` 5); False where not permitted."""
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def filled(prefix: str, unit: str, suffix: str, size: int) -> bytes:
    """``prefix + unit * n + suffix`` of at most ``size`` bytes."""
    return (prefix + unit * ((size - len(prefix) - len(suffix)) // len(unit)) + suffix).encode()


def unknown_keys(count: int, first: str = '"set_id": "x", ') -> bytes:
    return ("{" + first + ", ".join(f'"k{i:07d}": 1' for i in range(count)) + "}").encode()


def cases(cap: int, max_values: int) -> dict[str, tuple[str, str, bytes | None]]:
    """Name -> (method, path, body) of each hostile request, sized to the JSON body cap ``cap``."""
    text = "a" * (50 * MIB)
    per_key = len('"k0000000": 1, ')
    return {
        "/v1/embeddings, 50 MiB text (over the cap)": ("POST", "/v1/embeddings", f'{{"input": "{text}"}}'.encode()),
        "/v1/embeddings, one text filling the cap": ("POST", "/v1/embeddings",
                                                     filled('{"input": "', "a", '"}', cap - 64)),
        "/v1/rerank, 50 MiB instruction (over the cap)": (
            "POST", "/v1/rerank", f'{{"query": "q", "documents": ["d"], "instruction": "{text}"}}'.encode()),
        "/v1/search, unknown keys filling the cap": ("POST", "/v1/search", unknown_keys((cap - 64) // per_key)),
        "/v1/sets, unknown keys filling the cap": ("POST", "/v1/sets", unknown_keys((cap - 64) // per_key, "")),
        "/v1/search, unknown keys just under the value limit": ("POST", "/v1/search",
                                                                unknown_keys(max_values - 10)),
        "/v1/embeddings, empty arrays filling the cap": ("POST", "/v1/embeddings",
                                                         filled('{"input": [', "[],", "[]]}", cap - 64)),
        "/v1/rerank, numbers filling the cap": ("POST", "/v1/rerank",
                                                filled('{"query": "q", "documents": [', "0,", "0]}", cap - 64)),
        "/v1/search, criteria nested 100,000 deep": ("POST", "/v1/search",
                                                     ('{"set_id": "x", "criteria": %s}' % (
                                                         "[" * 100_000 + "]" * 100_000)).encode()),
        "/v1/embeddings, one string of escapes filling the cap": ("POST", "/v1/embeddings",
                                                                  filled('{"input": "', "\\n", '"}', cap - 64)),
        "/v1/embeddings, escapes just under their limit, filled": (
            "POST", "/v1/embeddings", filled('{"input": "' + "\\n" * (MAX_ESCAPES - 10), "a", '"}', cap - 64)),
        "/v1/sets/x/images?after=10**30": ("GET", "/v1/sets/x/images?after=" + "1" + "0" * 30, None),
    }


class Poller:
    """Polls /healthz every 5 ms on its own connection; :meth:`slowest` is the worst answer time in a window."""

    def __init__(self, base: str) -> None:
        self.times: list[tuple[float, float]] = []  # (start, seconds)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(base,), daemon=True)
        self._thread.start()

    def _run(self, base: str) -> None:
        with httpx.Client(base_url=base, timeout=120) as client:
            while not self._stop.is_set():
                t0 = time.perf_counter()
                client.get("/healthz")
                self.times.append((t0, time.perf_counter() - t0))
                time.sleep(0.005)

    def slowest(self, start: float, end: float) -> float:
        """The slowest answer to a poll that was in flight at any time in ``[start, end]``."""
        return max((took for t0, took in self.times if t0 <= end and t0 + took >= start), default=float("nan"))

    def close(self) -> None:
        self._stop.set()
        self._thread.join()


def measure(pid: int, send: Callable[[], httpx.Response], poller: Poller) -> tuple[httpx.Response, float, float,
                                                                                     float, float]:
    """(response, seconds, peak RSS growth in MiB, stall in ms, the quiet stall in ms over as long)."""
    reset_peak(pid)
    time.sleep(0.05)
    rss = _status_kb(pid, "VmRSS")
    t0 = time.perf_counter()
    response = send()
    t1 = time.perf_counter()
    grew = _status_kb(pid, "VmHWM") - rss
    time.sleep(max(0.1, t1 - t0))  # as long again with no hostile request, for the quiet baseline
    t2 = time.perf_counter()
    return response, t1 - t0, grew, 1000 * poller.slowest(t0, t1), 1000 * poller.slowest(t1 + 0.02, t2)


def main(argv: list[str] | None = None) -> dict[str, tuple[int, float, float, float]]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cap-mib", type=float, default=None,
                        help="JSON body cap (default: the product's, RUBRICSEARCH_LIMITS__MAX_JSON_BYTES)")
    parser.add_argument("--image-side", type=int, default=7000,
                        help="side of each concurrent client's PNG (7000: 49 MP, under max_query_image_pixels)")
    parser.add_argument("--clients", type=int, default=16, help="concurrent clients with one image each")
    parser.add_argument("--pixel-budget", type=int, default=None,
                        help="decoded-pixel budget (default: the product's, RUBRICSEARCH_LIMITS__DECODE_PIXEL_BUDGET)")
    args = parser.parse_args(argv)
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    cap = int(args.cap_mib * MIB) if args.cap_mib else defaults.limits.max_json_bytes
    budget = args.pixel_budget or defaults.limits.decode_pixel_budget
    env = {"RUBRICSEARCH_MODELS__DTYPE": "float32", "RUBRICSEARCH_LIMITS__MAX_JSON_BYTES": str(cap),
           "RUBRICSEARCH_LIMITS__DECODE_PIXEL_BUDGET": str(budget)}
    named = "" if cap == defaults.limits.max_json_bytes else ", non-default"
    print(f"settings: max_json_bytes={cap} ({cap / MIB:.1f} MiB{named}) max_json_values={MAX_JSON_VALUES} "
          f"max_json_depth={MAX_JSON_DEPTH} max escapes={MAX_ESCAPES} "
          f"max_request_bytes={MAX_REQUEST_BYTES}; tiny checkpoints, CPU")
    root = scratch_dir("rs-refusal-")
    emb = make_test_model(root / "emb", "embedding", size="tiny")
    rr = make_test_model(root / "rr", "reranker", size="tiny")
    results: dict[str, tuple[int, float, float, float]] = {}
    with serve(root, emb, rr, **env) as (server, base), httpx.Client(base_url=base, timeout=300) as client:
        client.post("/v1/embeddings", json={"input": "warm-up"})
        poller = Poller(base)
        if not reset_peak(server.pid):
            print("(cannot reset VmHWM here: growth is over the run's earlier peak)")
        print(f"{'request':<56} {'status':>6} {'seconds':>8} {'peak RSS':>10} {'stall':>9} {'quiet':>8}  type")
        try:
            for name, (method, path, body) in cases(cap, MAX_JSON_VALUES).items():
                def send(method: str = method, path: str = path, body: bytes | None = body) -> httpx.Response:
                    return client.request(method, path, content=body, headers={"content-type": "application/json"})

                runs = sorted((measure(server.pid, send, poller) for _ in range(REPEATS)), key=lambda m: m[3])
                r, took, _, stall, quiet = runs[len(runs) // 2]  # the run of the median stall
                grew = max(m[2] for m in runs)
                kind = r.json()["error"]["type"] if r.status_code >= 400 else "-"
                print(f"{name:<56} {r.status_code:>6} {took:>8.3f} {grew:>6.1f} MiB {stall:>6.1f} ms "
                      f"{quiet:>5.1f} ms  {kind}")
                results[name] = (r.status_code, took, grew, stall)
        finally:
            poller.close()
        results.update(concurrent_images(server.pid, base, args.image_side, args.clients, budget))
        assert client.get("/healthz").status_code == 200
        print("server still answers /healthz")
    return results


def concurrent_images(pid: int, base: str, side: int, clients: int,
                      budget: int) -> dict[str, tuple[int, float, float, float]]:
    """``clients`` embeddings requests at once, each with its own ``side`` x ``side`` PNG (distinct pixels, so
    none is cached): the peak RSS growth is bounded by the decoded-pixel budget ``budget``, not by the clients."""
    defaults = Settings(_env_file=None)  # type: ignore[call-arg]
    images = ["data:image/png;base64," + base64.b64encode(_tinted(side, k)).decode() for k in range(clients)]
    reset_peak(pid)
    time.sleep(0.05)
    rss = _status_kb(pid, "VmRSS")
    statuses: list[int] = []
    t0 = time.perf_counter()

    def one(url: str) -> None:
        with httpx.Client(base_url=base, timeout=600) as c:
            statuses.append(c.post("/v1/embeddings", json={"input": [{"image": url}]}).status_code)

    threads = [threading.Thread(target=one, args=(url,)) for url in images]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    took = time.perf_counter() - t0
    grew = _status_kb(pid, "VmHWM") - rss
    per_image = side * side
    at_once = max(1, budget // per_image)
    named = "" if budget == defaults.limits.decode_pixel_budget else ", non-default"
    name = f"{clients} concurrent embeddings, one {side}x{side} PNG each"
    print(f"{name}: {statuses.count(200)} x 200, {statuses.count(503)} x 503 (Retry-After), in {took:.1f} s; "
          f"peak RSS +{grew:.0f} MiB over a baseline RSS of {rss:.0f} MiB = {grew / min(at_once, clients):.0f} MiB "
          f"({grew * MIB / (min(at_once, clients) * per_image):.1f} bytes per pixel) per image decoding at once "
          f"(budget {budget} pixels{named}: {min(at_once, clients)} such images at once, "
          f"wait {DECODE_WAIT_S:g} s)")
    return {name: (max(statuses), took, grew, float("nan"))}


def _tinted(side: int, k: int) -> bytes:
    """A ``side`` x ``side`` PNG of one colour (the ``k``-th): small on the wire, ``side``² pixels decoded."""
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (side, side), (200, 30 + k, 90)).save(buf, format="PNG", optimize=True)
    return buf.getvalue()


if __name__ == "__main__":
    main()
