"""Files a person hands in, through the API's upload or the CLI, as one ingestion job: every zip enters here.

A lone archive becomes a zip job, read from its staged copy, whose root manifest gives its images metadata. An
archive sent with other files is expanded into that request's upload job (one job per request), bounded after
decompression by ``max_expanded_bytes``. Both read it through :class:`~indexer.sources.ZipSource`, with every
zip-bomb and path defence. A manifest that would not apply (one of the files, or inside an archive sent with
others) is refused, never dropped, and archives of other formats are refused rather than read as images.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, BinaryIO

from rubricsearch.indexer.catalog.metadata import MANIFEST_NAMES
from rubricsearch.indexer.jobs.manifests import MAX_MANIFEST_BYTES
from rubricsearch.indexer.sources import ZipSource
from rubricsearch.indexer.sources.archive import ARCHIVE_EXTENSIONS
from rubricsearch.retrieval.errors import (
    InvalidInput,
    InvalidMetadata,
    PayloadTooLarge,
    RubricSearchError,
    UnsupportedMedia,
)

if TYPE_CHECKING:
    from rubricsearch.indexer.catalog import JobRecord
    from rubricsearch.indexer.jobs.service import IngestionService

ZIP_MAGIC = (b"PK\x03\x04", b"PK\x05\x06")
NamedFile = tuple[str | None, BinaryIO]  # (the sender's file name, its bytes as a seekable binary file)


def is_zip(name: str | None, fp: BinaryIO) -> bool:
    """Whether a file is read as a zip archive: its first bytes, or its name (a broken zip is then refused as one,
    not failed as an image)."""
    head = fp.read(4)
    fp.seek(0)
    return head in ZIP_MAGIC or (name or "").lower().endswith(".zip")


def create_job_from_files(service: IngestionService, set_id: str, files: Sequence[NamedFile],
                          metadata: Mapping[str, Mapping[str, Any]] | None = None, *,
                          max_expanded_bytes: int | None = None) -> JobRecord:
    """One job for the files: a zip job when they are a single archive, else an upload job, with ``metadata`` by
    file name (archives carry theirs as a root manifest). ``max_expanded_bytes`` (the service's archive limit unless
    given) bounds what archives sent with other files expand to."""
    if max_expanded_bytes is None:
        max_expanded_bytes = service.max_archive_bytes
    for name, _ in files:
        _refuse_other_archives(name)
    zips = [is_zip(name, fp) for name, fp in files]
    _refuse_lost_manifests(service, set_id, files, zips, max_expanded_bytes)
    if any(zips) and metadata is not None:
        raise InvalidMetadata("archives carry their metadata as a manifest.csv or manifest.jsonl at their root, "
                              "not in the `metadata` field")
    if zips == [True]:
        name, fp = files[0]
        return service.create_job_from_zip(set_id, fp, name=name or "archive.zip")
    if not any(zips):
        return service.create_job_from_uploads(set_id, [(name, fp.read()) for name, fp in files], metadata)
    return service.create_job_from_uploads(set_id, _expand(service, files, zips, max_expanded_bytes))


def _refuse_other_archives(name: str | None) -> None:
    lower = (name or "").lower()
    suffix = next((ext for ext in ARCHIVE_EXTENSIONS if lower.endswith(ext)), None)
    if suffix is not None and suffix != ".zip":
        raise UnsupportedMedia(f"{name}: only .zip archives are read", filename=name)


def _refuse_lost_manifests(service: IngestionService, set_id: str, files: Sequence[NamedFile], zips: list[bool],
                           budget: int) -> None:
    """A manifest applies to the source it is the root of; one that would not apply is refused, never dropped."""
    for (name, _), archive in zip(files, zips, strict=True):
        base = (name or "").replace("\\", "/").rsplit("/", 1)[-1]
        if not archive and base.lower() in MANIFEST_NAMES:
            raise InvalidMetadata(f"{base}: a manifest is not an image; send it once the images are in, to "
                                  f"POST /v1/sets/{set_id}/manifest, or at the root of a zip uploaded on its own",
                                  filename=base)
    if len(files) < 2:
        return
    for (name, fp), archive in zip(files, zips, strict=True):
        if archive:
            with ZipSource(fp, service.limits, max_archive_bytes=budget) as source:
                found = source.root_file(MANIFEST_NAMES, MAX_MANIFEST_BYTES) is not None
            fp.seek(0)
            if found:
                raise InvalidMetadata(f"{name}: the manifest in this archive applies only when the archive is "
                                      "uploaded on its own (one archive per request)", filename=name)


def _expand(service: IngestionService, files: Sequence[NamedFile], zips: list[bool],
            budget: int) -> list[tuple[str | None, bytes]]:
    """The images of a request that mixes archives with other files, archive entries in place, for its upload job;
    at most ``budget`` bytes after decompression (a lone archive is streamed to staging instead)."""
    out: list[tuple[str | None, bytes]] = []
    total = 0
    for (name, fp), archive in zip(files, zips, strict=True):
        if not archive:
            out.append((name, fp.read()))
            total += len(out[-1][1])
        else:
            total = _entries(out, total, name or "archive.zip", fp, service, budget)
        if total > budget:
            raise PayloadTooLarge(f"the upload exceeds {budget} bytes", limit=budget)
    return out


def _entries(out: list[tuple[str | None, bytes]], total: int, name: str, fp: BinaryIO, service: IngestionService,
             budget: int) -> int:
    with ZipSource(fp, service.limits, max_archive_bytes=budget) as source:
        for ref in source.refs():
            try:
                data = source.load(ref)
            except RubricSearchError as exc:
                raise InvalidInput(f"{name}: entry {ref!r} cannot be read ({exc.kind}: {exc.message}); upload the "
                                   "archive on its own for a per-entry report", archive=name, entry=ref) from exc
            out.append((ref, data))
            total += len(data)
            if total > budget:
                raise PayloadTooLarge(f"these files expand to more than {budget} bytes; upload each archive on "
                                      "its own", limit=budget)
    return total
