"""The closed set of domain errors.

Every layer raises one of these; ``app/errors.py`` maps each ``kind`` to an HTTP status in one place,
so model code never needs to know about HTTP.
"""

from __future__ import annotations

from typing import Any, ClassVar


class RubricSearchError(Exception):
    """Base of all domain errors; ``kind`` is the stable machine-readable type."""

    kind: ClassVar[str] = "internal_error"

    def __init__(self, message: str, **details: Any) -> None:
        super().__init__(message)
        self.message = message
        self.details = details
        # The HTTP status when the error came back from a server through ``app.client`` (None in-process).
        self.status: int | None = None


class InvalidInput(RubricSearchError):
    """The request is well formed but its content is not acceptable."""

    kind = "invalid_input"


class ImageError(InvalidInput):
    """An image could not be decoded or breaks a limit (size, pixels, format)."""

    kind = "invalid_image"


class UnsupportedMedia(InvalidInput):
    """The payload is of a media type rubricsearch does not read."""

    kind = "unsupported_media_type"


class PayloadTooLarge(InvalidInput):
    """A body, file, archive or image exceeds a configured byte limit."""

    kind = "payload_too_large"


class InputTooLong(PayloadTooLarge):
    """Text over a model's token limit, where the caller did not ask for truncation."""


class InvalidMetadata(InvalidInput):
    """Reference metadata, a manifest or a filter over its bounds or malformed (``details`` lists the items)."""

    kind = "invalid_metadata"


class NotFound(RubricSearchError):
    kind = "not_found"


class Conflict(RubricSearchError):
    kind = "conflict"


class Unauthorized(RubricSearchError):
    kind = "unauthorized"


class Forbidden(RubricSearchError):
    kind = "forbidden"


class RateLimited(RubricSearchError):
    kind = "rate_limited"


class BackendUnavailable(RubricSearchError):
    """A model server, database or vector store cannot be reached or is not ready."""

    kind = "backend_unavailable"


class Overloaded(BackendUnavailable):
    """The models' queues are full: new work is refused (with a retry hint) instead of queueing without bound."""

    kind = "overloaded"


class InsufficientStorage(RubricSearchError):
    """The data directory's disk is full: a write that needs space cannot be done (deletes still work)."""

    kind = "insufficient_storage"


def disk_full(exc: BaseException | None) -> bool:
    """Whether ``exc`` (or an exception it was raised from) says the disk or the database's storage is full:
    ENOSPC/EDQUOT, SQLite's SQLITE_FULL, PostgreSQL's disk_full (SQLSTATE 53100, psycopg's ``sqlstate``: PostgreSQL
    words the message in the server's language)."""
    import errno

    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        if getattr(exc, "sqlite_errorcode", None) == 13 or getattr(exc, "sqlstate", None) == "53100":
            return True
        if "database or disk is full" in str(exc) or "No space left on device" in str(exc):
            return True
        exc = getattr(exc, "orig", None) or exc.__cause__ or exc.__context__
    return False


class PackageMismatch(RubricSearchError):
    """A visual package does not fit the model or prompt it was meant for (never sent onwards)."""

    kind = "package_mismatch"


class MissingExtra(RubricSearchError):
    """An optional dependency is not installed; the message says which extra to install."""

    kind = "missing_extra"


def require(module: str, extra: str) -> Any:
    """Import an optional module or raise an actionable :class:`MissingExtra`."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as exc:  # pragma: no cover - depends on the environment
        raise MissingExtra(
            f"'{module}' is not installed; install it with: pip install 'rubricsearch[{extra}]'",
            module=module,
            extra=extra,
        ) from exc
