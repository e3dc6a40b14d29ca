"""What pip installs: one package, ``rubricsearch``, with the layers under it and the public API in one import.

The repository keeps its layer folders at the top (app/, retrieval/, ...); a wheel built from it must hold them only
under ``rubricsearch/`` (a user's own ``app`` package and ours must live in one environment), with the templates,
migrations and chat templates the code reads at run time.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

import rubricsearch

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ("app", "retrieval", "rerank", "indexer", "web")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # built from a copy: setuptools keeps a build/ folder in the source tree, whose leftovers would reach the wheel
    src, out = tmp_path_factory.mktemp("src"), tmp_path_factory.mktemp("wheel")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("rubricsearch", *LAYERS):
        shutil.copytree(ROOT / name, src / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out),
                    str(src)], check=True, capture_output=True, timeout=300)
    return next(out.glob("rubricsearch-*.whl"))


def top_level(names: list[str]) -> set[str]:
    return {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}


def test_the_wheel_installs_one_package_with_every_layer_and_its_data(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    assert top_level(names) == {"rubricsearch"}
    for layer in LAYERS:
        assert f"rubricsearch/{layer}/__init__.py" in names
    for data in ("rubricsearch/web/templates/", "rubricsearch/web/static/", "rubricsearch/indexer/catalog/migrations/",
                 "rubricsearch/retrieval/qwen/model/chat_template.jinja", "rubricsearch/rerank/templates/"):
        assert any(n.startswith(data) for n in names), data
    # every module of the tree is in the wheel, and nothing twice
    tree = {f"rubricsearch/{p.relative_to(ROOT).as_posix()}" for layer in LAYERS for p in (ROOT / layer).rglob("*.py")}
    assert tree <= set(names) and len(names) == len(set(names))


def test_installed_the_old_top_level_names_do_not_exist(wheel: Path, tmp_path: Path) -> None:
    """Installed from the wheel alone (no checkout on the path), ``rubricsearch.app`` imports and ``app`` does not."""
    target = tmp_path / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(target), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    probe = ("import importlib.util, sys\n"
             "import rubricsearch.app.settings, rubricsearch.web\n"
             "assert rubricsearch.app.settings.__file__.startswith(sys.argv[1]), rubricsearch.app.settings.__file__\n"
             "assert (rubricsearch.web.TEMPLATES_DIR / 'base.html').is_file()\n"
             "print(sorted(n for n in ('app', 'retrieval', 'rerank', 'indexer', 'web')"
             " if importlib.util.find_spec(n)))\n")
    # away from the checkout: the wheel's copy comes first on the path, and the working directory holds no layer
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(target)}
    done = subprocess.run([sys.executable, "-c", probe, str(target)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


def test_the_public_api_is_one_import() -> None:
    for name in rubricsearch.__all__:
        assert getattr(rubricsearch, name) is not None, name
    with pytest.raises(AttributeError):
        _ = rubricsearch.no_such_name  # type: ignore[attr-defined]


def test_importing_the_package_loads_neither_torch_nor_fastapi() -> None:
    done = subprocess.run([sys.executable, "-c", "import sys, rubricsearch; "
                           "print([m for m in ('torch', 'fastapi', 'transformers') if m in sys.modules])"],
                          capture_output=True, text=True, timeout=120, cwd=ROOT, check=True)
    assert done.stdout.strip() == "[]"
