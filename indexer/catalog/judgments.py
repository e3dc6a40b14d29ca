"""Judgments: whether a criterion holds for a reference (an image of the set), as a person, an API client or a
derivation rule judged it. One row per (set, image, criterion) cell.

A later judgment of a cell replaces the earlier with a new row (a new id), and re-recording what a cell already
says changes nothing. So a calibration that notes the largest judgment id and the count it was fitted on can
tell, from ``list_judgments(..., until_id=...)``, whether the judgments it used are still exactly those.

Functions take a session inside a caller-owned transaction (``with catalog.write() as s:``): a bulk write
validates every item before it writes any, and the caller's commit makes all of it durable at once.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import Row, Select, delete, func, insert, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.records import Page
from rubricsearch.indexer.catalog.sets import set_row
from rubricsearch.indexer.catalog.tables import Image, Judgment, JudgmentSource, ReferenceSet, utcnow
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound, PayloadTooLarge
from rubricsearch.retrieval.index.values import text_problem

MAX_CRITERION = 500
MAX_AUTHOR = 200
# One request is one transaction, and on SQLite a write transaction holds the catalog's only write lock (every
# ingest worker waits on it): a batch stays small enough to commit quickly. Larger imports are several requests.
MAX_BATCH = 10_000
# A refit scores every judged (reference, criterion) pair with the reranker, so a set's judgments are bounded
# to keep that work finite.
MAX_PER_SET = 100_000
MAX_PAGE = 1000
_CHUNK = 500
_COLUMNS = (Judgment.id, Judgment.set_id, Judgment.image_id, Judgment.criterion, Judgment.holds, Judgment.source,
            Judgment.author, Judgment.created_at)


@dataclass(frozen=True, slots=True)
class JudgmentRecord:
    id: int
    set_id: str
    image_id: int
    criterion: str
    holds: bool
    source: JudgmentSource
    author: str | None
    created_at: datetime

    @classmethod
    def of(cls, row: Judgment | Row[*tuple[Any, ...]]) -> JudgmentRecord:
        return cls(id=row.id, set_id=row.set_id, image_id=row.image_id, criterion=row.criterion,
                   holds=bool(row.holds), source=JudgmentSource(row.source), author=row.author,
                   created_at=row.created_at)


@dataclass(frozen=True, slots=True)
class JudgmentSpec:
    """One judgment to record: the cell (image, criterion), the answer, and who gave it."""

    image_id: int
    criterion: str
    holds: bool
    source: JudgmentSource = JudgmentSource.API
    author: str | None = None


def _printable(text: Any, limit: int) -> str | None:
    """``text`` stripped when it is 1..limit characters of storable text without control characters."""
    cleaned = text.strip() if isinstance(text, str) else ""
    if not cleaned or len(cleaned) > limit or any(ord(c) < 32 for c in cleaned) or text_problem(cleaned):
        return None
    return cleaned


def clean_criterion(text: Any) -> str:
    """The stored form of a criterion: stripped, 1..MAX_CRITERION printable characters."""
    cleaned = _printable(text, MAX_CRITERION)
    if cleaned is None:
        raise InvalidInput(f"criterion must be 1..{MAX_CRITERION} printable characters once stripped",
                           criterion=ascii(text)[:80])
    return cleaned


def clean_author(author: Any) -> str | None:
    if author is None:
        return None
    cleaned = _printable(author, MAX_AUTHOR)
    if cleaned is None:
        raise InvalidInput(f"author must be 1..{MAX_AUTHOR} printable characters (or absent)",
                           author=ascii(author)[:80])
    return cleaned


def _clean(spec: JudgmentSpec) -> JudgmentSpec:
    if isinstance(spec.image_id, bool) or not isinstance(spec.image_id, int):
        raise InvalidInput("image_id must be an integer", image_id=str(spec.image_id)[:80])
    if not isinstance(spec.holds, bool):
        raise InvalidInput("holds must be true or false", holds=str(spec.holds)[:80])
    try:
        source = JudgmentSource(spec.source)
    except ValueError:
        raise InvalidInput("unknown judgment source", source=str(spec.source)[:80]) from None
    return JudgmentSpec(spec.image_id, clean_criterion(spec.criterion), spec.holds, source, clean_author(spec.author))


def _lock_set(session: Session, set_id: str) -> None:
    """The set must exist; on PostgreSQL its row is share-locked, so a concurrent delete waits for this commit
    (SQLite's write transaction holds the whole database already)."""
    if session.get(ReferenceSet, set_id, with_for_update={"read": True}) is None:
        raise NotFound("reference set not found", set_id=set_id)


def _check_images(session: Session, set_id: str, image_ids: Iterable[int]) -> None:
    wanted = sorted(set(image_ids))
    found: set[int] = set()
    for start in range(0, len(wanted), _CHUNK):
        chunk = wanted[start:start + _CHUNK]
        stmt = select(Image.id).where(Image.set_id == set_id, Image.id.in_(chunk)).with_for_update(read=True)
        found.update(session.scalars(stmt))
    missing = [i for i in wanted if i not in found]
    if missing:
        raise NotFound("reference not found in this set", set_id=set_id, image_ids=missing[:20],
                       missing=len(missing))


def record_judgments(session: Session, set_id: str, specs: Sequence[JudgmentSpec], *,
                     max_items: int = MAX_BATCH) -> list[JudgmentRecord]:
    """Record judgments (all or none: any bad item raises before anything is written); returns one record per
    cell in the order given, a cell given twice taking its last judgment."""
    if len(specs) > max_items:
        raise PayloadTooLarge(f"at most {max_items} judgments per request", given=len(specs), limit=max_items)
    cleaned = [_clean(spec) for spec in specs]
    _lock_set(session, set_id)
    _check_images(session, set_id, (c.image_id for c in cleaned))
    cells = {(c.image_id, c.criterion): c for c in cleaned}
    existing = _existing(session, set_id, list(cells))
    changed = [c for key, c in cells.items() if not _same(existing.get(key), c)]
    replaced = [existing[(c.image_id, c.criterion)].id for c in changed if (c.image_id, c.criterion) in existing]
    total = session.scalar(select(func.count(Judgment.id)).where(Judgment.set_id == set_id)) or 0
    if total - len(replaced) + len(changed) > MAX_PER_SET:
        raise PayloadTooLarge(f"a set holds at most {MAX_PER_SET} judgments", set_id=set_id, stored=total,
                              adding=len(changed) - len(replaced), limit=MAX_PER_SET)
    for start in range(0, len(replaced), _CHUNK):
        session.execute(delete(Judgment).where(Judgment.id.in_(replaced[start:start + _CHUNK]))
                        .execution_options(synchronize_session=False))
    now = utcnow()
    values = [{"set_id": set_id, "image_id": c.image_id, "criterion": c.criterion, "holds": c.holds,
               "source": c.source.value, "author": c.author, "created_at": now} for c in changed]
    written: dict[tuple[int, str], JudgmentRecord] = {}
    try:
        with session.begin_nested():  # a concurrent writer of the same cell must not poison the transaction
            for start in range(0, len(values), _CHUNK):
                # a bulk INSERT ... RETURNING per chunk (no ORM objects): not one statement per row
                stmt = insert(Judgment).returning(*_COLUMNS)
                for row in session.execute(stmt, values[start:start + _CHUNK]):
                    record = JudgmentRecord.of(row)
                    written[(record.image_id, record.criterion)] = record
    except IntegrityError:
        raise Conflict("a judgment of the same cell was recorded at the same time; retry", set_id=set_id) from None
    every = existing | written
    return [every[key] for key in cells]


def record_judgment(session: Session, set_id: str, spec: JudgmentSpec) -> JudgmentRecord:
    """Record one judgment (replacing that cell's earlier one)."""
    return record_judgments(session, set_id, [spec])[0]


def _same(record: JudgmentRecord | None, spec: JudgmentSpec) -> bool:
    return record is not None and (record.holds, record.source, record.author) == (spec.holds, spec.source,
                                                                                  spec.author)


def _existing(session: Session, set_id: str,
              cells: Sequence[tuple[int, str]]) -> dict[tuple[int, str], JudgmentRecord]:
    """The recorded judgments of these cells: every judgment of their images, kept where the criterion is asked
    (a plain IN on the image ids, which both backends serve from an index)."""
    wanted = set(cells)
    image_ids = sorted({image_id for image_id, _ in cells})
    out: dict[tuple[int, str], JudgmentRecord] = {}
    for start in range(0, len(image_ids), _CHUNK):
        chunk = image_ids[start:start + _CHUNK]
        stmt = select(*_COLUMNS).where(Judgment.set_id == set_id, Judgment.image_id.in_(chunk))
        for row in session.execute(stmt):
            if (row.image_id, row.criterion) in wanted:
                out[(row.image_id, row.criterion)] = JudgmentRecord.of(row)
    return out


@dataclass(frozen=True, slots=True)
class JudgmentFilter:
    """Which of a set's judgments a listing or a delete covers (``None``: any)."""

    image_id: int | None = None
    criterion: str | None = None
    source: JudgmentSource | None = None
    until_id: int | None = None  # only judgments with id <= this: what a calibration noted it was fitted on

    def apply(self, stmt: Select[Any], set_id: str) -> Select[Any]:
        stmt = stmt.where(Judgment.set_id == set_id)
        if self.image_id is not None:
            stmt = stmt.where(Judgment.image_id == self.image_id)
        if self.criterion is not None:
            stmt = stmt.where(Judgment.criterion == clean_criterion(self.criterion))
        if self.source is not None:
            stmt = stmt.where(Judgment.source == JudgmentSource(self.source).value)
        if self.until_id is not None:
            stmt = stmt.where(Judgment.id <= self.until_id)
        return stmt


def list_judgments(session: Session, set_id: str, where: JudgmentFilter | None = None) -> list[JudgmentRecord]:
    """Every judgment of a set (or those ``where`` selects) in id order: what a calibration is fitted on."""
    set_row(session, set_id)
    stmt = (where or JudgmentFilter()).apply(select(Judgment), set_id).order_by(Judgment.id)
    return [JudgmentRecord.of(row) for row in session.scalars(stmt)]


def page_judgments(session: Session, set_id: str, where: JudgmentFilter | None = None, *, limit: int = 100,
                   after_id: int | None = None) -> Page[JudgmentRecord]:
    """A page of a set's judgments in id order; pass ``next_after`` back as ``after_id`` for the next."""
    if not 1 <= limit <= MAX_PAGE:
        raise InvalidInput(f"limit must be 1..{MAX_PAGE}", limit=limit)
    set_row(session, set_id)
    where = where or JudgmentFilter()
    total = session.scalar(where.apply(select(func.count(Judgment.id)), set_id)) or 0
    stmt = where.apply(select(Judgment), set_id)
    if after_id is not None:
        stmt = stmt.where(Judgment.id > after_id)
    rows = session.scalars(stmt.order_by(Judgment.id).limit(limit + 1)).all()
    items = [JudgmentRecord.of(r) for r in rows[:limit]]
    next_after = items[-1].id if len(rows) > limit else None
    return Page(items=items, total=total, limit=limit, offset=0, next_after=next_after)


def delete_judgment(session: Session, set_id: str, judgment_id: int) -> JudgmentRecord:
    """Delete one judgment of a set (the undo of recording it); returns what was deleted."""
    set_row(session, set_id)
    row = session.get(Judgment, judgment_id)
    if row is None or row.set_id != set_id:
        raise NotFound("judgment not found", set_id=set_id, judgment_id=judgment_id)
    record = JudgmentRecord.of(row)
    session.delete(row)
    session.flush()
    return record


def delete_judgments(session: Session, set_id: str, where: JudgmentFilter | None = None) -> int:
    """Delete a set's judgments that ``where`` selects (all without one); returns how many went."""
    _lock_set(session, set_id)
    ids = select(Judgment.id)
    stmt = delete(Judgment).where(Judgment.id.in_((where or JudgmentFilter()).apply(ids, set_id).scalar_subquery()))
    result = session.execute(stmt.execution_options(synchronize_session=False))
    session.expire_all()
    return int(result.rowcount)  # type: ignore[attr-defined]


def judgments_of(session: Session, set_id: str, image_ids: Iterable[int],
                 criteria: Iterable[str]) -> dict[int, dict[str, bool]]:
    """The recorded judgments of some references on some criteria (a search's hits and criteria), as
    ``{image_id: {criterion: holds}}``; references without any are absent."""
    wanted = list(dict.fromkeys(image_ids))
    texts = [t for t in dict.fromkeys(criteria) if _printable(t, MAX_CRITERION) == t]  # others cannot be stored
    out: dict[int, dict[str, bool]] = {}
    if not texts:
        return out
    for start in range(0, len(wanted), _CHUNK):
        stmt = select(Judgment.image_id, Judgment.criterion, Judgment.holds).where(
            Judgment.set_id == set_id, Judgment.image_id.in_(wanted[start:start + _CHUNK]),
            Judgment.criterion.in_(texts))
        for image_id, criterion, holds in session.execute(stmt):
            out.setdefault(image_id, {})[criterion] = bool(holds)
    return out
