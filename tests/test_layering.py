"""Imports point one way along the data flow, and the engine's layers show in its folders.

A router calls services and views under app/, never another router's helpers. ``retrieval``, ``rerank`` and
``indexer`` never import ``app`` or ``web`` (model code knows no FastAPI); ``retrieval`` never imports ``rerank`` or
``indexer``. Inside ``retrieval/qwen``, model plumbing stands alone and the execution engine sits on top of it; the
accelerated plug-in's kernels stand alone too. No two modules import each other, however far round. Every import
counts, also one inside a function, since a lazy import still ties the layers together. The core never imports a
plug-in, and the machinery only the accelerated engine runs (Triton, Liger's kernels, CUDA graphs) stays in it.
"""

from __future__ import annotations

import ast
from graphlib import CycleError, TopologicalSorter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
NS = "rubricsearch"  # every layer folder is installed as rubricsearch.<folder> (rubricsearch/<folder> links to it)
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
    own = f"{NS}.app.routers.{router.stem}"
    others = {m for m in imported(router) if m.startswith(f"{NS}.app.routers.") and m != own}
    assert not others, f"{router.name} imports {sorted(others)}: move the shared logic into a module under app/"


# package (or sub-package) -> the top-level / qwen-layer names it must never import
FORBIDDEN: dict[str, set[str]] = {
    "retrieval": {"app", "web", "rerank", "indexer"},
    "rerank": {"app", "web", "indexer"},
    "indexer": {"app", "web"},
    "retrieval.qwen.model": {"retrieval.qwen.engine", "retrieval.runtime"},
    "retrieval.plugins.accelerated.kernels": {"retrieval.qwen", "retrieval.runtime", "retrieval.packages"},
}
PACKAGES = ("app", "retrieval", "rerank", "indexer", "web")


def local(name: str) -> str | None:
    """``rubricsearch.retrieval.x`` -> ``retrieval.x`` (the tree's folder path, dotted); None for other modules."""
    return name.removeprefix(f"{NS}.") if name.startswith(f"{NS}.") else None


