"""Metadata per image: a small JSON object (``label``, ``tags``, any scalar or list fields), its bounds, the
manifests that carry it (CSV or JSONL, one row per image), and all-or-nothing updates in the catalog.

Keys are what filters name (:data:`retrieval.index.filters.KEY_RE`); values are strings, numbers, booleans
or lists of those, so every backend can filter on them the same way. Changes are JSON merge patches
(RFC 7396): a field given replaces the stored one, ``null`` removes it, fields not named stay.
"""

from __future__ import annotations

import csv
import io
import json
import math
import posixpath
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, BinaryIO

from sqlalchemy import select
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.records import ImageRecord
from rubricsearch.indexer.catalog.sets import set_row
from rubricsearch.indexer.catalog.tables import Image
from rubricsearch.retrieval.errors import InvalidMetadata
from rubricsearch.retrieval.index.filters import FACET_P_KEY, FACET_VALUE_KEY, KEY_RE
from rubricsearch.retrieval.index.values import int_problem, text_problem

MAX_BYTES = 16 * 1024
MAX_KEYS = 64
MAX_LIST = 256
MAX_MANIFEST_ROWS = 1_000_000
MAX_LINE_CHARS = 16 * MAX_BYTES  # a JSONL line longer cannot hold a row within MAX_BYTES of JSON (escapes included)
MANIFEST_NAMES = ("manifest.csv", "manifest.jsonl")
_CHUNK = 500


def _value(value: Any, where: str) -> Any:
    if isinstance(value, bool):
        return value
    if isinstance(value, int | str):
        problem = text_problem(value) if isinstance(value, str) else int_problem(value)
        if problem is not None:
            raise InvalidMetadata(f"{where}: {problem}")
        return value
    if isinstance(value, float):
        if not math.isfinite(value):
            raise InvalidMetadata(f"{where}: numbers must be finite")
        return value
    raise InvalidMetadata(f"{where}: values are strings, numbers, booleans or lists of those, "
                       f"not {type(value).__name__}")


def check_metadata(raw: Any, *, patch: bool = False, where: str = "metadata") -> dict[str, Any]:
    """A metadata object within its bounds (``patch``: ``null`` values allowed, meaning "remove")."""
    if not isinstance(raw, Mapping):
        raise InvalidMetadata(f"{where}: metadata must be a JSON object")
    if len(raw) > MAX_KEYS:
        raise InvalidMetadata(f"{where}: at most {MAX_KEYS} keys, got {len(raw)}")
    out: dict[str, Any] = {}
    for key, value in raw.items():
        if not isinstance(key, str) or not KEY_RE.match(key):
            raise InvalidMetadata(f"{where}: invalid key {str(key)[:80]!r}: 1-64 letters, digits, '_' or '-', "
                               "starting with a letter or '_'")
        if key.startswith((FACET_VALUE_KEY, FACET_P_KEY)):
            raise InvalidMetadata(f"{where}: keys starting {FACET_VALUE_KEY!r} or {FACET_P_KEY!r} hold computed facets")
        here = f"{where}.{key}"
        if value is None:
            if not patch:
                raise InvalidMetadata(f"{here}: null only removes a field in a change")
            out[key] = None
        elif isinstance(value, list):
            if len(value) > MAX_LIST:
                raise InvalidMetadata(f"{here}: lists hold at most {MAX_LIST} values")
            out[key] = [_value(v, f"{here}[{i}]") for i, v in enumerate(value)]
        else:
            out[key] = _value(value, here)
    if "label" in out and not isinstance(out["label"], str | None):
        raise InvalidMetadata(f"{where}.label: the label is a string")
    if "tags" in out and out["tags"] is not None and not (
            isinstance(out["tags"], list) and all(isinstance(t, str) for t in out["tags"])):
        raise InvalidMetadata(f"{where}.tags: tags are a list of strings")
    size = len(json.dumps(out, separators=(",", ":")).encode())
    if size > MAX_BYTES:
        raise InvalidMetadata(f"{where}: {size} bytes of JSON, over the {MAX_BYTES}-byte bound")
    return out


def merged(current: Mapping[str, Any], change: Mapping[str, Any], where: str = "metadata") -> dict[str, Any]:
    """``current`` with a merge patch applied, checked against the bounds."""
    out = {k: v for k, v in current.items() if k not in change}
    out.update((k, v) for k, v in change.items() if v is not None)
    return check_metadata(out, where=where)


# --------------------------------------------------------------------------------------------- manifests
@dataclass(frozen=True)
class ManifestRow:
    """One manifest row: the image it names (``file`` relative to the source's root, or ``sha256``) and the
    change to its metadata."""

    line: int
    file: str | None
    sha256: str | None
    change: dict[str, Any]


@dataclass(frozen=True)
class Manifest:
    rows: list[ManifestRow]
    errors: list[dict[str, Any]]  # {"line", "error"} per malformed row


