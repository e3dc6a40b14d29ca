"""``rubricsearch ingest SET PATH... | --urls FILE``: ingest in this process, with a progress bar.

The command creates the jobs exactly as the API would (a folder, a zip, or the given image files), then
runs the worker loop itself, so no server is needed (and none may hold the same FAISS directory). The exit
status is 1 when items failed, 0 otherwise; an interrupted run leaves its jobs queued: ``--resume JOB``
continues one.
"""

from __future__ import annotations

import argparse
import io
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TextIO

from rubricsearch.app.cli.remote import add_server_options, client, ingest
from rubricsearch.app.cli.sets import cli_settings

if TYPE_CHECKING:
    from rubricsearch.indexer.catalog import JobRecord

BAR_WIDTH = 30
MAX_ERRORS_SHOWN = 20  # as app.cli.remote.print_job_details shows them


def register(sub: Any) -> None:
    p = sub.add_parser("ingest", help="ingest images, folders, zips or a URL list into a set (here, or --server)")
    p.add_argument("set", help="the set's id or name")
    p.add_argument("paths", nargs="*", type=Path, help="image files, folders and/or .zip archives")
    p.add_argument("--urls", type=Path, default=None, help="a text file with one image URL per line, or JSONL: "
                   "one {\"url\": ..., \"metadata\": {...}} object per line")
    p.add_argument("--manifest", type=Path, default=None, help="a manifest.csv or manifest.jsonl giving the "
                   "ingested images metadata (rows name images by file name, path in their zip or folder, or "
                   "sha256); applied once the jobs finish, all rows or none")
    p.add_argument("--resume", metavar="JOB", action="append", default=[], help="continue an unfinished job")
    p.add_argument("--batch-size", type=int, default=None,
                   help="items per batch (default: 64 with a CUDA device, 8 on the CPU)")
    p.add_argument("--quiet", action="store_true", help="no progress bar")
    add_server_options(p)
    p.set_defaults(func=run)


class ProgressBar:
    """``[#####.....]  50% 15/30  done 14  skipped 0  failed 1`` redrawn in place on stderr."""

    def __init__(self, total: int, stream: TextIO, enabled: bool = True) -> None:
        self.total = total
        self.stream = stream
        self.enabled = enabled
        self.started = time.monotonic()

    def draw(self, done: int, skipped: int, failed: int) -> None:
        if not self.enabled:
            return
        processed = done + skipped + failed
        frac = 1.0 if self.total == 0 else min(1.0, processed / self.total)
        filled = round(frac * BAR_WIDTH)
        rate = processed / max(time.monotonic() - self.started, 1e-6)
        self.stream.write(f"\r[{'#' * filled}{'.' * (BAR_WIDTH - filled)}] {frac:4.0%} {processed}/{self.total}"
                          f"  done {done}  skipped {skipped}  failed {failed}  {rate:.1f} img/s ")
        self.stream.flush()

    def finish(self) -> None:
        if self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _create_jobs(service: Any, set_id: str, args: argparse.Namespace) -> list[JobRecord]:
    """A job per folder and per zip archive (also one inside a folder), and one for the loose image files."""
    from rubricsearch.app.cli.manifests import refuse_loose_manifest
    from rubricsearch.indexer.jobs import create_job_from_files, is_zip
    from rubricsearch.indexer.sources.urls import url_list
    from rubricsearch.retrieval.errors import InvalidInput, NotFound

    def one_job(files: list[tuple[str, BinaryIO]]) -> JobRecord:
        return create_job_from_files(service, set_id, files)

    jobs = [service.get_job(job_id) for job_id in args.resume]
    files: list[tuple[str, BinaryIO]] = []
    for path in args.paths:
        if path.is_dir():
            jobs.append(service.create_job_from_folder(set_id, path.resolve()))
            for archive in sorted(p for p in path.rglob("*") if p.suffix.lower() == ".zip" and p.is_file()):
                # a folder job takes image files only; an archive inside is its own job, said out loud
                print(f"{archive}: a zip archive in the folder, ingested as its own job")
                with archive.open("rb") as fh:
                    jobs.append(one_job([(archive.name, fh)]))
        elif not path.is_file():
            raise NotFound(f"no such file or folder: {path}")
        else:
            with path.open("rb") as fh:
                if is_zip(path.name, fh):
                    jobs.append(one_job([(path.name, fh)]))
                    continue
            refuse_loose_manifest(path)
            files.append((path.name, io.BytesIO(path.read_bytes())))
    if files:
        jobs.append(one_job(files))
    if args.urls is not None:
        urls, metadata = url_list(args.urls.read_text())
        jobs.append(service.create_job_from_urls(set_id, urls, metadata or None))
    if not jobs:
        raise InvalidInput("nothing to ingest: give image files, folders, zips, --urls FILE or --resume JOB")
    return jobs


