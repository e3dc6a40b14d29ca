"""Peak memory of reading a large manifest, as the upload route does (from the spooled file, a line at a time,
each row's image reference kept in a temporary SQLite file), beside the file's size and its largest row.

Writes a CSV and a JSONL manifest of ``--rows`` rows (sha256, label, category, price, tags) to a temp dir and, in
a fresh process each, reads it with ``--root``'s code (default: this checkout; ``--mode read``: apply_manifest's
check of every row, else ``parse_manifest``), printing the peak RSS growth over the process' baseline.

    .venv/bin/python bench/manifest_memory.py --rows 300000 [--mode read|parse|whole|source] [--root /other/checkout]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(root: str, path: str) -> None:
    sys.path.insert(0, root)
    from rubricsearch.indexer.catalog import parse_manifest

    mode = os.environ.get("BENCH_MODE", "read")
    if mode == "read":  # apply_manifest's first read, whose memory the second (a chunk at a time) stays under
        from rubricsearch.indexer.catalog import Catalog
        from rubricsearch.indexer.jobs.metadata import ManifestRefs, check_manifest

        catalog = Catalog.open(f"sqlite:///{Path(path).parent / 'catalog.db'}", migrate=False)  # sha256 rows: unread
    if mode == "source":  # a zip's or folder's manifest made into the job's items (their metadata is kept)
        from rubricsearch.indexer.jobs.manifests import specs_from_manifest

        entries = [f"img/{i}.png" for i in range(int(os.environ["BENCH_ROWS"]))]  # the source's, held anyway
    base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    with open(path, "rb") as fh:
        if mode == "read":
            with tempfile.TemporaryDirectory() as tmp, ManifestRefs(Path(tmp)) as refs:
                rows = check_manifest(catalog, "bench", fh, Path(path).name, refs)
        elif mode == "source":
            rows = len(specs_from_manifest(entries, (Path(path).name, fh.read())))
        else:  # every row parsed and held, from the file object or from its bytes read whole
            rows = len(parse_manifest(fh if mode == "parse" else fh.read(), Path(path).name).rows)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(json.dumps({"rows": rows, "growth": (peak - base) * 1024}))


def write(directory: Path, rows: int, by: str) -> dict[str, tuple[Path, int]]:
    csv_path, jsonl_path = directory / "manifest.csv", directory / "manifest.jsonl"
    largest = {"csv": 0, "jsonl": 0}
    with csv_path.open("w") as c, jsonl_path.open("w") as j:
        c.write(f"{by},label,category,price,tags\n")
        for i in range(rows):
            sha = f"{i:064x}" if by == "sha256" else f"img/{i}.png"
            label = f"Reference number {i} of the catalogue, a longer label to look like real ones"
            line = f'{sha},"{label}",category-{i % 50},{i % 997},red;blue;tag-{i % 13}\n'
            c.write(line)
            obj = json.dumps({by: sha, "label": label, "category": f"category-{i % 50}", "price": i % 997,
                              "tags": ["red", "blue", f"tag-{i % 13}"]}) + "\n"
            j.write(obj)
            largest["csv"], largest["jsonl"] = max(largest["csv"], len(line)), max(largest["jsonl"], len(obj))
    return {"csv": (csv_path, largest["csv"]), "jsonl": (jsonl_path, largest["jsonl"])}


def main() -> None:
    if len(sys.argv) == 4 and sys.argv[1] == "--child":
        child(sys.argv[2], sys.argv[3])
        return
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=300_000)
    parser.add_argument("--root", default=str(ROOT), help="the checkout whose parse_manifest is measured")
    parser.add_argument("--mode", choices=["read", "parse", "whole", "source"], default="read",
                        help="read: apply_manifest's check of every row; parse: parse_manifest holding every row "
                        "from the file; whole: parse_manifest from the file's bytes read whole (main's route); "
                        "source: a zip's or folder's manifest (rows by file) made into the job's items")
    args = parser.parse_args()
    env = {**os.environ, "BENCH_MODE": args.mode, "BENCH_ROWS": str(args.rows)}
    with tempfile.TemporaryDirectory() as tmp:
        files = write(Path(tmp), args.rows, "file" if args.mode == "source" else "sha256")
        print(f"root {args.root}, mode {args.mode}")
        print("| manifest | file MiB | rows | largest row B | peak RSS growth MiB | growth / file |")
        print("|---|---|---|---|---|---|")
        for kind, (path, largest) in files.items():
            out = subprocess.run([sys.executable, __file__, "--child", args.root, str(path)], env=env,
                                 capture_output=True, text=True, check=True)
            got = json.loads(out.stdout.strip().splitlines()[-1])
            size = path.stat().st_size
            print(f"| {kind} | {size / 2**20:.1f} | {got['rows']} | {largest} | {got['growth'] / 2**20:.0f} | "
                  f"{got['growth'] / size:.1f} |")


if __name__ == "__main__":
    main()