def _cell(column: str, text: str) -> Any:
    """A CSV cell as a value: JSON numbers and true/false as such, ``tags`` split on ';', the rest strings."""
    text = text.strip()
    if column == "tags":
        return [t.strip() for t in text.split(";") if t.strip()]
    if text in ("true", "false"):
        return text == "true"
    try:
        number = json.loads(text)
    except ValueError:
        return text
    return number if isinstance(number, int | float) and not isinstance(number, bool) else text


def _row(line: int, raw: Mapping[str, Any], *, patch: bool) -> ManifestRow:
    fields = dict(raw)
    file, sha = fields.pop("file", None), fields.pop("sha256", None)
    if (file is None or file == "") and (sha is None or sha == ""):
        raise InvalidMetadata("a row names its image by `file` or `sha256` (the sha256 wins when both are given)")
    if sha is not None and sha != "":
        if not isinstance(sha, str) or len(sha) != 64 or any(c not in "0123456789abcdefABCDEF" for c in sha):
            raise InvalidMetadata(f"`sha256` is not a sha256 hex digest: {str(sha)[:80]!r}")
        return ManifestRow(line, None, sha.lower(), check_metadata(fields, patch=patch, where=f"line {line}"))
    if not isinstance(file, str):
        raise InvalidMetadata("`file` is a path relative to the manifest's folder")
    return ManifestRow(line, manifest_path(file), None, check_metadata(fields, patch=patch, where=f"line {line}"))


def manifest_path(file: str) -> str:
    """A ``file`` cell as the path it names inside the manifest's folder (``./a/b.png`` is ``a/b.png``); one
    that normalises outside it (``./../a.png``) names no image of the set, and saying so beats matching another."""
    path = posixpath.normpath(file.strip().replace("\\", "/").lstrip("/"))
    if path in (".", "..") or path.startswith("../"):
        raise InvalidMetadata(f"`file` {file[:200]!r} is not a path inside the manifest's folder")
    return path


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = Counter(k for k, _ in pairs)
    twice = sorted(k for k, n in keys.items() if n > 1)
    if twice:
        raise InvalidMetadata(f"key(s) {', '.join(repr(k[:80]) for k in twice[:10])} given more than once")
    return dict(pairs)


def parse_manifest(data: bytes | BinaryIO, name: str) -> Manifest:
    """Rows of a ``.csv`` (header row; empty cells leave a field alone) or ``.jsonl`` (one object a line;
    ``null`` removes a field) manifest; a malformed row is a per-row error, the file as a whole an error."""
    rows: list[ManifestRow] = []
    errors: list[dict[str, Any]] = []
    for item in iter_manifest(data, name):
        (rows if isinstance(item, ManifestRow) else errors).append(item)  # type: ignore[arg-type]
    return Manifest(rows, errors + duplicate_rows((row.line, row.file or row.sha256 or "") for row in rows))


def duplicate_rows(refs: Iterable[tuple[int, str]]) -> list[dict[str, Any]]:
    """An error for each row naming the image an earlier row names."""
    seen: dict[str, int] = {}
    errors = []
    for line, ref in refs:
        if ref in seen:
            errors.append({"line": line, "error": f"names the same image as line {seen[ref]}"})
        seen.setdefault(ref, line)
    return errors


def iter_manifest(data: bytes | BinaryIO, name: str) -> Iterator[ManifestRow | dict[str, Any]]:
    """The rows of a manifest, or ``{"line", "error"}`` for a malformed one, in order; ``data`` is read a line at
    a time (a file object is never read whole). A malformed file as a whole raises :class:`InvalidMetadata`."""
    stream = io.BytesIO(data) if isinstance(data, bytes) else data
    text = io.TextIOWrapper(stream, encoding="utf-8-sig", newline="")
    try:
        yield from _parse(text, name)
    except UnicodeDecodeError as exc:
        raise InvalidMetadata(f"{name}: a manifest is UTF-8 text ({exc})") from None
    finally:
        text.detach()  # the caller owns the stream


def _parse(text: io.TextIOWrapper, name: str) -> Iterator[ManifestRow | dict[str, Any]]:
    if name.lower().endswith(".csv"):
        reader = csv.reader(text)
        header = _csv_next(reader, name) or []
        if "file" not in header and "sha256" not in header:
            raise InvalidMetadata(f"{name}: the header needs a `file` or `sha256` column", manifest=name)
        twice = sorted(c for c, n in Counter(header).items() if n > 1 and c)
        if twice:
            raise InvalidMetadata(f"{name}: column(s) {', '.join(repr(c[:80]) for c in twice[:10])} appear more than "
                                  "once in the header", manifest=name)
        records: Iterator[tuple[int, Any]] = _csv_rows(reader, header, name)
        patch = False
    elif name.lower().endswith(".jsonl"):
        records = ((i, line) for i, line in enumerate(text, start=1) if line.strip())
        patch = True
    else:
        raise InvalidMetadata(f"{name}: a manifest is a .csv or .jsonl file", manifest=name)
    for count, (line, record) in enumerate(records):
        if count >= MAX_MANIFEST_ROWS:
            raise InvalidMetadata(f"{name}: more than {MAX_MANIFEST_ROWS} rows", manifest=name)
        try:
            if record is None:
                raise InvalidMetadata("more cells than header columns")
            if isinstance(record, str):
                if len(record) > MAX_LINE_CHARS:
                    raise InvalidMetadata(f"a line of {len(record)} characters, over the {MAX_LINE_CHARS} a row "
                                          "within the metadata bound can take")
                try:
                    record = json.loads(record, object_pairs_hook=_unique_keys)
                except ValueError as exc:
                    raise InvalidMetadata(f"not JSON: {exc}") from None
                if not isinstance(record, dict):
                    raise InvalidMetadata("each line is a JSON object")
            yield _row(line, record, patch=patch)
        except InvalidMetadata as exc:
            yield {"line": line, "error": exc.message}


