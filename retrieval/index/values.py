"""What a metadata value may hold, checked once for every way in (JSON, JSONL, CSV, multipart, PATCH, facet
schemas, filter values): text that every backend and every JSON encoder accepts, integers every backend stores.

Strings are Unicode scalar values without NUL: a lone surrogate (``"\\ud800"``, which JSON's ``\\u`` escapes can
spell) cannot be encoded as UTF-8, so it would break every response that carries it, and PostgreSQL's JSONB
refuses ``\\u0000``. Integers are int64, what Qdrant and PostgreSQL's JSONB numbers used as integers hold and
what a filter's numeric column can compare without overflow.
"""

from __future__ import annotations

import re
from typing import Any

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_BAD_TEXT = re.compile("[\x00\ud800-\udfff]")


def text_problem(value: str) -> str | None:
    """Why a string cannot be stored (``None`` when it can)."""
    bad = _BAD_TEXT.search(value)
    if bad is None:
        return None
    char = bad.group()
    what = "a NUL character" if char == "\x00" else f"a lone surrogate (U+{ord(char):04X})"
    return f"strings are Unicode text without NUL; this one holds {what} at index {bad.start()}"


def int_problem(value: int) -> str | None:
    if INT64_MIN <= value <= INT64_MAX:
        return None
    return f"integers are within int64 ({INT64_MIN}..{INT64_MAX}); this one has {len(str(abs(value)))} digits"


def value_problem(value: Any) -> str | None:
    """Why a stored scalar, list or object cannot be served (``None`` when it can): what older versions let in."""
    if isinstance(value, str):
        return text_problem(value)
    if isinstance(value, bool) or value is None or isinstance(value, float):
        return None
    if isinstance(value, int):
        return int_problem(value)
    if isinstance(value, list):
        return next((p for v in value if (p := value_problem(v)) is not None), None)
    if isinstance(value, dict):
        return next((p for k, v in value.items()
                     if (p := text_problem(k) if isinstance(k, str) else None) is not None
                     or (p := value_problem(v)) is not None), None)
    return None
