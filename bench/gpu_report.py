"""The GPU report: every maintained GPU benchmark at the product's defaults, side by side, in one run.

Sections (each a bench of this folder, run as a subprocess on one random-weight 2B checkpoint written once):
ingestion of 448 px squares, of a mixed-size set and of 12-MP photos; search p50 with a 448 px and with a 12-MP
JPEG candidate (rubric + candidate, rerank 20, and 3 criteria + candidate); the load test. Each row stands beside
the official class path, the raw transformers pieces and the FLOP limit, with GPU utilisation and MFU.

    python bench/gpu_report.py                          # on a GPU: the whole report, about 8 minutes on an H100
    python bench/gpu_report.py --budget 300 --only search_photo        # stop a section that would outrun 300 s
    python bench/gpu_report.py --nvjpeg --only ingest_448,ingest_mixed,ingest_photo   # gpu-nvjpeg beside them
    python bench/gpu_report.py --against bf6bcf4 --only ingest_448,search_448   # A/B against an older commit
    python bench/gpu_report.py --smoke                  # CPU, tiny checkpoint, small sizes: the report runs

``--against REF`` exports REF's tree (``git archive``) into a temporary folder, copies this folder's benches into
it and runs each section there too, alternating with this tree's run, so both arms share one box, one lease and
one bench code; the table shows both and their ratio. ``--set NAME=VALUE`` runs every section (both arms) with that
setting, and the table's header names every setting that is not the product's default.

The report prints each section's wall time and the total. ``--budget`` (default 540 s, so the report, started
within a 10-minute device call, ends inside it) bounds the whole run from its start: a section still running when
the budget is spent is stopped and the rest are skipped, each named in the table, which is printed either way.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.common import (  # noqa: E402
    add_settings_args,
    apply_overrides,
    export,
    non_default,
    product_settings,
)
from bench.namespace_alias import MOVED_TO_PLUGIN, namespace_alias  # noqa: E402

# name -> (bench script, its arguments at full size, at smoke size)
SECTIONS: dict[str, tuple[str, list[str], list[str]]] = {
    "ingest_448": ("ingest_throughput.py", ["--kind", "square", "--side", "448", "--images", "512", "--repeats", "3",
                                            "--baselines"],
                   ["--kind", "square", "--side", "64", "--images", "8", "--baselines"]),
    "ingest_mixed": ("ingest_throughput.py", ["--kind", "mixed", "--side", "640", "--images", "512", "--repeats", "3",
                                              "--baselines"],
                     ["--kind", "mixed", "--side", "96", "--images", "8", "--baselines"]),
    "ingest_photo": ("ingest_throughput.py", ["--kind", "photo", "--images", "64", "--repeats", "2", "--baselines"],
                     ["--kind", "photo", "--images", "2", "--baselines"]),
    "search_448": ("search_latency.py", ["--kind", "square", "--side", "448", "--references", "200", "--baselines"],
                   ["--kind", "square", "--side", "64", "--references", "8", "--repeats", "1", "--top-k", "4",
                    "--top-n", "4", "--baselines"]),
    "search_photo": ("search_latency.py", ["--kind", "photo", "--references", "40", "--baselines"],
                     ["--kind", "photo", "--references", "3", "--repeats", "1", "--top-k", "2", "--top-n", "2",
                      "--baselines"]),
    # rubric + a new 448 px candidate, rerank 20: search_448's "rubric + candidate", whose baselines it reuses
    "load": ("load_search.py", ["--side", "448", "--references", "400", "--clients", "1,16", "--seconds", "20",
                                "--ingest-during", "200", "--criteria", "0"],
             ["--side", "64", "--references", "6", "--clients", "1,2", "--seconds", "2", "--ingest-during", "4",
              "--criteria", "0"]),
}
# photos at a tiny model's scale: seconds on two cores
SMOKE_SETTINGS = ["models.device=cpu", "models.max_pixels=65536"]
BUDGET_S = 540.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"comma list of sections: {', '.join(SECTIONS)}")
    ap.add_argument("--nvjpeg", action="store_true",
                    help="opt-in comparison: each ingestion section again with preprocess=gpu-nvjpeg")
    ap.add_argument("--against", metavar="REF", help="also run each section on a checkout of this git ref")
    ap.add_argument("--smoke", action="store_true", help="CPU, a tiny checkpoint, small sizes (checks the report)")
    ap.add_argument("--out", default=os.environ.get("OUT"), help="folder for each run's JSON and log")
    ap.add_argument("--budget", type=float, default=BUDGET_S,
                    help="seconds for the whole report: a section that would outrun it is stopped, the rest skipped")
    add_settings_args(ap)
    args = ap.parse_args()
    names = [n.strip() for n in args.only.split(",") if n.strip()]
    if set(names) - SECTIONS.keys():
        raise SystemExit(f"unknown sections {sorted(set(names) - SECTIONS.keys())}: {', '.join(SECTIONS)}")
    pairs = [*SMOKE_SETTINGS, *args.settings] if args.smoke else list(args.settings)
    apply_overrides(pairs)
    args.settings = pairs
    settings = product_settings(args)
    work = Path(tempfile.mkdtemp(prefix="rs-gpu-report-"))
    out = Path(args.out) if args.out else work / "out"
    out.mkdir(parents=True, exist_ok=True)
    trees = {"this tree": ROOT}
    started = time.perf_counter()
    try:
        if args.against:
            trees[args.against] = checkout(args.against, work / "against")
        ckpt = checkpoint(work, smoke=args.smoke)
        setup_s = time.perf_counter() - started
        results: dict[tuple[str, str], Any] = {}
        walls: dict[tuple[str, str], float | None] = {}
        arms: list[tuple[str, list[str]]] = [(name, []) for name in names]
        if args.nvjpeg:
            arms += [(name, ["--set", "models.preprocess=gpu-nvjpeg"]) for name in names if name.startswith("ingest")]
        for i, (name, extra) in enumerate(arms):
            order = list(trees.items()) if i % 2 == 0 else list(trees.items())[::-1]  # alternate which goes first
            for label, tree in order:
                key = (label, name + (" nvjpeg" if extra else ""))
                left = args.budget - (time.perf_counter() - started)
                results[key], walls[key] = run(tree, name, extra, pairs, ckpt, out, args.smoke, left)
        total = time.perf_counter() - started
        print(f"\n== GPU report: {non_default(settings)}; {total:.0f}s ==")
        print("\n".join(summary(results, list(trees))))
        print("\n".join(wall_times(walls, list(trees), setup_s, total, args.budget)))
    finally:
        shutil.rmtree(work, ignore_errors=True)


def checkout(ref: str, where: Path) -> Path:
    """``ref``'s files (:func:`bench.common.export`) with this tree's benches copied in: the same bench code runs
    the older product."""
    export(ref, where)
    for path in (ROOT / "bench").glob("*.py"):
        shutil.copy2(path, where / "bench" / path.name)
    alias_moved_modules(where)
    namespace_alias(where)
    return where


def alias_moved_modules(old: Path) -> None:
    """Lets this tree's benches import an older tree whose modules sat elsewhere (before ``retrieval/qwen/`` was
    split into layer folders): each missing module becomes an alias of the old one, the same module object, so
    the benches' timers patch what the old product runs."""
    qwen = ROOT / "retrieval" / "qwen"
    layered = {(new.parent.name, new.stem) for new in qwen.glob("*/*.py")}
    # the modules since moved into the accelerated plug-in, by the layered names they had in between
    moved = [dotted.split(".")[2:] for dotted in MOVED_TO_PLUGIN.values() if dotted.count(".") == 3
             and dotted.startswith("retrieval.qwen.")]
    layered |= {(layer, name) for layer, name in moved} | {(layer, "__init__") for layer, _ in moved}
    for layer, name in sorted(layered):
        flat = old / "retrieval" / "qwen" / f"{name}.py"
        target = old / "retrieval" / "qwen" / layer / f"{name}.py"
        if target.exists() or not (flat.exists() or name == "__init__"):
            continue
        target.parent.mkdir(exist_ok=True)
        target.write_text("" if name == "__init__" else
                          "import importlib\nimport sys\n\n"
                          f"sys.modules[__name__] = importlib.import_module('retrieval.qwen.{name}')\n")


