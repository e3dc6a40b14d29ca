"""Reference sets: create, read, update, delete.

Every function takes a :class:`~sqlalchemy.orm.Session` inside a transaction the caller owns
(``with catalog.write() as s: ...``), so several steps can commit or roll back together.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Mapping
from typing import Any

from sqlalchemy import and_, delete, exists, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, aliased

from rubricsearch.indexer.catalog.records import SetRecord
from rubricsearch.indexer.catalog.tables import Image, ReferenceSet, utcnow
from rubricsearch.retrieval.errors import Conflict, InvalidInput, NotFound

SET_ID_RE = re.compile(r"^[a-z0-9][a-z0-9_-]{0,63}$")
MAX_NAME = 200
MAX_EMBEDDING_DIM = 65_536


def new_id() -> str:
    return uuid.uuid4().hex


def _clean_name(name: str) -> str:
    cleaned = name.strip() if isinstance(name, str) else ""
    if not cleaned or len(cleaned) > MAX_NAME or any(ord(c) < 32 for c in cleaned):
        raise InvalidInput(f"set name must be 1..{MAX_NAME} printable characters", name=str(name)[:80])
    return cleaned


def _check_dim(dim: int | None) -> int | None:
    if dim is not None and (
        isinstance(dim, bool) or not isinstance(dim, int) or not 1 <= dim <= MAX_EMBEDDING_DIM
    ):
        raise InvalidInput("embedding_dim must be a positive integer", embedding_dim=dim)
    return dim


def set_row(session: Session, set_id: str) -> ReferenceSet:
    """The set's row; an unknown set is :class:`NotFound`."""
    row = session.get(ReferenceSet, set_id)
    if row is None:
        raise NotFound("reference set not found", set_id=set_id)
    return row


def create_set(
    session: Session,
    name: str,
    *,
    description: str = "",
    embedding_dim: int | None = None,
    settings: Mapping[str, Any] | None = None,
    set_id: str | None = None,
) -> SetRecord:
    """Create a set; ``set_id`` may be a slug (``[a-z0-9][a-z0-9_-]*``), else a uuid is generated."""
    name = _clean_name(name)
    if set_id is not None and not SET_ID_RE.fullmatch(set_id):
        raise InvalidInput("set id must match [a-z0-9][a-z0-9_-]{0,63}", set_id=set_id[:80])
    row = ReferenceSet(
        id=set_id or new_id(),
        name=name,
        description=description or "",
        embedding_dim=_check_dim(embedding_dim),
        settings=dict(settings or {}),
        created_at=utcnow(),
    )
    if session.get(ReferenceSet, row.id) is not None:
        raise Conflict("a reference set with this id exists", set_id=row.id)
    if session.scalar(select(ReferenceSet.id).where(ReferenceSet.name == name)) is not None:
        raise Conflict("a reference set with this name exists", name=name)
    try:
        with session.begin_nested():  # a concurrent insert must not poison the caller's transaction
            session.add(row)
    except IntegrityError:
        raise Conflict("a reference set with this name or id exists", name=name, set_id=row.id) from None
    return SetRecord.of(row)


def get_set(session: Session, set_id: str) -> SetRecord:
    return SetRecord.of(set_row(session, set_id))


def get_set_by_name(session: Session, name: str) -> SetRecord:
    row = session.scalar(select(ReferenceSet).where(ReferenceSet.name == name.strip()))
    if row is None:
        raise NotFound("reference set not found", name=name)
    return SetRecord.of(row)


def resolve_set(session: Session, id_or_name: str) -> SetRecord:
    """Find a set by id, falling back to its name (what a CLI user types)."""
    row = session.get(ReferenceSet, id_or_name)
    if row is not None:
        return SetRecord.of(row)
    return get_set_by_name(session, id_or_name)


def list_sets(session: Session) -> list[SetRecord]:
    """All sets, ordered by name (names are unique, so the order is stable)."""
    rows = session.scalars(select(ReferenceSet).order_by(ReferenceSet.name))
    return [SetRecord.of(r) for r in rows]


def update_set(
    session: Session,
    set_id: str,
    *,
    name: str | None = None,
    description: str | None = None,
    embedding_dim: int | None = None,
    settings: Mapping[str, Any] | None = None,
) -> SetRecord:
    """Change the given fields (``None`` leaves a field as it is; settings are replaced whole)."""
    row = set_row(session, set_id)
    if name is not None:
        name = _clean_name(name)
        other = session.scalar(
            select(ReferenceSet.id).where(ReferenceSet.name == name, ReferenceSet.id != set_id)
        )
        if other is not None:
            raise Conflict("a reference set with this name exists", name=name)
        row.name = name
    if description is not None:
        row.description = description
    if embedding_dim is not None:
        row.embedding_dim = _check_dim(embedding_dim)
    if settings is not None:
        row.settings = dict(settings)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:
        raise Conflict("a reference set with this name exists", name=name) from None
    return SetRecord.of(row)


def delete_set(session: Session, set_id: str) -> list[str]:
    """Delete a set with its images and jobs; returns the blob shas no other set references.

    Delete those blobs (and their packages) only after the transaction has committed.
    """
    set_row(session, set_id)
    other = aliased(Image)
    orphaned = session.scalars(
        select(Image.sha256)
        .where(Image.set_id == set_id)
        .where(~exists().where(and_(other.sha256 == Image.sha256, other.set_id != set_id)))
        .distinct()
        .order_by(Image.sha256)
    ).all()
    session.execute(delete(ReferenceSet).where(ReferenceSet.id == set_id))
    session.expire_all()
    return list(orphaned)
