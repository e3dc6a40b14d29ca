"""Imports point one way: a router calls services and views under app/, never another router's helpers, and the
model and index layers (retrieval/, rerank/, indexer/) never import the app."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
ROUTERS = sorted(p for p in (ROOT / "app" / "routers").glob("*.py") if p.name != "__init__.py")


def imported(path: Path) -> set[str]:
    """Every module a file imports, at any depth (function-local imports too)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
        elif isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
    return names


@pytest.mark.parametrize("router", ROUTERS, ids=lambda p: p.stem)
def test_a_router_imports_no_other_router(router: Path) -> None:
    others = {m for m in imported(router) if m.startswith("app.routers.") and m != f"app.routers.{router.stem}"}
    assert not others, f"{router.name} imports {sorted(others)}: move the shared logic into a module under app/"


@pytest.mark.parametrize("layer", ["retrieval", "rerank", "indexer"])
def test_the_model_and_index_layers_never_import_the_app(layer: str) -> None:
    offenders = {str(p.relative_to(ROOT)): sorted(m for m in imported(p) if m == "app" or m.startswith("app."))
                 for p in (ROOT / layer).rglob("*.py")}
    assert not {k: v for k, v in offenders.items() if v}
