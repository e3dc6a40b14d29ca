"""Where a multi-threaded GPU run spends its time, from a torch.profiler trace (``--torch-profile``).

``profiled(path)`` records CPU ops, CUDA runtime calls and GPU activity of every thread while its block runs and
writes the Chrome trace; it also notes the Python name of each thread as it runs (kineto names threads by id).
``summarise(path, names)`` then prints what the run needs before it is optimised: how busy the GPU was (the
union of kernel, copy and set intervals over the window), the busiest kernels and streams, and per thread its
CUDA runtime time (launches vs waits: ``cudaStreamSynchronize``, ``cudaEventSynchronize``, blocking copies)
and the CPU ops with the most self time.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections import Counter, defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


@contextlib.contextmanager
def profiled(path: Path, names: dict[int, str]) -> Iterator[None]:
    """Profile the block into ``path`` (Chrome trace); ``names`` gets native thread id -> Python name."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    stop = threading.Event()

    def watch() -> None:
        while not stop.wait(0.02):
            for t in threading.enumerate():
                if t.native_id is not None:
                    names.setdefault(t.native_id, t.name)

    watcher = threading.Thread(target=watch, daemon=True, name="trace-names")
    watcher.start()
    # each ingestion stage as a range of its own ("stage:NAME"), and so the claims and every wait on a queue
    # (queue-get, queue-put), so the summary can say what every thread was doing while the GPU idled
    import queue

    from indexer.jobs.model import StageTimes
    from indexer.jobs.runner import IngestionRunner

    plain, get, put, claim = StageTimes.time, queue.Queue.get, queue.Queue.put, IngestionRunner._claim

    @contextlib.contextmanager
    def annotated(self: StageTimes, stage: str) -> Iterator[None]:
        with torch.profiler.record_function(f"stage:{stage}"), plain(self, stage):
            yield

    def ranged(name: str, fn: Any) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            with torch.profiler.record_function(f"stage:{name}"):
                return fn(*args, **kwargs)
        return call

    StageTimes.time = annotated  # type: ignore[method-assign]
    queue.Queue.get, queue.Queue.put = ranged("queue-get", get), ranged("queue-put", put)  # type: ignore[method-assign]
    IngestionRunner._claim = ranged("claim", claim)  # type: ignore[method-assign]
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    try:  # every thread's ops, not only this one's; the waits on streams and events as their own events
        config = torch._C._profiler._ExperimentalConfig(profile_all_threads=True, enable_cuda_sync_events=True)
    except TypeError:  # an older torch: this thread's CPU ops only (runtime calls and GPU work still all)
        config = None
    try:
        with profile(activities=activities, experimental_config=config) as prof:
            yield
    finally:
        StageTimes.time, queue.Queue.get, queue.Queue.put = plain, get, put  # type: ignore[method-assign]
        IngestionRunner._claim = claim  # type: ignore[method-assign]
        stop.set()
        watcher.join()
    prof.export_chrome_trace(str(path))


def _union(intervals: list[tuple[float, float]]) -> float:
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop <= end:
            continue
        busy += stop - max(start, end)
        end = stop
    return busy


def _subtract_children(events: list[dict[str, Any]], inclusive: Counter[str]) -> Counter[str]:
    """Self time per op name of one thread's nested ops: each op's time minus its direct children's."""
    child: Counter[str] = Counter()
    stack: list[tuple[float, str]] = []
    for e in sorted(events, key=lambda e: (e["ts"], -e.get("dur", 0))):
        start, dur = e["ts"], e.get("dur", 0)
        while stack and stack[-1][0] <= start:
            stack.pop()
        if stack:
            child[stack[-1][1]] += dur
        stack.append((start + dur, e["name"]))
    return Counter({name: total - child[name] for name, total in inclusive.items()})


