"""``bench/filter_search.py --against REF``: the same bench on this product and on an older one (a folder holding
its ``retrieval/``, or a git ref exported with ``git archive``), each arm in its own process with its own product
first on the path, then both arms' p50s and recalls side by side."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench.* from any working directory

from bench.filter_cases import CASES, ROOT

BENCH = Path(__file__).with_name("filter_search.py")


def product_tree(ref: str, work: Path) -> Path:
    """A folder holding an older product: ``ref`` itself if it is one, else ``git archive`` of that ref."""
    if Path(ref).is_dir():
        return Path(ref).resolve()
    # imported here, in the parent process only: an arm must import retrieval/ from its own product alone
    from bench.common import export

    return export(ref, work, "retrieval")


def against(argv: list[str], ref: str) -> list[dict[str, Any]]:
    """Run this bench on this product and on ``ref``'s, one process each, and print their p50s side by side."""
    work = Path(tempfile.mkdtemp(prefix="filter-bench-"))
    try:
        arms = {"this tree": ROOT, ref: product_tree(ref, work / "old")}
        results: dict[str, list[dict[str, Any]]] = {}
        for label, tree in arms.items():
            print(f"\n== {label} ({tree}) ==", flush=True)
            out = work / f"{len(results)}.json"
            subprocess.run([sys.executable, str(BENCH), *argv, "--product", str(tree), "--json", str(out)], check=True,
                           env={**os.environ, "PYTHONPATH": str(tree)})
            results[label] = json.loads(out.read_text())
    finally:
        shutil.rmtree(work, ignore_errors=True)
    new, old = ([r for r in results[arm] if "ef_scale" not in r] for arm in ("this tree", ref))
    print(f"\n== p50 ms (/ unfiltered), recall: this tree vs {ref} ==")
    for a, b in zip(new, old, strict=True):
        for c, title in CASES if a["filter"] != "none" else (("", "unfiltered"),):
            if a.get(c + "p50_ms") is not None:
                print(f"{a['path']:>6} {a['filter']:>6} {title:>26}  {a[c + 'p50_ms']:8.3f} ({a[c + 'ratio']:.2f}x), "
                      f"{a.get(c + 'recall') or 1:.3f}  vs {b[c + 'p50_ms']:8.3f} ({b[c + 'ratio']:.2f}x), "
                      f"{b.get(c + 'recall') or 1:.3f}")
    return new
