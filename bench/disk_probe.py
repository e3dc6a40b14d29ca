"""How fast the disk takes package files the way ingestion writes them: batches of ~1.6 MB files (a 448 px
package in float8 on the 2B architecture), each written to a temp name and renamed, then one syncfs per batch.

    python bench/disk_probe.py --dir /tmp --files 1024 --batch 64 --size-mb 1.6

Prints MB/s and files/s of the writes alone and with the syncs, so a store stage bound by the disk (rather than
by the threads around it) shows as files/s near the ingestion's images/s.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from retrieval.packages.store import syncfs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--files", type=int, default=1024)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--size-mb", type=float, default=1.6)
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="rs-disk-", dir=args.dir))
    payload = os.urandom(int(args.size_mb * 1e6))
    writing = syncing = 0.0
    try:
        for start in range(0, args.files, args.batch):
            t0 = time.perf_counter()
            for k in range(start, min(start + args.batch, args.files)):
                tmp, final = root / f"{k}.tmp", root / f"{k}.safetensors"
                tmp.write_bytes(payload)
                os.replace(tmp, final)
            t1 = time.perf_counter()
            syncfs(root)
            writing, syncing = writing + t1 - t0, syncing + time.perf_counter() - t1
    finally:
        for path in root.iterdir():
            path.unlink()
        root.rmdir()
    mb = args.files * len(payload) / 1e6
    total = writing + syncing
    print(f"{args.files} files of {len(payload) / 1e6:.2f} MB in batches of {args.batch} under {args.dir}: "
          f"writes {mb / writing:.0f} MB/s; writes + one syncfs per batch {mb / total:.0f} MB/s = "
          f"{args.files / total:.0f} files/s (syncs {100 * syncing / total:.0f} % of the time)")


if __name__ == "__main__":
    main()
