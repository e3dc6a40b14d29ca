"""Names as people see them: set names, uploaded file names and archive entries are stored in Unicode NFC, without
control characters (an escape sequence in a zip entry name reached the terminal through the CLI's output) and
without bidi or zero-width formatting characters (a right-to-left override makes ``gpj.exe`` read ``exe.jpg``;
a zero-width space makes ``cats`` and ``ca\u200bts`` two sets that look the same; NFD and NFC spellings of ``é`` did
too). Look-alike letters of other scripts (Cyrillic ``а`` for Latin ``a``) are kept: they are different letters,
and refusing mixed scripts would refuse real names."""

from __future__ import annotations

import re
import unicodedata

# C0/C1 controls, and the bidi embeddings, overrides, isolates and marks, zero-width characters and the BOM
_INVISIBLE = re.compile("[\x00-\x1f\x7f-\x9f\u061c\u200b-\u200f\u202a-\u202e\u2060-\u2069\ufeff]")


def clean_name(name: str) -> str:
    """``name`` in NFC, without control, bidi-formatting or zero-width characters, and trimmed."""
    return _INVISIBLE.sub("", unicodedata.normalize("NFC", name)).strip()
