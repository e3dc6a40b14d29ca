"""Running today's benches on a tree from before the ``rubricsearch`` namespace (an A/B against an older commit).

Imports no product module, so a bench can place the alias before the first ``import rubricsearch``.
"""

from __future__ import annotations

from pathlib import Path

# Written into an older tree whose layers were top-level packages (``app``, ``retrieval``, ...): each
# ``rubricsearch.X`` that this tree's benches import is the old tree's ``X`` itself, the same module object, so a
# bench's timer patches what the old product runs (a second copy would be timed instead).
NAMESPACE_ALIAS = """
import importlib
import importlib.abc
import importlib.util
import sys

# modules renamed with the namespace: an older tree has them under their old names
RENAMED = {"indexer.catalog.tables": "indexer.catalog.models", "app.model_loading": "app.models",
           "app.demo.checkpoints": "app.demo.models"}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith(__name__ + ".") else None

    def create_module(self, spec):
        name = spec.name.removeprefix(__name__ + ".")
        return importlib.import_module(RENAMED.get(name, name))

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _Alias())
"""


def namespace_alias(tree: Path) -> Path:
    """Lets today's benches (``import rubricsearch.app...``) run a tree from before the namespace, whose layers are
    top-level packages: writes ``tree/rubricsearch/__init__.py`` aliasing each ``rubricsearch.X`` to ``X`` (a tree
    that has the namespace is left as it is). Returns ``tree``."""
    if not (tree / "rubricsearch").exists():
        (tree / "rubricsearch").mkdir()
        (tree / "rubricsearch" / "__init__.py").write_text(NAMESPACE_ALIAS)
    return tree