def _csv_next(reader: Any, name: str) -> list[str] | None:
    """The next CSV record; a cell over the csv module's bound (far over the metadata bound) names its line."""
    try:
        return next(reader, None)
    except csv.Error as exc:
        raise InvalidMetadata(f"{name}: line {reader.line_num}: {exc} (a row's metadata is at most {MAX_BYTES} "
                              "bytes)", errors=[{"line": reader.line_num, "error": str(exc)}]) from None


def _csv_rows(reader: Any, header: list[str], name: str) -> Iterator[tuple[int, Any]]:
    while (cells := _csv_next(reader, name)) is not None:
        if not cells:
            continue  # a blank line, as DictReader skips it
        if len(cells) > len(header):
            yield reader.line_num, None
            continue
        yield reader.line_num, {k: _cell(k, v) for k, v in zip(header, cells, strict=False) if k and v.strip()}


# ----------------------------------------------------------------------------------------------- catalog
def update_metadata(session: Session, set_id: str, changes: Mapping[int | str, Mapping[str, Any]],
                    *, replace: bool = False) -> list[ImageRecord]:
    """Apply merge patches (``replace``: whole objects) to images of a set named by catalog id or sha256.

    All or nothing: an image not in the set or a result over the bounds raises :class:`InvalidMetadata` with
    every such item listed in ``details["errors"]``, and nothing is written."""
    set_row(session, set_id)
    ids = [k for k in changes if isinstance(k, int)]
    shas = [k.lower() for k in changes if isinstance(k, str)]
    rows: dict[int | str, Image] = {}
    for start in range(0, len(ids), _CHUNK):
        for row in session.scalars(select(Image).where(Image.set_id == set_id,
                                                       Image.id.in_(ids[start:start + _CHUNK]))):
            rows[row.id] = row
    for start in range(0, len(shas), _CHUNK):
        for row in session.scalars(select(Image).where(Image.set_id == set_id,
                                                       Image.sha256.in_(shas[start:start + _CHUNK]))):
            rows[row.sha256] = row
    errors: list[dict[str, Any]] = []
    new: dict[int, tuple[Image, dict[str, Any]]] = {}
    for ref, change in changes.items():
        key = ref.lower() if isinstance(ref, str) else ref
        image = rows.get(key)
        if image is None:
            errors.append({"image": ref, "error": "no such image in this set"})
            continue
        try:
            base = {} if replace else (new[image.id][1] if image.id in new else dict(image.meta or {}))
            new[image.id] = (image, merged(base, change, where=f"image {ref}"))
        except InvalidMetadata as exc:
            errors.append({"image": ref, "error": exc.message})
    if errors:
        raise InvalidMetadata(f"{len(errors)} of {len(changes)} metadata change(s) cannot be applied; nothing was "
                           "changed", errors=errors[:1000])
    for row, meta in new.values():
        row.meta = meta
    session.flush()
    return [ImageRecord.of(row) for row, _ in new.values()]


def iter_metadata(session: Session, set_id: str, *, page: int = 1000) -> Iterator[ImageRecord]:
    """Every image of a set in id order, a page at a time (an export streams it)."""
    after = 0
    while True:
        rows: Sequence[Image] = session.scalars(select(Image).where(Image.set_id == set_id, Image.id > after)
                                                .order_by(Image.id).limit(page)).all()
        if not rows:
            return
        yield from (ImageRecord.of(r) for r in rows)
        after = rows[-1].id


def count_values(session: Session, set_id: str, *, per_key: int = 20) -> tuple[int, dict[str, list[tuple[Any, int]]]]:
    """How many images of a set hold each metadata value (each element of a list counts), the ``per_key`` most
    frequent values per key, and the number of images: the counts a filter box offers to click."""
    set_row(session, set_id)
    counts: dict[str, Counter[tuple[str, Any]]] = {}
    images = 0
    for image in iter_metadata(session, set_id):
        images += 1
        for key, raw in image.meta.items():
            values = {(type(v).__name__, v) for v in (raw if isinstance(raw, list) else [raw])}
            counts.setdefault(key, Counter()).update(values)  # an image counts once per value
    return images, {key: [(value, n) for (_, value), n in counter.most_common(per_key)]
                    for key, counter in sorted(counts.items())}
