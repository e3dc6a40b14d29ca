"""Request specs shared by the sync and async clients, and the error envelope -> domain error mapping."""

from __future__ import annotations

import base64
import hashlib
import mimetypes
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, TypeVar, cast

import httpx
from pydantic import BaseModel

from rubricsearch.retrieval import errors

T = TypeVar("T")


class ApiError(errors.RubricSearchError):
    """An error type this client does not know (a newer server); ``kind`` is the envelope's type."""

    def __init__(self, kind: str, message: str, **details: Any) -> None:
        super().__init__(message, **details)
        self.api_kind = kind


def _subclasses(cls: type[errors.RubricSearchError]) -> list[type[errors.RubricSearchError]]:
    out = [cls]
    for sub in cls.__subclasses__():
        out += _subclasses(sub)
    return out


ERROR_TYPES: dict[str, type[errors.RubricSearchError]] = {
    c.kind: c for c in _subclasses(errors.RubricSearchError) if c is not ApiError
}


def raise_for_error(response: httpx.Response) -> None:
    """Raise the domain error of a 4xx/5xx response (``.status``, ``.details``); return on success."""
    if response.is_success:
        return
    try:
        body = response.json()["error"]
        kind, message, details = str(body["type"]), str(body["message"]), dict(body.get("details") or {})
    except (ValueError, KeyError, TypeError):
        kind, message, details = "internal_error", f"HTTP {response.status_code}: {response.text[:500]}", {}
    cls = ERROR_TYPES.get(kind)
    error = cls(message, **details) if cls is not None and cls is not errors.RubricSearchError else ApiError(
        kind, message, **details)
    error.status = response.status_code
    raise error


@dataclass
class Call(Generic[T]):
    """One HTTP request and how to read its answer (``parse`` of the JSON body)."""

    method: str
    path: str
    parse: type[BaseModel] | None
    json: Any = None
    params: dict[str, Any] | None = None
    files: list[tuple[str, tuple[str, bytes, str]]] | None = None
    data: dict[str, Any] | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def request_kwargs(self) -> dict[str, Any]:
        kwargs: dict[str, Any] = {}
        for name in ("json", "params", "files", "data"):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        return kwargs

    def read(self, response: httpx.Response) -> T:
        raise_for_error(response)
        if self.parse is None:
            return None  # type: ignore[return-value]
        return cast(T, self.parse.model_validate(response.json()))


def clean(body: dict[str, Any]) -> dict[str, Any]:
    """Drop unset (None) fields so the server's defaults apply."""
    return {k: v for k, v in body.items() if v is not None}


def file_part(path: str | Path, field_name: str = "files") -> tuple[str, tuple[str, bytes, str]]:
    p = Path(path)
    kind = "application/zip" if p.suffix.lower() == ".zip" else "application/octet-stream"
    return field_name, (p.name, p.read_bytes(), kind)


def data_url(path: str | Path) -> str:
    """A ``data:`` URL of an image file, the JSON form the API takes for images (``{"image": data_url(p)}``)."""
    mime = mimetypes.guess_type(str(path))[0] or "image/jpeg"
    return f"data:{mime};base64," + base64.b64encode(Path(path).read_bytes()).decode()


def sha256_file(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


FINISHED_STATES = frozenset({"succeeded", "completed_with_errors", "failed", "cancelled"})
