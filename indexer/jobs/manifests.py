"""Metadata that comes with a source at ingestion: a ``manifest.csv`` / ``manifest.jsonl`` at the root of a zip
or folder, a metadata object per uploaded file or per imported URL, turned into the job's items.

Each item carries its image's metadata (``job_items.meta``) to the commit that creates the image, and to the
vector upsert as its payload. A bad manifest refuses the job before anything is queued, with every bad row
listed: a row that names no entry of the source, names one twice, or is malformed.
"""

from __future__ import annotations

import posixpath
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from rubricsearch.indexer.catalog import ItemSpec, check_metadata
from rubricsearch.indexer.catalog.metadata import MANIFEST_NAMES, ManifestRow, duplicate_rows, iter_manifest
from rubricsearch.retrieval.errors import InvalidMetadata, PayloadTooLarge

MAX_MANIFEST_BYTES = 64 << 20


def _bounded(data: bytes, name: str) -> bytes:
    if len(data) > MAX_MANIFEST_BYTES:
        raise PayloadTooLarge(f"{name} is over {MAX_MANIFEST_BYTES} bytes", limit=MAX_MANIFEST_BYTES)
    return data


def folder_manifest(folder: Path) -> tuple[str, bytes] | None:
    """The manifest at the folder's root, if it has one (a regular file, not a link)."""
    for name in MANIFEST_NAMES:
        path = folder / name
        if path.is_file() and not path.is_symlink():
            with open(path, "rb") as fh:
                return name, _bounded(fh.read(MAX_MANIFEST_BYTES + 1), name)
    return None


def _normal(ref: str) -> str:
    """A source entry's path as :func:`manifest_path` reads a manifest's ``file`` cell."""
    return posixpath.normpath(ref.replace("\\", "/").lstrip("/"))


def specs_from_manifest(refs: Sequence[str], manifest: tuple[str, bytes] | None) -> list[ItemSpec]:
    """The job's items with each entry's metadata from the manifest (rows name entries by ``file``)."""
    if manifest is None:
        return [ItemSpec(ref) for ref in refs]
    name, data = manifest
    errors: list[dict[str, Any]] = []
    by_ref = {_normal(ref): ref for ref in refs}
    meta: dict[str, dict[str, Any]] = {}
    lines: dict[str, int] = {}  # entry -> the line naming it
    # a row at a time: what stays is each entry's metadata, which becomes its item, not every parsed row besides
    for row in iter_manifest(data, name):
        if not isinstance(row, ManifestRow):
            errors.append(row)
            continue
        ref = by_ref.get(row.file or "")
        if row.file is None:
            errors.append({"line": row.line, "error": "an ingestion manifest names images by `file` (their sha256 "
                           "is known once they are read)"})
        elif ref is None:
            errors.append({"line": row.line, "error": f"{row.file!r} is not an image of this source"})
        elif ref in lines:
            errors += duplicate_rows([(lines[ref], ref), (row.line, ref)])
        else:
            lines[ref] = row.line
            meta[ref] = check_metadata({k: v for k, v in row.change.items() if v is not None},
                                       where=f"line {row.line}")
    if errors:
        raise InvalidMetadata(f"{name}: {len(errors)} row(s) are wrong; no job was created",
                              errors=sorted(errors, key=lambda e: int(e["line"]))[:1000])
    return [ItemSpec(ref, meta=meta.get(ref)) for ref in refs]


def specs_from_objects(refs: Sequence[str], names: Sequence[str | None],
                       metadata: Mapping[str, Mapping[str, Any]] | Sequence[Mapping[str, Any] | None] | None,
                       what: str) -> list[ItemSpec]:
    """Items for uploads (``metadata`` keyed by file name) or URLs (one object or None per URL, in order)."""
    if metadata is None:
        return [ItemSpec(ref) for ref in refs]
    if isinstance(metadata, Mapping):
        unknown = sorted(set(metadata) - {n for n in names if n})
        if unknown:
            raise InvalidMetadata(f"metadata names {len(unknown)} {what}(s) not in the request",
                                  errors=[{"name": n, "error": f"no {what} of that name"} for n in unknown[:1000]])
        objects: list[Mapping[str, Any] | None] = [metadata.get(n or "") for n in names]
    else:
        objects = list(metadata)
    specs = []
    for ref, name, obj in zip(refs, names, objects, strict=True):
        specs.append(ItemSpec(ref, meta=check_metadata(obj, where=f"{what} {name}") if obj else None))
    return specs