def checkpoint(work: Path, *, smoke: bool) -> Path:
    """One random-weight reranker checkpoint for every section (it serves as the embedder too: one tower)."""
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    return make_test_model(work / "ckpt", "reranker", size="tiny" if smoke else "2b",
                           dtype="float32" if smoke else "bfloat16")


def run(tree: Path, name: str, extra: list[str], pairs: list[str], ckpt: Path, out: Path, smoke: bool, left: float,
        ) -> tuple[Any, float | None]:
    """One section in one tree, given ``left`` seconds; its output streamed through; its JSON (None when it failed)
    and its wall time (None when it did not start: no time left). ``pairs`` go to it as ``--set``, so that it
    exports them under the names its tree reads (an older tree's settings are flat)."""
    if left <= 0:
        print(f"\n!! {name} skipped in {tree}: the report's budget is spent", flush=True)
        return None, None
    script, full, small = SECTIONS[name]
    tag = f"{name}{'-nvjpeg' if extra else ''}-{tree.name}"
    target = out / f"{tag}.json"
    cmd = [sys.executable, str(tree / "bench" / script), *(small if smoke else full), "--checkpoint", str(ckpt),
           "--json", str(target), *extra, *(arg for pair in pairs for arg in ("--set", pair))]
    if script != "load_search.py" and smoke:
        cmd += ["--size", "tiny"]
    print(f"\n== {name}{' (preprocess=gpu-nvjpeg)' if extra else ''} in {tree}: {' '.join(cmd[1:])}", flush=True)
    # the tree first, then whatever the caller put on the path (packages carried to a GPU box, say)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(tree), os.environ.get("PYTHONPATH")) if p)}
    started = time.perf_counter()
    # its own process group, so a stop also ends what it started (the load test's server)
    proc = subprocess.Popen(cmd, cwd=tree, env=env, process_group=0)
    try:
        code: int | None = proc.wait(timeout=left)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        code = None
    wall = time.perf_counter() - started
    print(f"== {name} took {wall:.0f}s", flush=True)
    if code != 0 or not target.exists():
        why = "stopped at the report's budget" if code is None else f"exit {code}"
        print(f"!! {name} failed in {tree} ({why})", flush=True)
        return None, wall
    return json.loads(target.read_text()), wall


