"""README.md and docs/: the README stays a short page for users, and every relative link (with its #anchor) leads
somewhere, so moving a section between files cannot leave a dead link behind."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


def anchors(page: Path) -> set[str]:
    """GitHub's heading ids: lower case, punctuation dropped, spaces to hyphens (code blocks skipped)."""
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-")
            for m in re.finditer(r"^#{1,6} (.+)$", text, flags=re.M)}


def broken_links(page: Path) -> list[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    broken = []
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists() or (anchor and dest.suffix == ".md" and anchor not in anchors(dest)):
            broken.append(target)
    return broken


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.relative_to(ROOT).as_posix())
def test_links_resolve(page: Path) -> None:
    assert broken_links(page) == []


def test_readme_is_short_and_indexes_every_doc() -> None:
    """A new user reads it in under ten minutes (2,000 words), and it answers what they ask first."""
    text = (ROOT / "README.md").read_text()
    lines = text.splitlines()
    assert len(lines) <= 350 and len(text.split()) <= 2000
    for must in ("## Real models on a GPU", "--port", "RUBRICSEARCH_PORT", "Qwen/Qwen3-VL-Embedding-2B",
                 "Qwen/Qwen3-VL-Reranker-2B", "pip install -e '.[gpu]'", "docker compose up", "download.pytorch.org"):
        assert must in text, must
    assert [n for n, line in enumerate(lines, 1) if len(line) > 200] == []
    linked = set(LINK.findall("\n".join(lines)))
    assert {f"docs/{p.name}" for p in PAGES[1:]} <= linked


def test_a_moved_section_is_caught(tmp_path: Path) -> None:
    (tmp_path / "a.md").write_text("# A\n\n## Kept\n\n```\n## Not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#kept) [gone](a.md#moved) [code](a.md#not-a-heading) [missing](c.md) "
                    "[web](https://example.org/x) [self](#b)\n\n# B\n")
    assert broken_links(page) == ["a.md#moved", "a.md#not-a-heading", "c.md"]