def summarise(path: Path, names: dict[int, str], top: int = 12) -> list[str]:
    trace = json.loads(path.read_text())
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    gpu = [e for e in events if e.get("cat") in GPU_CATS]
    runtime = [e for e in events if e.get("cat") in ("cuda_runtime", "cuda_sync")]
    cpu_ops = [e for e in events if e.get("cat") == "cpu_op"]
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in (*GPU_CATS, "cuda_runtime", "cpu_op")]
    if not spans:
        return [f"(no events in {path})"]
    window = max(end for _, end in spans) - min(start for start, _ in spans)
    lines = [f"torch.profiler trace {path.name}: window {window / 1e3:.1f} ms, {len(gpu)} GPU activities, "
             f"{len(runtime)} CUDA runtime calls, {len(cpu_ops)} CPU ops"]
    if gpu:
        busy = _union([(e["ts"], e["ts"] + e["dur"]) for e in gpu])
        lines.append(f"  GPU busy (union of kernels, copies, sets) {busy / 1e3:.1f} ms = {100 * busy / window:.0f}% "
                     "of the window")
        by_stream: dict[Any, list[tuple[float, float]]] = defaultdict(list)
        for e in gpu:
            by_stream[e.get("tid")].append((e["ts"], e["ts"] + e["dur"]))
        ranked = sorted(by_stream.items(), key=lambda kv: -_union(kv[1]))
        lines.append("  busy per stream: " + ", ".join(f"{sid}: {_union(iv) / 1e3:.1f} ms" for sid, iv in ranked))
        kernels: Counter[str] = Counter()
        counts: Counter[str] = Counter()
        for e in gpu:
            kernels[e["name"][:70]] += e["dur"]
            counts[e["name"][:70]] += 1
        lines.append("  top GPU activities (total ms, count):")
        lines += [f"    {t / 1e3:8.1f}  {counts[n]:6d}  {n}" for n, t in kernels.most_common(top)]
    idle = _idle([(e["ts"], e["ts"] + e["dur"]) for e in gpu], min(a for a, _ in spans), max(b for _, b in spans))
    big = [(a, b) for a, b in idle if b - a >= 1000]
    idle_ms, big_ms = sum(b - a for a, b in idle) / 1e3, sum(b - a for a, b in big) / 1e3
    lines.append(f"  GPU idle {idle_ms:.1f} ms, of it {big_ms:.1f} ms in {len(big)} gaps >= 1 ms; below, what each "
                 "thread's outermost torch op was then (ms)")
    t0 = min(a for a, _ in spans)
    tenths = [sum(max(0.0, min(b, t0 + (k + 1) * window / 10) - max(a, t0 + k * window / 10)) for a, b in idle)
              for k in range(10)]  # where in the run the GPU waited: filling and draining the pipeline, or steady
    lines.append("  GPU idle per tenth of the window (ms): " + " ".join(f"{t / 1e3:.0f}" for t in tenths))
    stages = _stage_ranges(events)
    lines += _stages_in_gaps(stages, big, big_ms, names)
    lines += _timeline(stages, big, t0, names)
    per_thread: dict[Any, Counter[str]] = defaultdict(Counter)
    for e in runtime:
        per_thread[e.get("tid")][e["name"]] += e["dur"]
    ops_by_thread: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in cpu_ops:
        ops_by_thread[e.get("tid")].append(e)
    tids = sorted(set(per_thread) | set(ops_by_thread),
                  key=lambda t: -(sum(per_thread[t].values()) + sum(e["dur"] for e in ops_by_thread[t])))
    for tid in tids:
        name = names.get(tid) if isinstance(tid, int) else None
        rt = per_thread[tid]
        lines.append(f"  thread {tid} ({name or '?'}): CUDA runtime {sum(rt.values()) / 1e3:.1f} ms; "
                     + ", ".join(f"{n} {t / 1e3:.1f}" for n, t in rt.most_common(5)))
        ops = ops_by_thread[tid]
        if ops:
            selfs = _subtract_children(ops, _inclusive(ops))
            covered = _union([(e["ts"], e["ts"] + e["dur"]) for e in ops])
            during = _overlap(_outermost(ops), big)
            if during:
                lines.append("    during the idle gaps: "
                             + ", ".join(f"{n} {t / 1e3:.1f}" for n, t in during.most_common(4)))
            lines.append(f"    in torch ops {covered / 1e3:.1f} ms ({100 * covered / window:.0f}% of the window); "
                         "by self ms: " + ", ".join(f"{n} {t / 1e3:.1f}" for n, t in selfs.most_common(6)))
    return lines