def _run_job(runner: Any, service: Any, job: JobRecord, bar: ProgressBar, base: tuple[int, int, int]) -> JobRecord:
    while True:
        result = runner.run_once(job_id=job.id)
        job = service.get_job(job.id)
        bar.draw(base[0] + job.done, base[1] + job.skipped, base[2] + job.failed)
        if result is None or job.finished:
            return job


def _summary(service: Any, jobs: list[JobRecord], out: TextIO) -> None:
    from rubricsearch.app.cli.remote import print_job_details
    from rubricsearch.app.views import job_out

    for job in jobs:
        print(f"job {job.id} ({job.kind}): {job.state.value}: {job.done} indexed, {job.skipped} skipped "
              f"(already in the set), {job.failed} failed, of {job.total}", file=out)
        view = job_out(service, job)
        print_job_details(view, out)
        if len(view.errors) > MAX_ERRORS_SHOWN or job.failed > len(view.errors):
            print(f"  ... see `rubricsearch jobs --errors` for all {job.failed} failures", file=out)
        if not job.finished:
            print(f"  not finished (items held by another worker?); continue with --resume {job.id}", file=out)


def run(args: argparse.Namespace) -> int:
    from rubricsearch.app.cli.manifests import given_manifest
    from rubricsearch.app.sets import find_set
    from rubricsearch.app.state import foreground_runner, open_state
    from rubricsearch.indexer.catalog import JobState

    rs = client(args)
    if rs is not None:  # uploads through the API; folders are read here and their images sent
        with rs:
            return ingest(rs, args)
    # A local user may ingest any folder they can read: the import root only limits the API.
    settings = cli_settings().model_copy(update={"import_root": Path("/")})
    state = open_state(settings, ingest=True)
    try:
        service = state.ingestion
        record = find_set(state, args.set)
        manifest = None if args.manifest is None else given_manifest(args.manifest)
        jobs = _create_jobs(service, record.id, args)
        runner = foreground_runner(state, batch_size=args.batch_size)
        bar = ProgressBar(sum(j.total for j in jobs), sys.stderr, enabled=not args.quiet)
        finished: list[JobRecord] = []
        base = (0, 0, 0)
        try:
            for job in jobs:
                job = _run_job(runner, service, job, bar, base)
                finished.append(job)
                base = (base[0] + job.done, base[1] + job.skipped, base[2] + job.failed)
        except KeyboardInterrupt:
            bar.finish()
            pending = [j.id for j in jobs[len(finished):]]
            print(f"interrupted; resume with: rubricsearch ingest {args.set} "
                  + " ".join(f"--resume {j}" for j in pending), file=sys.stderr)
            return 130
        finally:
            runner.close()
        bar.finish()
        _summary(service, finished, sys.stdout)
        if manifest is not None and manifest.data is not None:
            from rubricsearch.indexer.jobs.metadata import apply_manifest

            report = apply_manifest(state.catalog, state.index, record.id, manifest.data, manifest.name)
            print(f"manifest {manifest.label}: applied, metadata of {report.updated} image(s) updated")
    finally:
        state.close()
    bad = any(j.failed or j.state in (JobState.FAILED, JobState.CANCELLED) or not j.finished for j in finished)
    return 1 if bad else 0
