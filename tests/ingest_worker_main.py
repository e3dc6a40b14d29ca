"""An ingestion worker process for the crash test: recover, then process batches until idle.

``python -m tests.ingest_worker_main --data DIR --model DIR`` prints ``STARTED``, ``READY ...`` (after
recovery, with what it repaired), one ``BATCH done failed skipped lost`` line per committed batch and
``IDLE`` at the end, so the test can SIGKILL it at chosen points of its life.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--worker-id", default="crash-test-worker")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-attempts", type=int, default=10)
    parser.add_argument("--flush-interval", type=float, default=1.0)
    parser.add_argument("--loopback-urls", action="store_true", help="fetch URLs from 127.0.0.1 (a test's server)")
    args = parser.parse_args(argv)
    print("STARTED", flush=True)

    from rubricsearch.indexer.jobs import IngestionRunner, IngestionService
    from rubricsearch.indexer.sources import NetGuard, UrlFetcher
    from rubricsearch.retrieval import load_embedder
    from rubricsearch.retrieval.packages import PackageStore

    store = PackageStore(args.data / "packages", storage_dtype="float32")
    embedder = load_embedder(args.model, store=store)
    fetcher = UrlFetcher(NetGuard(allow_loopback=True)) if args.loopback_urls else None
    service = IngestionService.open_local(args.data, embedder=embedder, url_fetcher=fetcher)
    runner = IngestionRunner(
        service, worker_id=args.worker_id, batch_size=args.batch_size, max_attempts=args.max_attempts,
        flush_interval_s=args.flush_interval, load_threads=2, temp_grace_s=0,
    )
    report = runner.recover()
    reembedded = sum(r.reembedded for r in report.reconciled)
    removed = sum(r.removed for r in report.reconciled)
    print(f"READY released={report.released} abandoned={report.abandoned} reembedded={reembedded} "
          f"removed={removed} swept={report.sweep}", flush=True)
    while (result := runner.run_once()) is not None:
        print(f"BATCH {result.done} {result.failed} {result.skipped} {result.lost}", flush=True)
    runner.close()
    service.close()
    service.index.close()
    service.catalog.dispose()
    print("IDLE", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
