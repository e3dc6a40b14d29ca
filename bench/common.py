"""What every benchmark shares: the product's settings, changed only where the command line says so, and printed.

A bench measures what ``rubricsearch serve`` would run. Its model and pipeline options come from
:class:`app.settings.Settings` (defaults, then ``RUBRICSEARCH_*`` variables), and ``--set NAME=VALUE`` changes one
for this run (``models.preprocess=gpu-nvjpeg``); it is exported as ``RUBRICSEARCH_MODELS__PREPROCESS`` too, so a
server the bench starts runs it as well.
:func:`settings_line` prints the performance-relevant settings as resolved, a ``*`` marking each that is not
the product's default, so every printed number can be read beside the configuration that produced it.
"""

from __future__ import annotations

import argparse
import atexit
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from rubricsearch.app.settings import Settings  # noqa: E402

# the settings that change a bench's numbers (the rest are limits, auth and storage paths), by their place in
# Settings, each with its flat name before the settings were grouped: ``gpu_report.py --against`` runs these
# benches in older trees too, where only the flat names exist
PERFORMANCE = {
    "models.device": "device", "models.dtype": "dtype", "models.preprocess": "preprocess", "models.engine": "engine",
    "models.max_pixels": "max_pixels",
    "packages.storage_dtype": "package_storage_dtype",
}
# what a bench sets itself (its checkpoints, no workers), likewise
OWNED = {"models.embedding_model": "embedding_model", "models.reranker_model": "reranker_model",
         "models.fallback_to_test_models": "fallback_to_test_models", "ingest.workers": "workers",
         "auth.admin_api_keys": "admin_api_keys"}
FLAT = {**PERFORMANCE, **OWNED}


def grouped(settings_cls: type[Settings] | None = None) -> bool:
    """Whether this tree's settings are grouped (``Settings.models``) or an older tree's flat ones."""
    return "models" in (settings_cls or Settings).model_fields


def setting(settings: Settings, path: str) -> Any:
    """The value at ``path`` (``models.device``) in this tree's settings, grouped or flat."""
    if not grouped(type(settings)):
        return getattr(settings, FLAT.get(path, path))
    value: Any = settings
    for part in path.split("."):
        value = getattr(value, part)
    return value


def default(path: str) -> Any:
    """The product's default of ``path``."""
    if not grouped():
        return Settings.model_fields[FLAT.get(path, path)].default
    group, _, field = path.rpartition(".")
    cls: Any = Settings.model_fields[group].annotation if group else Settings
    return cls.model_fields[field].default


def env_name(path: str) -> str:
    """The variable this tree reads for ``path``."""
    if not grouped():
        return f"RUBRICSEARCH_{FLAT.get(path, path).upper()}"
    return "RUBRICSEARCH_" + path.upper().replace(".", "__")


def known(path: str) -> bool:
    """Whether this tree has the setting ``path`` (an older tree lacks ``models.engine``)."""
    try:
        default(path)
    except (KeyError, AttributeError):
        return False
    return True

def export(ref: str, where: Path, *paths: str) -> Path:
    """``ref``'s files (only ``paths`` of them, if given) in a new folder ``where``, by ``git archive``: an export, not
    a registered worktree, so nothing is left in the repository when a run ends, however it ends. ``ref`` may also
    be such an archive's file (``git archive -o old.tar REF``), for a box that has the tree but not its history."""
    where.mkdir(parents=True)
    if ref.endswith(".tar") and Path(ref).is_file():
        subprocess.run(["tar", "-x", "-f", ref, "-C", str(where), *paths], check=True)
        return where
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", ref, *paths], check=True,
                             capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(where)], input=archive, check=True)
    return where


def engine(model: Any) -> Any:
    """A loaded model's runtime (``loaded``, ``vision``, ``scheduler``, ``client``), or the model itself in an older
    product whose model classes held those directly: the same bench code times both arms of an A/B."""
    return getattr(model, "runtime", model)


def scratch_dir(prefix: str) -> Path:
    """A temporary folder removed when the bench exits, a failed run too: checkpoints and data reach GBs at the 2B
    size and would fill a GPU box's disk."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, True)
    return path


def add_settings_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--set", action="append", default=[], metavar="NAME=VALUE", dest="settings",
                    help="a product setting for this run, named by its place (models.preprocess=gpu-nvjpeg, as "
                         "RUBRICSEARCH_MODELS__PREPROCESS); every other one is the product's default or the "
                         "environment's")


def apply_overrides(pairs: list[str]) -> dict[str, str]:
    """``--set`` values exported as the ``RUBRICSEARCH_*`` variables this tree reads (servers the bench starts
    inherit them); unknown names and invalid values stop the bench before it starts."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        path = name.strip().replace("-", "_").replace("__", ".").lower()
        if not sep or not known(path):
            raise SystemExit(f"--set {pair!r}: expected NAME=VALUE with NAME one of {', '.join(PERFORMANCE)}, ...")
        out[path] = value
        os.environ[env_name(path)] = value
    Settings()  # validated now: a bad value is refused here, not inside a timed run
    return out


def product_settings(args: argparse.Namespace, **bench: Any) -> Settings:
    """The product's settings with ``--set`` applied; ``bench`` sets what a bench must own (its data folder, the
    random checkpoints it wrote), named by place with ``__`` for the dot (``models__embedding_model``), and is not
    a performance choice."""
    apply_overrides(args.settings)
    values: dict[str, Any] = {}
    for name, value in bench.items():
        path = name.replace("__", ".")
        if not grouped():
            values[FLAT.get(path, path)] = value
        elif "." in path:
            group, field = path.split(".")
            values.setdefault(group, {})[field] = value
        else:
            values[path] = value
    return Settings(**values)

def settings_line(settings: Settings, **resolved: Any) -> str:
    """``settings: name=value ...`` for :data:`PERFORMANCE`, ``*`` after each non-default; ``resolved`` adds
    what ``auto`` became in this process (e.g. ``fused_kernels_in_use=True``)."""
    parts = []
    for path in filter(known, PERFORMANCE):
        value = setting(settings, path)
        parts.append(f"{path}={value}{'' if value == default(path) else '*'}")
    parts += [f"{k}={v}" for k, v in resolved.items()]
    return "settings: " + " ".join(parts) + "   (* = not the product's default)"


def performance_values(settings: Settings) -> dict[str, Any]:
    """:data:`PERFORMANCE` as a JSON object for a bench's result file."""
    return {path: (v if isinstance(v := setting(settings, path), str | int | float | bool | None) else str(v))
            for path in filter(known, PERFORMANCE)}


def non_default(settings: Settings) -> str:
    """The performance settings that differ from the product's defaults, for a report row's label."""
    changed = [f"{p}={setting(settings, p)}" for p in filter(known, PERFORMANCE) if setting(settings, p) != default(p)]
    return ", ".join(changed) or "defaults"
