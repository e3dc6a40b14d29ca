"""Manifests the CLI sends to a server (``--server``): a folder's own ``manifest.csv`` / ``manifest.jsonl`` and
``--manifest FILE``.

Both are checked here before anything is sent (a bad row refuses the whole command, every bad row listed), then
applied once the images are in, through ``POST /v1/sets/{set}/manifest`` as one all-or-nothing step, and
reported. A folder's rows go keyed by each image's sha256, so they reach exactly the images read from that
folder, whatever other images of the set share a file name.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.retrieval.errors import InvalidInput, InvalidMetadata

if TYPE_CHECKING:
    from rubricsearch.app.client import Client

MAX_ROWS_SHOWN = 20


@dataclass
class PendingManifest:
    label: str  # how the report names it: the manifest's path
    name: str  # manifest.csv / manifest.jsonl: how the server reads ``data``
    data: bytes | None = None  # ``--manifest FILE`` as given (rows name images by file name or sha256)
    by_sha: dict[str, dict[str, Any]] = field(default_factory=dict)  # a folder's rows, by their image's sha256
    refs: dict[str, str] = field(default_factory=dict)  # sha256 -> the image's path in the folder


def refuse_loose_manifest(path: Path) -> None:
    """A manifest named among the images would be read as an image: say where it belongs instead."""
    from rubricsearch.indexer.catalog.metadata import MANIFEST_NAMES

    if path.name.lower() in MANIFEST_NAMES:
        raise InvalidInput(f"{path}: a manifest is not an image; give it with --manifest {path}, or keep it at the "
                           "root of the folder or zip whose images it describes")


def given_manifest(path: Path) -> PendingManifest:
    """``--manifest FILE``, its rows checked before anything is ingested."""
    from rubricsearch.indexer.catalog import parse_manifest

    data = path.read_bytes()
    parsed = parse_manifest(data, path.name)
    if parsed.errors:
        raise InvalidMetadata(f"{path.name}: {len(parsed.errors)} malformed row(s); nothing was ingested",
                              errors=parsed.errors)
    return PendingManifest(label=str(path), name=path.name, data=data)


def folder_rows(folder: Path, images: list[Path]) -> PendingManifest | None:
    """The folder's manifest checked against its images as a folder job checks it (every row must name one of
    them), its metadata keyed by each image's sha256; None without a manifest."""
    from rubricsearch.app.client.core import sha256_file
    from rubricsearch.indexer.jobs.manifests import folder_manifest, specs_from_manifest

    found = folder_manifest(folder)
    if found is None:
        return None
    specs = specs_from_manifest([p.relative_to(folder).as_posix() for p in images], found)
    pending = PendingManifest(label=str(folder / found[0]), name=found[0])
    for spec in specs:
        if spec.meta:
            sha = sha256_file(folder / spec.source_ref)
            pending.by_sha[sha], pending.refs[sha] = dict(spec.meta), spec.source_ref
    return pending


def apply_remote(rs: Client, set_id: str, pending: PendingManifest) -> None:
    """Apply the manifest to the images now in the set, in one request, and say what it did."""
    if pending.data is not None:
        out = rs.apply_manifest(set_id, pending.name, pending.data)
        print(f"manifest {pending.label}: applied, metadata of {out.updated} image(s) updated")
        return
    held = rs.shas(set_id)
    shas = [sha for sha in pending.by_sha if sha in held]
    missing = len(pending.by_sha) - len(shas)
    updated = 0
    if shas:
        data = "".join(json.dumps({"sha256": sha, **pending.by_sha[sha]}, ensure_ascii=False) + "\n"
                       for sha in shas).encode()
        try:
            updated = rs.apply_manifest(set_id, "manifest.jsonl", data).updated
        except InvalidMetadata as exc:  # the rows went by sha256: name each by its file again
            rows = [{"file": pending.refs[shas[int(e["line"]) - 1]] if e.get("line") else None,
                     "error": e.get("error")} for e in exc.details.get("errors", [])]
            raise InvalidMetadata(f"{pending.label}: {exc.message}", errors=rows) from None
    note = f"; {missing} row(s) not applied: their images are not in the set (see the failures above)" \
        if missing else ""
    print(f"manifest {pending.label}: applied, metadata of {updated} image(s) updated{note}")


def error_rows(details: dict[str, Any]) -> list[str]:
    """The bad rows an error lists (``details.errors``), one line each, for the terminal."""
    errors = [e for e in details.get("errors") or [] if isinstance(e, dict)]
    lines = []
    for e in errors[:MAX_ROWS_SHOWN]:
        where = ", ".join(f"{k} {e[k]}" for k in ("line", "file", "name", "url") if e.get(k) is not None)
        lines.append(f"  {where or 'row'}: {e.get('error', '')}")
    if len(errors) > MAX_ROWS_SHOWN:
        lines.append(f"  ... and {len(errors) - MAX_ROWS_SHOWN} more")
    return lines