def wall_times(walls: dict[tuple[str, str], float | None], labels: list[str], setup_s: float, total: float,
               budget: float) -> list[str]:
    """Each section's wall time per tree, then the report's total against its budget."""
    lines = ["", f"{'section':<20} {'wall s':<50}" + "".join(f" {label:>12}" for label in labels),
             f"{'(setup)':<20} {'export, checkpoint':<50} {setup_s:>12.0f}"]
    for section in dict.fromkeys(name for _, name in walls):
        values = [walls.get((label, section)) for label in labels]
        lines.append(f"{section:<20} {'':<50}" + "".join(f" {'skipped' if v is None else f'{v:.0f}':>12}"
                                                         for v in values))
    lines.append(f"{'total':<20} {f'budget {budget:.0f}':<50} {total:>12.0f}")
    return lines


def _ingest(r: dict[str, Any]) -> list[tuple[str, str]]:
    ing, base = r["ingest"], r.get("baselines", {})
    mfu = ing.get("mfu")
    return [("images/s (median)", f"{ing['median_images_per_s']:.1f}"),
            ("GPU busy %", "-" if ing.get("gpu_util") is None else f"{ing['gpu_util']:.0f}"),
            ("MFU", "-" if mfu is None else f"{mfu:.2f}"),
            ("official class path images/s", f"{base.get('official_images_per_s', float('nan')):.1f}"),
            ("official class path: images timed, warm-up (cold: none)",
             f"{base.get('official_images', '?')}, {'cold' if base.get('official_cold') else 'warm'}"),
            ("raw transformers pieces images/s", f"{base.get('raw_images_per_s', float('nan')):.1f}"),
            ("FLOP limit images/s", "-" if ing.get("flop_limit") is None else f"{ing['flop_limit']:.0f}")]


