"""Images of a set (deduplicated by sha256 within the set) and the visual-package records.

Functions take a session inside a caller-owned transaction, like :mod:`indexer.catalog.sets`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from datetime import datetime
from typing import Any

from sqlalchemy import Select, and_, delete, func, select, update
from sqlalchemy.dialects import postgresql, sqlite
from sqlalchemy.orm import Session

from rubricsearch.indexer.blobs import validate_sha256
from rubricsearch.indexer.catalog.records import ImageDeletion, ImageRecord, PackageInfo, Page
from rubricsearch.indexer.catalog.sets import set_row
from rubricsearch.indexer.catalog.tables import Image, ImageSource, ImageStatus, PackageRecord, utcnow
from rubricsearch.retrieval.errors import InvalidInput, NotFound

MAX_PAGE = 1000
_CHUNK = 500


def _insert(session: Session, model: Any) -> Any:
    """A dialect INSERT that supports ON CONFLICT DO NOTHING (dedup without aborting the transaction)."""
    dialect = session.get_bind().dialect.name
    if dialect == "postgresql":
        return postgresql.insert(model)
    if dialect == "sqlite":
        return sqlite.insert(model)
    raise InvalidInput(f"unsupported catalog database: {dialect}")  # pragma: no cover


def add_image(
    session: Session,
    set_id: str,
    *,
    sha256: str,
    byte_size: int,
    source: ImageSource | str,
    original_name: str = "",
    source_detail: str = "",
    width: int | None = None,
    height: int | None = None,
    status: ImageStatus = ImageStatus.PENDING,
    meta: dict[str, Any] | None = None,
) -> tuple[ImageRecord, bool]:
    """Add an image to a set; returns ``(image, created)``. A sha already in the set is a no-op."""
    validate_sha256(sha256)
    try:
        source = ImageSource(source)
    except ValueError:
        raise InvalidInput("unknown image source", source=str(source)) from None
    if byte_size < 0:
        raise InvalidInput("byte_size must be >= 0", byte_size=byte_size)
    set_row(session, set_id)
    stmt = (
        _insert(session, Image)
        .values(
            set_id=set_id,
            sha256=sha256,
            byte_size=byte_size,
            source=source.value,
            original_name=original_name[:1024],
            source_detail=source_detail,
            width=width,
            height=height,
            status=ImageStatus(status).value,
            created_at=utcnow(),
            indexed_at=utcnow() if status == ImageStatus.INDEXED else None,
            meta=meta or {},
        )
        .on_conflict_do_nothing(index_elements=["set_id", "sha256"])
        .returning(Image.id)
    )
    new_id = session.execute(stmt).scalar_one_or_none()
    row = session.scalar(select(Image).where(Image.set_id == set_id, Image.sha256 == sha256))
    assert row is not None
    return ImageRecord.of(row), new_id is not None


def get_image(session: Session, image_id: int, *, set_id: str | None = None) -> ImageRecord:
    row = session.get(Image, image_id)
    if row is None or (set_id is not None and row.set_id != set_id):
        raise NotFound("image not found", image_id=image_id)
    return ImageRecord.of(row)


def get_images(session: Session, image_ids: Iterable[int]) -> dict[int, ImageRecord]:
    """Bulk lookup by id (for search results); missing ids are simply absent from the result."""
    ids = list(dict.fromkeys(image_ids))
    out: dict[int, ImageRecord] = {}
    for start in range(0, len(ids), _CHUNK):
        for row in session.scalars(select(Image).where(Image.id.in_(ids[start : start + _CHUNK]))):
            out[row.id] = ImageRecord.of(row)
    return out


def find_images(session: Session, set_id: str, shas: Iterable[str]) -> dict[str, ImageRecord]:
    """Bulk lookup by content hash within a set (a search's hits: one query, not one per hit); hashes not in
    the set are absent from the result."""
    wanted = list(dict.fromkeys(shas))
    out: dict[str, ImageRecord] = {}
    for start in range(0, len(wanted), _CHUNK):
        stmt = select(Image).where(Image.set_id == set_id, Image.sha256.in_(wanted[start : start + _CHUNK]))
        for row in session.scalars(stmt):
            out[row.sha256] = ImageRecord.of(row)
    return out


def find_image(session: Session, set_id: str, sha256: str) -> ImageRecord | None:
    row = session.scalar(select(Image).where(Image.set_id == set_id, Image.sha256 == sha256))
    return None if row is None else ImageRecord.of(row)


def _filtered(stmt: Select[Any], set_id: str, status: ImageStatus | None) -> Select[Any]:
    stmt = stmt.where(Image.set_id == set_id)
    return stmt if status is None else stmt.where(Image.status == ImageStatus(status).value)


def list_images(
    session: Session,
    set_id: str,
    *,
    status: ImageStatus | None = None,
    limit: int = 100,
    offset: int = 0,
    after_id: int | None = None,
) -> Page[ImageRecord]:
    """A page of a set's images in id order (stable). Use ``after_id`` (keyset) for deep paging."""
    if not 1 <= limit <= MAX_PAGE or offset < 0:
        raise InvalidInput(f"limit must be 1..{MAX_PAGE} and offset >= 0", limit=limit, offset=offset)
    set_row(session, set_id)
    total = session.scalar(_filtered(select(func.count(Image.id)), set_id, status)) or 0
    stmt = _filtered(select(Image), set_id, status)
    if after_id is not None:
        stmt = stmt.where(Image.id > after_id)
    rows = session.scalars(stmt.order_by(Image.id).offset(offset).limit(limit + 1)).all()
    items = [ImageRecord.of(r) for r in rows[:limit]]
    next_after = items[-1].id if len(rows) > limit else None
    return Page(items=items, total=total, limit=limit, offset=offset, next_after=next_after)


def count_images(session: Session, set_id: str) -> dict[ImageStatus, int]:
    """Images of a set per status (every status present, zero where none)."""
    counts = dict.fromkeys(ImageStatus, 0)
    rows = session.execute(
        select(Image.status, func.count(Image.id)).where(Image.set_id == set_id).group_by(Image.status)
    )
    for status, n in rows:
        counts[ImageStatus(status)] = int(n)
    return counts


def mark_images_indexed(session: Session, image_ids: Sequence[int], *, at: datetime | None = None) -> int:
    """Mark images indexed (clearing any error); returns how many rows changed."""
    changed = 0
    when = at or utcnow()
    for start in range(0, len(image_ids), _CHUNK):
        result = session.execute(
            update(Image)
            .where(Image.id.in_(image_ids[start : start + _CHUNK]))
            .values(status=ImageStatus.INDEXED.value, error=None, indexed_at=when)
            .execution_options(synchronize_session=False)
        )
        changed += result.rowcount  # type: ignore[attr-defined]
    session.expire_all()
    return changed


def mark_image_indexed(session: Session, image_id: int, *, at: datetime | None = None) -> ImageRecord:
    if not mark_images_indexed(session, [image_id], at=at):
        raise NotFound("image not found", image_id=image_id)
    return get_image(session, image_id)


def mark_image_failed(session: Session, image_id: int, error: str) -> ImageRecord:
    row = session.get(Image, image_id)
    if row is None:
        raise NotFound("image not found", image_id=image_id)
    row.status, row.error, row.indexed_at = ImageStatus.FAILED.value, error[:10_000], None
    session.flush()
    return ImageRecord.of(row)


def mark_set_pending(session: Session, set_id: str) -> int:
    """Put every image of a set back to pending (a re-index, e.g. after a model change)."""
    set_row(session, set_id)
    result = session.execute(
        update(Image)
        .where(Image.set_id == set_id)
        .values(status=ImageStatus.PENDING.value, error=None, indexed_at=None)
        .execution_options(synchronize_session=False)
    )
    session.expire_all()
    return int(result.rowcount)  # type: ignore[attr-defined]


def is_sha_referenced(session: Session, sha256: str, *, excluding_image_id: int | None = None) -> bool:
    """Whether any image (in any set) still uses this blob."""
    stmt = select(Image.id).where(Image.sha256 == sha256)
    if excluding_image_id is not None:
        stmt = stmt.where(Image.id != excluding_image_id)
    return session.scalar(stmt.limit(1)) is not None


def unreferenced_shas(session: Session, shas: Iterable[str]) -> list[str]:
    """The subset of ``shas`` that no image references (sorted): safe to delete from the blob store."""
    wanted = sorted(set(shas))
    used: set[str] = set()
    for start in range(0, len(wanted), _CHUNK):
        chunk = wanted[start : start + _CHUNK]
        used.update(session.scalars(select(Image.sha256).where(Image.sha256.in_(chunk)).distinct()))
    return [s for s in wanted if s not in used]


def delete_image(session: Session, image_id: int, *, set_id: str | None = None) -> ImageDeletion:
    """Delete one image; ``blob_orphaned`` says whether its blob may now go (after commit)."""
    image = get_image(session, image_id, set_id=set_id)
    session.execute(delete(Image).where(Image.id == image_id).execution_options(synchronize_session=False))
    session.expire_all()
    return ImageDeletion(image=image, blob_orphaned=not is_sha_referenced(session, image.sha256))


# -- visual package records -----------------------------------------------------------------------


def record_package(session: Session, sha256: str, fingerprint: str, byte_size: int) -> PackageInfo:
    """Note that a package exists for (image sha, fingerprint); recording it again is a no-op."""
    validate_sha256(sha256)
    if not fingerprint or len(fingerprint) > 128:
        raise InvalidInput("fingerprint must be 1..128 characters")
    session.execute(
        _insert(session, PackageRecord)
        .values(sha256=sha256, fingerprint=fingerprint, byte_size=byte_size, created_at=utcnow())
        .on_conflict_do_nothing(index_elements=["sha256", "fingerprint"])
    )
    found = get_package(session, sha256, fingerprint)
    assert found is not None
    return found


def get_package(session: Session, sha256: str, fingerprint: str) -> PackageInfo | None:
    row = session.scalar(
        select(PackageRecord).where(
            and_(PackageRecord.sha256 == sha256, PackageRecord.fingerprint == fingerprint)
        )
    )
    return None if row is None else PackageInfo.of(row)


def list_packages(
    session: Session, *, sha256: str | None = None, fingerprint: str | None = None
) -> list[PackageInfo]:
    stmt = select(PackageRecord)
    if sha256 is not None:
        stmt = stmt.where(PackageRecord.sha256 == sha256)
    if fingerprint is not None:
        stmt = stmt.where(PackageRecord.fingerprint == fingerprint)
    rows = session.scalars(stmt.order_by(PackageRecord.sha256, PackageRecord.fingerprint))
    return [PackageInfo.of(r) for r in rows]


def delete_packages(session: Session, sha256: str, *, fingerprint: str | None = None) -> int:
    stmt = delete(PackageRecord).where(PackageRecord.sha256 == sha256)
    if fingerprint is not None:
        stmt = stmt.where(PackageRecord.fingerprint == fingerprint)
    result = session.execute(stmt.execution_options(synchronize_session=False))
    return int(result.rowcount)  # type: ignore[attr-defined]
