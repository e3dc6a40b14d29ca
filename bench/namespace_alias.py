"""Running today's benches on a tree from before the ``rubricsearch`` namespace (an A/B against an older commit).

Imports no product module, so a bench can place the alias before the first ``import rubricsearch``.
"""

from __future__ import annotations

from pathlib import Path

# Modules moved into the accelerated engine's plug-in, by the name they had before (an older tree has them there).
MOVED_TO_PLUGIN = {
    **{f"retrieval.plugins.accelerated.{name}": f"retrieval.qwen.engine.{name}"
       for name in ("graphed_lm", "packed", "graphed_tower", "tower_attention")},
    **{f"retrieval.plugins.accelerated.{name}": f"retrieval.qwen.preprocess.{name}"
       for name in ("gpu_preprocess", "exact_resize")},
    "retrieval.plugins.accelerated.kernels": "retrieval.qwen.kernels",
    **{f"retrieval.plugins.accelerated.kernels.{name}": f"retrieval.qwen.kernels.{name}"
       for name in ("cudnn_attention", "fused_kernels", "kernel_trial", "merge_kernel", "rope_kernel")},
    "rerank.plugins.accelerated.packed_prefix": "rerank.packed_prefix",
}
# Packages an older tree lacks that lead to those modules: empty ones stand in.
PLUGIN_PACKAGES = ("retrieval.plugins", "retrieval.plugins.accelerated", "rerank.plugins", "rerank.plugins.accelerated")

# Written into an older tree whose layers were top-level packages (``app``, ``retrieval``, ...): each
# ``rubricsearch.X`` that this tree's benches import is the old tree's ``X`` itself, the same module object, so a
# bench's timer patches what the old product runs (a second copy would be timed instead).
NAMESPACE_ALIAS = f"""
import importlib
import importlib.abc
import importlib.util
import sys
import types

# modules renamed with the namespace or moved since: an older tree has them under their old names
RENAMED = {{"indexer.catalog.tables": "indexer.catalog.models", "app.model_loading": "app.models",
           "app.demo.checkpoints": "app.demo.models", **{MOVED_TO_PLUGIN!r}}}
PLUGIN_PACKAGES = {PLUGIN_PACKAGES!r}


class _Alias(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        return importlib.util.spec_from_loader(name, self) if name.startswith(__name__ + ".") else None

    def create_module(self, spec):
        name = spec.name.removeprefix(__name__ + ".")
        try:
            return importlib.import_module(RENAMED.get(name, name))
        except ModuleNotFoundError:
            if name not in PLUGIN_PACKAGES:
                raise
            package = types.ModuleType(spec.name)
            package.__path__ = []
            return package

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