def _search(r: dict[str, Any]) -> list[tuple[str, str]]:
    gpu = r.get("gpu_util")
    rows = [("query stage / candidate's own vision + LM", f"{r['query_stage_over_own']:.2f}"),
            ("GPU busy % over the searches", "-" if gpu is None else f"{gpu:.0f}")]
    for case in ("rubric + candidate", "3 criteria + candidate"):
        base = r.get("baselines", {}).get(case, {})
        limit = base.get("flop_limit_ms")
        rows += [(f"{case}: p50 ms", f"{r['cases'][case]['total']:.1f}"),
                 (f"{case}: official class path ms", f"{base.get('official_ms', float('nan')):.1f}"),
                 (f"{case}: raw transformers pieces ms", f"{base.get('raw_ms', float('nan')):.1f}"),
                 (f"{case}: official/raw: 1 run, warm-up (cold: none)",
                  "/".join("cold" if base.get(f"{path}_cold") else "warm" for path in ("official", "raw"))),
                 (f"{case}: FLOP limit ms", "-" if limit is None else f"{limit:.3g}"),
                 (f"{case}: MFU", "-" if limit is None else f"{limit / r['cases'][case]['total']:.3g}")]
    return rows


def _load(r: list[dict[str, Any]], search: dict[str, Any] | None) -> list[tuple[str, str]]:
    """Each client level, beside one search at a time through the official class path and the FLOP limit of the
    same search (search_448's "rubric + candidate" of the same tree), and the MFU that the rate implies."""
    base = (search or {}).get("baselines", {}).get("rubric + candidate", {})
    flop_ms = base.get("flop_limit_ms")
    rows = [("official class path searches/s (one at a time)",
             f"{1000 / base['official_ms']:.2f}" if base.get("official_ms") else "-"),
            ("FLOP limit searches/s", f"{1000 / flop_ms:.0f}" if flop_ms else "-")]
    for level in r:
        gpu, n = level.get("gpu_util"), level["clients"]
        rows += [(f"{n} clients: searches/s", f"{level['searches_per_s']:.2f}"),
                 (f"{n} clients: p50 ms", f"{level['p50_ms']:.0f}"),
                 (f"{n} clients: 5xx", str(level["5xx"])),
                 (f"{n} clients: GPU busy %", "-" if gpu is None else f"{gpu:.0f}"),
                 (f"{n} clients: MFU", f"{level['searches_per_s'] * flop_ms / 1000:.3g}" if flop_ms else "-")]
    return rows


ROWS: dict[str, Callable[[Any, Any], list[tuple[str, str]]]] = {
    "ingest": lambda r, _: _ingest(r), "search": lambda r, _: _search(r), "load": _load}


def summary(results: dict[tuple[str, str], Any], labels: list[str]) -> list[str]:
    """One table: a row per section and metric, a column per tree, and their ratio with two trees."""
    sections = list(dict.fromkeys(name for _, name in results))
    head = f"{'section':<20} {'metric':<50}" + "".join(f" {label:>12}" for label in labels)
    lines = [head + ("  ratio" if len(labels) == 2 else ""), "-" * len(head)]
    for section in sections:
        per = {label: ROWS[section.split("_")[0]](results[(label, section)], results.get((label, "search_448")))
               if results.get((label, section)) is not None else None for label in labels}
        metrics = next((dict(rows) for rows in per.values() if rows), {})
        for metric in metrics:
            values = [dict(per[label] or {}).get(metric, "failed") for label in labels]
            ratio = ""
            if len(values) == 2:
                try:
                    ratio = f"  {float(values[0]) / float(values[1]):.2f}x"
                except (ValueError, ZeroDivisionError):
                    ratio = ""
            lines.append(f"{section:<20} {metric:<50}" + "".join(f" {v:>12}" for v in values) + ratio)
        if not metrics:
            lines.append(f"{section:<20} {'(failed)':<50}")
    return lines


if __name__ == "__main__":
    main()
