"""A set's calibrations (``rerank/calibration``): each fit is kept as a new version, the latest one serves.

Functions take a session inside a caller-owned transaction, like :mod:`indexer.catalog.judgments`.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from rubricsearch.indexer.catalog.sets import set_row
from rubricsearch.indexer.catalog.tables import Calibration as CalibrationRow
from rubricsearch.indexer.catalog.tables import Image, ImageStatus, Judgment
from rubricsearch.rerank.calibration import Calibration
from rubricsearch.retrieval.errors import Conflict


def save_calibration(session: Session, set_id: str, calibration: Calibration) -> Calibration:
    """Store a fit as the set's next version; returns it with its version."""
    set_row(session, set_id)
    latest = session.scalar(select(func.max(CalibrationRow.version)).where(CalibrationRow.set_id == set_id)) or 0
    saved = replace(calibration, version=latest + 1)
    try:
        with session.begin_nested():
            session.add(CalibrationRow(set_id=set_id, version=saved.version, fitted_at=saved.fitted_at,
                                       model_key=saved.model_key, max_judgment_id=saved.max_judgment_id or None,
                                       judgment_count=saved.judgments, payload=saved.to_json()))
            session.flush()
    except IntegrityError:
        raise Conflict("another calibration of this set was saved at the same time; retry", set_id=set_id) from None
    return saved


def latest_calibration(session: Session, set_id: str) -> Calibration | None:
    """The set's newest calibration (None: never fitted)."""
    row = session.scalars(select(CalibrationRow).where(CalibrationRow.set_id == set_id)
                          .order_by(CalibrationRow.version.desc()).limit(1)).first()
    if row is None:
        return None
    return replace(Calibration.from_json(row.payload), version=row.version)


@dataclass(frozen=True)
class Staleness:
    """How the set's judgments moved since a fit: recorded after it, and gone (deleted or replaced) since."""

    new: int
    gone: int

    @property
    def stale(self) -> bool:
        return bool(self.new or self.gone)


def staleness(session: Session, set_id: str, calibration: Calibration) -> Staleness:
    base = select(func.count(Judgment.id)).where(Judgment.set_id == set_id)
    new = session.scalar(base.where(Judgment.id > calibration.max_judgment_id)) or 0
    kept = session.scalar(base.where(Judgment.id <= calibration.max_judgment_id)) or 0
    return Staleness(new=new, gone=calibration.judgments - kept)


def indexed_judgments(session: Session, set_id: str, until_id: int) -> int:
    """The set's judgments up to ``until_id`` whose references are indexed now: a fit scores only those, so more of
    them than it counted means a judged reference was indexed since (its judgments were left out)."""
    return session.scalar(select(func.count(Judgment.id)).join(Image, Image.id == Judgment.image_id).where(
        Judgment.set_id == set_id, Judgment.id <= until_id, Image.status == ImageStatus.INDEXED.value)) or 0


def judged_sets(session: Session) -> list[str]:
    """The sets that hold judgments or a calibration: those whose calibration may lag their judgments."""
    judged = select(Judgment.set_id).distinct()
    fitted = select(CalibrationRow.set_id).distinct()
    return sorted(set(session.scalars(judged)) | set(session.scalars(fitted)))