def _inclusive(ops: list[dict[str, Any]]) -> Counter[str]:
    out: Counter[str] = Counter()
    for e in ops:
        out[e["name"]] += e["dur"]
    return out


def _idle(busy: list[tuple[float, float]], start: float, stop: float) -> list[tuple[float, float]]:
    gaps, at = [], start
    for a, b in sorted(busy):
        if a > at:
            gaps.append((at, a))
        at = max(at, b)
    if stop > at:
        gaps.append((at, stop))
    return gaps


def _outermost(ops: list[dict[str, Any]]) -> list[tuple[float, float, str]]:
    out: list[tuple[float, float, str]] = []
    for e in sorted(ops, key=lambda e: (e["ts"], -e["dur"])):
        if out and e["ts"] < out[-1][1]:
            continue  # nested in the previous outermost op
        out.append((e["ts"], e["ts"] + e["dur"], e["name"]))
    return out


def _overlap(ops: list[tuple[float, float, str]], gaps: list[tuple[float, float]]) -> Counter[str]:
    """Time each op name overlaps the gaps (both sorted by start)."""
    import bisect

    out: Counter[str] = Counter()
    starts = [a for a, _ in gaps]
    for a, b, name in ops:
        k = max(0, bisect.bisect_right(starts, a) - 1)
        while k < len(gaps) and gaps[k][0] < b:
            lo, hi = max(a, gaps[k][0]), min(b, gaps[k][1])
            if hi > lo:
                out[name] += hi - lo
            k += 1
    return out


def _stage_ranges(events: list[dict[str, Any]]) -> dict[Any, list[dict[str, Any]]]:
    """Per thread, its ``stage:`` ranges (:func:`profiled`'s stages, claims and queue waits)."""
    stages: dict[Any, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and str(e.get("name", "")).startswith("stage:"):
            stages[e.get("tid")].append(e)
    return stages


def _stages_in_gaps(stages: dict[Any, list[dict[str, Any]]], gaps: list[tuple[float, float]], gaps_ms: float,
                    names: dict[int, str]) -> list[str]:
    """Per thread, the stages (nested ones too) it was in during the GPU's idle gaps; what is left of the gaps it
    spent outside every stage, claim and queue wait."""
    if not stages:
        return []
    lines = ["  stages, claims and queue waits during the idle gaps >= 1 ms (ms; 'outside': none of them):"]
    for tid, ops in sorted(stages.items(), key=lambda kv: str(names.get(kv[0], kv[0]))):
        during = _overlap(sorted((e["ts"], e["ts"] + e["dur"], e["name"][6:]) for e in ops), gaps)
        outside = gaps_ms - sum(_overlap(_outermost(ops), gaps).values()) / 1e3
        lines.append(f"    {_thread(names, tid)}: " + ", ".join(f"{n} {t / 1e3:.0f}" for n, t in during.most_common(6))
                     + f", outside {outside:.0f}")
    return lines


def _timeline(stages: dict[Any, list[dict[str, Any]]], gaps: list[tuple[float, float]], t0: float,
              names: dict[int, str]) -> list[str]:
    """Every outermost stage range per thread (queue waits left out) and every GPU gap >= 1 ms, in time order (ms
    from the window's start): the run's critical path, read off batch by batch."""
    rows: list[tuple[float, float, str]] = [(a, b, "GPU idle") for a, b in gaps]
    for tid, ops in stages.items():
        work = [e for e in ops if not e["name"].startswith("stage:queue")]
        rows += [(a, b, f"{_thread(names, tid)} {n[6:]}") for a, b, n in _outermost(work)]
    if len(rows) == len(gaps):
        return []
    return ["  timeline (ms from the window's start):"] + [
        f"    {(a - t0) / 1e3:8.1f} {(b - t0) / 1e3:8.1f}  {what}" for a, b, what in sorted(rows)]


def _thread(names: dict[int, str], tid: Any) -> str:
    return (names.get(tid) if isinstance(tid, int) else None) or str(tid)
