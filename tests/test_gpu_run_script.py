"""bench/gpu_run.sh, without a GPU: every section README or docs/ tells a reader to run exists, and every step's
command names a file that is here (DRY_RUN=1 prints the commands instead of running them), so a typo is caught
before device time. Sections of past rounds are cited as "section `name` at <commit>", which this does not read."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_run.sh"
PAST = sorted((ROOT / "bench").glob("gpu_sections_*.sh"))  # the earlier sections, sourced by gpu_run.sh


def sections() -> list[str]:
    return [name for path in (SCRIPT, *PAST)
            for name in re.findall(r"^section_([a-z0-9_]+)\(\)", path.read_text(), flags=re.M)]


def test_every_section_file_is_sourced() -> None:
    text = SCRIPT.read_text()
    assert len(PAST) >= 2 and all(f'source "$(dirname "$0")/{path.name}"' in text for path in PAST)


def test_every_cited_section_exists() -> None:
    readme = (ROOT / "README.md").read_text()
    assert re.search(r"bash bench/gpu_run\.sh [a-z0-9_]+", readme), "README names no GPU report to run"
    texts = [readme, *(path.read_text() for path in sorted((ROOT / "docs").glob("*.md")))]
    cited = {name for text in texts for name in re.findall(r"gpu_run\.sh ([a-z0-9_]+)", text)}
    assert cited <= set(sections()), cited - set(sections())


def test_every_step_names_a_file_here() -> None:
    out = subprocess.run(["bash", str(SCRIPT), ",".join(sections())], cwd=ROOT, capture_output=True, text=True,
                         env={**os.environ, "DRY_RUN": "1"}, timeout=60, check=True).stdout
    steps = out.splitlines()
    assert len(steps) > 50
    for line in steps:
        files = re.findall(r"\b((?:bench|tests)/[\w/]+\.py)\b", line)
        assert files, line
        for file in files:
            assert (ROOT / file).is_file(), line
