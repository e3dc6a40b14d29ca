"""Docstrings and comments say why in words; measured numbers (timings, speed-ups, memory growth, recall, the box
they were taken on) live in docs/performance.md ("Measurements behind the code") or the page it points to, where
they are dated and can be measured again. Arithmetic that follows from definitions, limits the code enforces and
examples of output formats are not measurements and pass."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# A number with a sub-second time unit, decimal seconds or seconds said of a run, a tilde-approximate ratio or
# share, a comparison with a ratio, memory growth, a recall figure, a percentile, the box a figure was taken on.
MEASURED = re.compile(
    r"""\d\s?(?:ms|µs|us|ns)\b
      | \d\.\d+\s?s\b
      | \d\s?s\s(?:of\sCPU|holding|on\sthe|here)\b
      | ~\s?\d[\d.,]*\s?(?:x|×|%)
      | \d\s?(?:x|×|%)\s(?:faster|slower|longer|shorter|cheaper|dearer)\b
      | (?:faster|slower|longer)\s(?:by\s)?~?\d[\d.,]*\s?(?:x|×)
      | grew\sfrom\s\d | \+\d[\d.,]*\s?[KMG]i?B
      | \brecall(?:@\d+)?\s\(?0\.\d
      | \bp(?:50|90|95|99)\s\d
      | \d\s?(?:[KMG]i?B|%)\s+here\b
      | \b\d+-core\sbox\b
      | \b(?:on|measured\son)\s(?:an?|the)\s(?:H100|H200|A100)\b
      | \bmeasured\b[^.;]{0,60}:\s?\d
      | \bmeasured\s\(\s?\d
      | \d\s?[KMG]i?B\s(?:while|peak|resident)\b | \bpeak(?:ed|s)?\s(?:at\s)?\+?\d
      | \b(?:differ\w*|off)\s[^.;]{0,30}\bby\s(?:up\sto\s|at\smost\s)?~?\d[\d.]*\s?(?:x|×)
      | \bload\saverage\s\d
      | \bprobe\b[^.;]{0,40}\b0\.\d\d""",
    re.X | re.I,
)

def passages(source: str) -> list[tuple[int, str]]:
    """Every docstring, and every comment with the comments on the lines right after it, by first line."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc is not None:
                found.append((node.body[0].lineno, doc))
    block: list[str] = []
    start = last = -2
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type != tokenize.COMMENT:
            continue
        line = tok.start[0]
        if block and line != last + 1:
            found.append((start, " ".join(block)))
            block = []
        if not block:
            start = line
        block.append(tok.string.lstrip("#").strip())
        last = line
    if block:
        found.append((start, " ".join(block)))
    return found


def measured_numbers(source: str) -> list[str]:
    """``line: excerpt`` for each measured-number pattern in a docstring or comment of ``source``."""
    hits = []
    for line, text in passages(source):
        flat = " ".join(text.split())
        hits += [f"{line}: ...{flat[max(0, m.start() - 50):m.end() + 20]}..." for m in MEASURED.finditer(flat)]
    return hits


def product_files() -> list[Path]:
    files = [p for layer in ("app", "retrieval", "rerank", "indexer") for p in (ROOT / layer).rglob("*.py")]
    return sorted(files + list((ROOT / "web").glob("*.py")))


def test_no_measured_numbers_in_docstrings_or_comments() -> None:
    found = {p.relative_to(ROOT).as_posix(): measured_numbers(p.read_text()) for p in product_files()}
    assert {name: hits for name, hits in found.items() if hits} == {}


@pytest.mark.parametrize("planted", [
    '"""took 4.5 ms on the 2-core box"""',
    "# torch's CPU kernels took ~20 ms per 1M values here",
    '"""The free bytes grew from 107 to 185 MiB in ten minutes."""',
    "x = 1  # isfinite on bfloat16 is ~50x slower than a cast",
    '"""efSearch 128 keeps recall 0.86 at 5 %."""',
    "# pydantic lists 100,000 errors (0.3 s holding the GIL)",
    '"""a dict of 300 000 references was +54 MiB"""',
    '"""The pass was 2.5x faster (measured on an H100: p50 284 -> 273)."""',
    '"""It leads in every training run measured (0.869, against 0.594 in recall order)."""',
    "# Run twice (load average 11-13 and about 3), the costs differ between the two by up to 2x.",
    '"""A linear probe on held-out faces: ears 0.78, stripes 0.58."""',
    '"""An 8000 x 8000 PNG is 200 KB on the wire and ~670 MB while PIL decodes it."""',
])
def test_a_planted_measurement_is_flagged(planted: str) -> None:
    assert measured_numbers(planted + "\n") != []


def test_arithmetic_limits_and_formats_pass() -> None:
    source = '''"""Float8 is 4x smaller than float32 and 2x than bf16: 64 x n/8 bytes (8 MB at 1M slots), 2 x M int32.

    At most ``limit + 1 MiB`` is read; a 24 MiB body is refused with 413 after ``header_timeout_s`` (10 s).
    Prints "about 12 min 30 s" and ``[#####.....]  50% 15/30  done 14``; R@k = |relevant ∩ top k| / min(k, n).
    """
    # efSearch x 1.06 / sqrt(kept fraction), 1 to 16; x1.5 at 50 %; an 8000 x 8000 PNG is 200 KB on the wire
    '''
    assert measured_numbers(source) == []
