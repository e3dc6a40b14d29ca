"""Judgments as the API sees them: references named by id or sha256, a JSONL upload read line by line, records
shown with their reference's sha256, and who judged when the caller does not say."""

from __future__ import annotations

import json
from collections.abc import Iterator, Sequence
from typing import Any

from fastapi.exceptions import RequestValidationError
from pydantic import TypeAdapter, ValidationError
from sqlalchemy.orm import Session

from rubricsearch.app.auth import Principal
from rubricsearch.app.schemas.judgments import JudgmentIn, JudgmentLine, JudgmentOut
from rubricsearch.indexer.catalog import JudgmentRecord, JudgmentSource, JudgmentSpec, find_images, get_images
from rubricsearch.indexer.catalog.judgments import MAX_BATCH
from rubricsearch.retrieval.errors import NotFound, PayloadTooLarge

# A line holds one judgment: a 500-character criterion written as \u escapes, a sha256, an author and the
# export's other fields fit well within this.
MAX_LINE_BYTES = 8192
_LINE = TypeAdapter(JudgmentLine)


def author_of(principal: Principal, given: str | None) -> str | None:
    """The judgment's author: as given, else the API key's short hash (never the key)."""
    if given is not None:
        return given
    return f"key:{principal.key_id}" if principal.key_id and not principal.session else None


def specs_for(session: Session, set_id: str, items: Sequence[JudgmentIn | JudgmentLine],
              author: str | None) -> list[JudgmentSpec]:
    """The items as judgments of catalog ids; a sha256 that is not in the set is a 404 naming it."""
    shas = [item.sha256 for item in items if item.sha256 is not None]
    found = find_images(session, set_id, shas)
    missing = sorted({sha for sha in shas if sha not in found})
    if missing:
        raise NotFound("reference not found in this set", set_id=set_id, sha256=missing[:20], missing=len(missing))
    specs: list[JudgmentSpec] = []
    for item in items:
        image_id = found[item.sha256].id if item.sha256 is not None else item.image_id
        assert image_id is not None  # JudgmentIn names exactly one; JudgmentLine always a sha256
        specs.append(JudgmentSpec(image_id, item.criterion, item.holds, JudgmentSource(item.source),
                                  item.author if item.author is not None else author))
    return specs


def outs(session: Session, records: Sequence[JudgmentRecord]) -> list[JudgmentOut]:
    images = get_images(session, [r.image_id for r in records])
    return [JudgmentOut(id=r.id, image_id=r.image_id, sha256=images[r.image_id].sha256, criterion=r.criterion,
                        holds=r.holds, source=r.source.value, author=r.author, created_at=r.created_at)
            for r in records if r.image_id in images]  # an image deleted meanwhile took its judgments along


def jsonl(items: Sequence[JudgmentOut]) -> Iterator[bytes]:
    for item in items:
        yield (item.model_dump_json() + "\n").encode()


def parse_jsonl(body: bytes) -> list[JudgmentLine]:
    """Every line of a JSONL upload (blank lines skipped), all valid or a 422 listing the bad lines."""
    lines = [(n, line) for n, line in enumerate(body.split(b"\n"), start=1) if line.strip()]
    if len(lines) > MAX_BATCH:
        raise PayloadTooLarge(f"at most {MAX_BATCH} judgments per upload; split the file (e.g. split -l {MAX_BATCH})",
                              given=len(lines), limit=MAX_BATCH)
    out: list[JudgmentLine] = []
    errors: list[dict[str, Any]] = []
    for n, line in lines:
        where = ("body", f"line {n}")
        if len(line) > MAX_LINE_BYTES:
            errors.append({"loc": where, "msg": f"a line is at most {MAX_LINE_BYTES} bytes", "type": "too_long"})
            continue
        try:
            out.append(_LINE.validate_python(json.loads(line)))
        except json.JSONDecodeError as exc:
            errors.append({"loc": where, "msg": f"not JSON: {exc.msg}", "type": "json_invalid"})
        except (ValidationError, RecursionError) as exc:
            details = exc.errors() if isinstance(exc, ValidationError) else [{"loc": (), "msg": "nested too deeply"}]
            errors.extend({**e, "loc": (*where, *e["loc"])} for e in details)
    if errors:
        raise RequestValidationError(errors)
    return out
