"""The data commands against a running server (``--server URL``), through the typed client ``app.client``.

In-process commands open the data dir themselves, which a running server may hold (its FAISS files, its
SQLite catalog); with ``--server`` (or ``RUBRICSEARCH_CLIENT_URL``) the same commands go through the REST API
instead, with the server's limits, auth and error envelope, from any machine that can reach it.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

from rubricsearch.app.cli.confirm import refused
from rubricsearch.retrieval.errors import InvalidInput, NotFound

if TYPE_CHECKING:
    from rubricsearch.app.client import Client
    from rubricsearch.app.schemas.jobs import JobOut

URL_ENV = "RUBRICSEARCH_CLIENT_URL"
KEY_ENV = "RUBRICSEARCH_CLIENT_KEY"
MAX_ERRORS_SHOWN = 20


def add_server_options(parser: Any) -> None:
    """``--server`` and ``--api-key`` on a data command (after the command name, like its other options)."""
    parser.add_argument("--server", metavar="URL", default=os.environ.get(URL_ENV) or None,
                        help=f"use a running server's REST API instead of the local data dir (env {URL_ENV})")
    parser.add_argument("--api-key", metavar="KEY", default=os.environ.get(KEY_ENV) or None,
                        help=f"Bearer key for --server (env {KEY_ENV}; admin key for sets and ingestion)")


def client(args: argparse.Namespace) -> Client | None:
    """The client for ``--server``, or None to work in this process."""
    if not getattr(args, "server", None):
        return None
    from rubricsearch.app.client import Client

    return Client(args.server, api_key=args.api_key)


def folder_files(folder: Path) -> tuple[list[Path], list[Path], list[tuple[Path, str]]]:
    """The image files under ``folder``, the zip archives (each sent as its own job, as a local ingest makes
    it one), and what else it holds with why it is not sent (its root manifest aside: that one is applied)."""
    from rubricsearch.indexer.catalog.metadata import MANIFEST_NAMES
    from rubricsearch.indexer.sources.base import IMAGE_EXTENSIONS

    images: list[Path] = []
    archives: list[Path] = []
    ignored: list[tuple[Path, str]] = []
    for p in sorted(p for p in folder.rglob("*") if p.is_file()):
        if p.suffix.lower() in IMAGE_EXTENSIONS:
            images.append(p)
        elif p.suffix.lower() == ".zip":
            archives.append(p)
        elif p.name.lower() in MANIFEST_NAMES:
            if p.parent != folder:
                ignored.append((p, "a manifest applies only at the root of the folder given"))
        else:
            ignored.append((p, f"not an image file name ({p.suffix.lower() or 'no extension'})"))
    return images, archives, ignored


def files_to_upload(paths: list[Path]) -> list[Path]:
    """Image files and zips as given, folders expanded to the image files under them (what else a folder holds
    is named, as a folder job lists its ignored entries)."""
    from rubricsearch.app.cli.manifests import refuse_loose_manifest

    out: list[Path] = []
    for path in paths:
        if path.is_dir():
            images, archives, ignored = folder_files(path)
            out += images + archives
            for archive in archives:
                print(f"{archive}: a zip archive in the folder, ingested as its own job")
            for p, why in ignored[:MAX_ERRORS_SHOWN]:
                print(f"  ignored: {p}: {why}")
        elif path.is_file():
            refuse_loose_manifest(path)
            out.append(path)
        else:
            raise NotFound(f"no such file or folder: {path}")
    return out


def print_jobs(jobs: list[JobOut]) -> None:
    for job in jobs:
        print(f"job {job.id} ({job.kind}, {job.source}): {job.state}: {job.done} indexed, {job.skipped} skipped "
              f"(already in the set), {job.failed} failed, of {job.total}")
        print_job_details(job, sys.stdout)


def print_job_details(job: JobOut, out: TextIO) -> None:
    """The manifest a job applied, its failures and the entries its source ignored (the first of each)."""
    if job.manifest is not None:
        print(f"  manifest {job.manifest.name}: applied, metadata for {job.manifest.images} image(s)", file=out)
    for err in job.errors[:MAX_ERRORS_SHOWN]:
        print(f"  failed: {err.ref or '(job)'}: {err.error}", file=out)
    for entry in job.ignored_entries[:MAX_ERRORS_SHOWN]:
        print(f"  ignored: {entry.ref}: {entry.reason}", file=out)


def ingest(rs: Client, args: argparse.Namespace) -> int:
    """Upload (resuming by sha256: files the set already holds are not sent), import URLs, or wait for jobs;
    then apply the folders' manifests and ``--manifest``, each checked before anything was sent."""
    from rubricsearch.app.cli.manifests import apply_remote, folder_rows, given_manifest
    from rubricsearch.indexer.sources.urls import url_list

    set_id = rs.get_set(args.set).id
    progress = not args.quiet
    files = files_to_upload(list(args.paths))
    manifests = [m for path in args.paths if path.is_dir()
                 if (m := folder_rows(path, folder_files(path)[0])) is not None]
    if args.manifest is not None:
        manifests.append(given_manifest(args.manifest))
    jobs = [rs.wait(job_id, progress=progress) for job_id in args.resume]
    if files:
        jobs += rs.ingest(set_id, files, resume=True, progress=progress)
    if args.urls is not None:
        urls, metadata = url_list(args.urls.read_text())
        items: list[Any] = [{"url": u, "metadata": metadata[u]} if u in metadata else u for u in urls if u]
        jobs.append(rs.wait(rs.import_urls(set_id, items).id, progress=progress))
    if not (jobs or files or args.urls is not None):
        raise InvalidInput("nothing to ingest: give image files, folders, zips, --urls FILE or --resume JOB")
    if not jobs:
        print("nothing to send: the set already holds every file")
    print_jobs(jobs)
    for pending in manifests:
        apply_remote(rs, set_id, pending)
    bad = any(j.failed or j.state != "succeeded" for j in jobs)
    return 1 if bad else 0


def create_set(rs: Client, args: argparse.Namespace) -> int:
    out = rs.create_set(args.name, description=args.description or None, dimensions=args.dimensions)
    print(f"created set {out.name!r} (id {out.id}, dimensions {out.dimensions or 'the model hidden size'})")
    return 0


def set_rows(rs: Client) -> list[tuple[Any, ...]]:
    return [(s.id, s.name, s.dimensions or "-", s.counts.indexed, s.counts.pending, s.counts.failed,
             s.created_at.strftime("%Y-%m-%d %H:%M")) for s in rs.list_sets().data]


def delete_set(rs: Client, args: argparse.Namespace) -> int:
    record = rs.get_set(args.set)
    if not args.yes:
        status = refused(f"delete set {record.name!r} ({record.id}) on {args.server} with all its images?")
        if status is not None:
            return status
    rs.delete_set(record.id)
    print(f"deleted set {record.name!r} ({record.id})")
    return 0


def candidate_ref(value: str | None) -> Any:
    """A file becomes a data URL; a sha256 names an image the server has ingested."""
    if value is None:
        return None
    path = Path(value)
    if path.is_file():
        from rubricsearch.app.client.core import data_url

        return data_url(path)
    if len(value) == 64 and all(c in "0123456789abcdefABCDEF" for c in value):
        return {"image_id": value.lower()}
    raise NotFound(f"no such image file: {value}")
