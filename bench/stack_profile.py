"""Sampling stack profiles of a running server with py-spy (``pip install py-spy``), summarised as text.

``record(pid, seconds, path, gil=...)`` samples every thread (or only the thread holding the GIL) without
pausing the process; ``summarise(path)`` prints the samples per thread name and the hottest functions, self
and inclusive. Used by ``bench/load_search.py --py-spy`` to show where a loaded server spends its time.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

_THREAD = re.compile(r"^thread \(\d+\): ?")


def available() -> str | None:
    beside = Path(sys.executable).parent / "py-spy"  # a venv's scripts are not always on PATH
    return str(beside) if beside.exists() else shutil.which("py-spy")


def record(pid: int, seconds: float, path: Path, *, gil: bool = False,
           idle: bool = False) -> subprocess.Popen[bytes] | None:
    """Start a recording in the background; the caller waits for it."""
    exe = available()
    if exe is None:
        return None
    cmd = [exe, "record", "--pid", str(pid), "--duration", str(max(1, int(seconds))), "--format", "raw",
           "--threads", "--nonblocking", "--rate", "200", "-o", str(path)]
    if gil:
        cmd.append("--gil")
    if idle:
        cmd.append("--idle")  # waiting threads too: shows where requests queue
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def profile_in_halves(pid: int, seconds: float, out_dir: Path, tag: str) -> threading.Thread:
    """All threads, waiting ones included, for the first half of ``seconds``, then only the GIL holder;
    join the returned thread."""

    def run() -> None:
        for suffix, gil in (("all", False), ("gil", True)):
            proc = record(pid, seconds / 2 - 0.3, out_dir / f"{tag}_{suffix}.txt", gil=gil, idle=not gil)
            if proc is not None:
                proc.wait()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _frame(name: str) -> str:
    """``fn (/long/path/pkg/file.py:12)`` -> ``fn (pkg/file.py:12)``."""
    return re.sub(r" \((?:/[^:]*/)?([^/:]+/[^/:]+:\d+)\)$", r" (\1)", name)


def summarise(path: Path, top: int = 18) -> list[str]:
    if not path.exists():
        return [f"(no profile at {path})"]
    threads: Counter[str] = Counter()
    self_time: Counter[str] = Counter()
    inclusive: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not stack or not count_text.isdigit():
            continue
        count = int(count_text)
        frames = _THREAD.sub("", stack).split(";")
        thread = re.sub(r"[-_ ]?\d+$", "", frames[0]) or "?"
        threads[thread] += count
        total += count
        if len(frames) > 1:
            self_time[_frame(frames[-1])] += count
            for name in {_frame(f) for f in frames[1:]}:
                inclusive[name] += count
    lines = [f"{path.name}: {total} samples; by thread: "
             + ", ".join(f"{name} {n / max(total, 1):.0%}" for name, n in threads.most_common(6))]
    lines.append("  self (leaf) functions:")
    lines += [f"    {n / max(total, 1):6.1%}  {name[:110]}" for name, n in self_time.most_common(top)]
    lines.append("  inclusive (without thread, asyncio and anyio plumbing):")
    plumbing = ("threading.py", "concurrent/futures", "asyncio/", "anyio/", "_bootstrap", "uvicorn/", "starlette/")
    kept = [(name, n) for name, n in inclusive.most_common() if not any(p in name for p in plumbing)]
    lines += [f"    {n / max(total, 1):6.1%}  {name[:110]}" for name, n in kept[:top]]
    return lines


def waits(path: Path, thread_prefix: str = "AnyIO", top: int = 12) -> list[str]:
    """Where the threads named ``thread_prefix`` are, by their deepest project frame: the queueing points."""
    if not path.exists():
        return []
    where: Counter[str] = Counter()
    total = 0
    for line in path.read_text().splitlines():
        stack, _, count_text = line.rpartition(" ")
        if not count_text.isdigit():
            continue
        frames = _THREAD.sub("", stack).split(";")
        if not frames[0].startswith(thread_prefix):
            continue
        ours = [_frame(f) for f in frames[1:] if re.search(r"\((?:/[^:]*/)?(?:app|retrieval|rerank|indexer)/", f)]
        where[" > ".join(ours[-2:]) or _frame(frames[-1])] += int(count_text)
        total += int(count_text)
    lines = [f"  where {thread_prefix} threads are (waiting included), {total} samples:"]
    lines += [f"    {n / max(total, 1):6.1%}  {name[:150]}" for name, n in where.most_common(top)]
    return lines