def imported_modules(path: Path) -> list[str]:
    """Each absolute module an import in ``path`` names; ``from x import y`` counts as ``x.y`` (y may be a module)."""
    names: list[str] = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names.extend(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.extend(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def violations(root: Path) -> list[str]:
    found = []
    for package, banned in FORBIDDEN.items():
        folder = root.joinpath(*package.split("."))
        for path in sorted(folder.rglob("*.py")):
            for name in filter(None, map(local, imported_modules(path))):
                hit = next((b for b in banned if name == b or name.startswith(b + ".")), None)
                if hit:
                    found.append(f"{path.relative_to(root)} imports {name} ({package} must not import {hit})")
    return found


def test_every_layer_folder_exists() -> None:
    for package in FORBIDDEN:
        assert ROOT.joinpath(*package.split(".")).is_dir(), package


def test_imports_point_one_way() -> None:
    assert violations(ROOT) == []


@pytest.mark.parametrize(
    ("where", "line"),
    [
        ("retrieval/index/stray.py", "from rubricsearch.app.settings import Settings\n"),
        ("rerank/stray.py", "def f():\n    import rubricsearch.indexer.blobs\n"),
        ("retrieval/plugins/accelerated/kernels/stray.py", "from rubricsearch.retrieval.qwen.engine import forward\n"),
        ("retrieval/qwen/model/stray.py", "import rubricsearch.retrieval.qwen.engine.vision\n"),
    ],
)
def test_a_stray_import_is_caught(tmp_path: Path, where: str, line: str) -> None:
    """The check itself can fail: one backwards import, planted in a copy of the tree's layout, is reported."""
    for package in FORBIDDEN:
        tmp_path.joinpath(*package.split(".")).mkdir(parents=True, exist_ok=True)
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(line)
    assert len(violations(tmp_path)) == 1


def module_file(root: Path, name: str) -> Path | None:
    dotted = local(name)
    if dotted is None:
        return None
    path = root.joinpath(*dotted.split("."))
    return next((p for p in (path.with_suffix(".py"), path / "__init__.py") if p.is_file()), None)


def imported_files(root: Path, path: Path) -> set[Path]:
    """The files of the tree that ``path``'s imports load when it runs: ``from a import b`` loads a/b.py where b is
    a module, else a. Imports under ``if TYPE_CHECKING:`` never run, so they tie nothing."""
    tree = ast.parse(path.read_text(), filename=str(path))
    typing_only: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for stmt in node.body for n in ast.walk(stmt))
    found: set[Path | None] = set()
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            found.update(module_file(root, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.update(module_file(root, f"{node.module}.{alias.name}") or module_file(root, node.module)
                         for alias in node.names)
    return {f for f in found if f is not None and f != path}


def import_circle(root: Path) -> list[str]:
    """One circle of modules that import each other (the first back to the last), or [] where there is none."""
    files = [path for package in PACKAGES for path in sorted((root / package).rglob("*.py"))]
    graph = {path: imported_files(root, path) for path in files}
    try:
        TopologicalSorter(graph).prepare()
    except CycleError as exc:
        return [str(path.relative_to(root)) for path in exc.args[1]]
    return []


def test_no_import_circle() -> None:
    assert import_circle(ROOT) == [], "move what both sides need into a module below both"


def test_a_planted_import_circle_is_caught(tmp_path: Path) -> None:
    """The check itself can fail: a lazy import back round a three-module chain is a circle; the same import made
    for type checking alone is not."""
    (tmp_path / "app" / "cli").mkdir(parents=True)
    (tmp_path / "app" / "cli" / "a.py").write_text("from rubricsearch.app.cli.b import f\n")
    (tmp_path / "app" / "cli" / "b.py").write_text("import rubricsearch.app.cli.c\n")
    back = tmp_path / "app" / "cli" / "c.py"
    back.write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from rubricsearch.app.cli.a import g\n")
    assert import_circle(tmp_path) == []
    back.write_text("def h():\n    from rubricsearch.app.cli.a import g\n")
    assert sorted(import_circle(tmp_path)[:-1]) == ["app/cli/a.py", "app/cli/b.py", "app/cli/c.py"]


def bare_imports(root: Path) -> list[str]:
    """Imports of a layer by its folder name (``import app``) instead of its installed one (``rubricsearch.app``):
    outside a checkout those names do not exist, and inside one they load a second copy of the module."""
    files = [p for folder in (*PACKAGES, "tests", "bench", "scripts") for p in (root / folder).rglob("*.py")]
    files += (root / NS).glob("*.py")  # its sub-folders are the links to the layers, already counted
    return [f"{path.relative_to(root)} imports {name}" for path in sorted(files) for name in imported_modules(path)
            if name.split(".")[0] in PACKAGES]


def test_every_import_names_the_installed_namespace() -> None:
    assert bare_imports(ROOT) == []


def test_a_bare_import_is_caught(tmp_path: Path) -> None:
    (tmp_path / "tests").mkdir()
    (tmp_path / "tests" / "t.py").write_text("from rubricsearch.app import cli\nfrom retrieval.images import x\n")
    assert bare_imports(tmp_path) == ["tests/t.py imports retrieval.images.x"]


# Optional parts (rubricsearch/app/plugins.py): found by entry point, never imported by the core.
PLUGINS = ("app.demo",  # entry point rubricsearch.plugins
           "retrieval.index.faiss_accel",  # retrieval/index/factory.py's registry
           # the accelerated local engine (kernels, packed passes, CUDA graphs, the GPU tower and preprocessing,
           # compile): retrieval/runtime/registry.py's RUNTIMES and VISION_ENCODERS
           "retrieval.plugins.accelerated", "rerank.plugins.accelerated",
           "retrieval.plugins", "rerank.plugins",  # whatever else comes behind the registry
           "retrieval.remote", "rerank.remote", "rerank.vllm_client")  # the vLLM transport: the same registry


def is_plugin(dotted: str) -> bool:
    return any(dotted == p or dotted.startswith(p + ".") for p in PLUGINS)


def core_files(root: Path) -> list[Path]:
    return [path for layer in PACKAGES for path in sorted((root / layer).rglob("*.py"))
            if not is_plugin(".".join(path.relative_to(root).with_suffix("").parts))]


def core_imports_of_plugins(root: Path) -> list[str]:
    found = []
    for path in core_files(root):
        for name in filter(None, map(local, imported_modules(path))):
            hit = next((p for p in PLUGINS if name == p or name.startswith(p + ".")), None)
            if hit:
                found.append(f"{path.relative_to(root)} imports {name} (the plug-in {hit})")
    return found


def test_the_core_never_imports_a_plugin() -> None:
    assert core_imports_of_plugins(ROOT) == []


@pytest.mark.parametrize(("where", "line", "plugin"), [
    ("app/state.py", "def f():\n    from rubricsearch.app.demo.x import g\n", "app.demo.x.g (the plug-in app.demo)"),
    ("retrieval/qwen/engine/batching.py", "from rubricsearch.retrieval.plugins.accelerated.packed import x\n",
     "retrieval.plugins.accelerated.packed.x (the plug-in retrieval.plugins.accelerated)"),
    ("retrieval/qwen/model/loading.py", "import rubricsearch.retrieval.plugins.accelerated.kernels.fused_kernels\n",
     "retrieval.plugins.accelerated.kernels.fused_kernels (the plug-in retrieval.plugins.accelerated)"),
    ("rerank/local.py", "from rubricsearch.rerank.plugins.accelerated import packed_prefix\n",
     "rerank.plugins.accelerated.packed_prefix (the plug-in rerank.plugins.accelerated)"),
])
def test_a_core_import_of_a_plugin_is_caught(tmp_path: Path, where: str, line: str, plugin: str) -> None:
    (tmp_path / "app" / "demo").mkdir(parents=True)
    (tmp_path / "app" / "demo" / "x.py").write_text("from rubricsearch.app.state import AppState\n")  # allowed
    accelerated = tmp_path / "retrieval" / "plugins" / "accelerated"
    accelerated.mkdir(parents=True)
    (accelerated / "vision.py").write_text("from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder\n")
    (tmp_path / where).parent.mkdir(parents=True, exist_ok=True)
    (tmp_path / where).write_text(line)
    assert core_imports_of_plugins(tmp_path) == [f"{where} imports {plugin}"]


# What only the accelerated engine runs: a core module that reaches for one of these belongs in its plug-in.
ACCELERATION_MODULES = ("triton", "liger_kernel")
ACCELERATION_CALLS = ("torch.cuda.graph", "torch.cuda.CUDAGraph", "torch.compile",
                      "torch.ops.aten._flash_attention_forward", "torch.ops.aten._cudnn_attention_forward")


def acceleration_in_the_core(root: Path) -> list[str]:
    found = []
    for path in core_files(root):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else [node.module or ""]
                found += [f"{path.relative_to(root)} imports {n}" for n in names
                          if n.split(".")[0] in ACCELERATION_MODULES]
            elif isinstance(node, ast.Attribute) and ast.unparse(node) in ACCELERATION_CALLS:
                found.append(f"{path.relative_to(root)} uses {ast.unparse(node)}")
    return found


def test_the_acceleration_lives_in_its_plugin() -> None:
    assert acceleration_in_the_core(ROOT) == []


def test_acceleration_planted_in_the_core_is_caught(tmp_path: Path) -> None:
    engine = tmp_path / "retrieval" / "qwen" / "engine"
    engine.mkdir(parents=True)
    (engine / "forward.py").write_text("import torch\n\ng = torch.cuda.CUDAGraph()\n")
    (engine / "batching.py").write_text("def f():\n    import triton.language as tl\n")
    plugin = tmp_path / "retrieval" / "plugins" / "accelerated"
    plugin.mkdir(parents=True)
    (plugin / "graphed_lm.py").write_text("import torch\nimport triton\n\ng = torch.cuda.CUDAGraph()\n")  # its place
    assert acceleration_in_the_core(tmp_path) == ["retrieval/qwen/engine/batching.py imports triton.language",
                                                  "retrieval/qwen/engine/forward.py uses torch.cuda.CUDAGraph"]
