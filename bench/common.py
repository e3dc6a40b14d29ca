"""What every benchmark shares: the product's settings, changed only where the command line says so, and printed.

A bench measures what ``rubricsearch serve`` would run. Its model and pipeline options come from
:class:`app.settings.Settings` (defaults, then ``RUBRICSEARCH_*`` variables), and ``--set NAME=VALUE`` changes one
for this run; it is exported as ``RUBRICSEARCH_NAME`` too, so a server the bench starts runs it as well.
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

# the settings that change a bench's numbers (the rest are limits, auth and storage paths)
PERFORMANCE = ("device", "dtype", "preprocess", "fused_kernels", "cuda_graphs", "bulk_graphs", "compile_blocks",
               "min_pixels", "max_pixels", "package_storage_dtype", "embed_batch_size", "rerank_batch_size",
               "lm_workers", "torch_threads", "worker_batch_size", "worker_batch_pixels", "vector_search_device",
               "vector_device_precision", "faiss_ann_threshold")


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
                    help="a product setting for this run (RUBRICSEARCH_NAME, e.g. preprocess=gpu-nvjpeg); "
                         "every other one is the product's default or the environment's")


def apply_overrides(pairs: list[str]) -> dict[str, str]:
    """``--set`` values exported as ``RUBRICSEARCH_*`` (servers the bench starts inherit them); unknown names
    and invalid values stop the bench before it starts."""
    out: dict[str, str] = {}
    for pair in pairs:
        name, sep, value = pair.partition("=")
        name = name.strip().replace("-", "_").lower()
        if not sep or name not in Settings.model_fields:
            raise SystemExit(f"--set {pair!r}: expected NAME=VALUE with NAME one of {', '.join(PERFORMANCE)}, ...")
        out[name] = value
        os.environ[f"RUBRICSEARCH_{name.upper()}"] = value
    Settings()  # validated now: a bad value is refused here, not inside a timed run
    return out


def product_settings(args: argparse.Namespace, **bench: Any) -> Settings:
    """The product's settings with ``--set`` applied; ``bench`` sets what a bench must own (its data folder, the
    random checkpoints it wrote) and is not a performance choice."""
    apply_overrides(args.settings)
    return Settings(**bench)


def settings_line(settings: Settings, **resolved: Any) -> str:
    """``settings: name=value ...`` for :data:`PERFORMANCE`, ``*`` after each non-default; ``resolved`` adds
    what ``auto`` became in this process (e.g. ``fused_kernels_in_use=True``)."""
    parts = []
    for name in PERFORMANCE:
        value = getattr(settings, name)
        default = Settings.model_fields[name].default
        parts.append(f"{name}={value}{'' if value == default else '*'}")
    parts += [f"{k}={v}" for k, v in resolved.items()]
    return "settings: " + " ".join(parts) + "   (* = not the product's default)"


def non_default(settings: Settings) -> str:
    """The performance settings that differ from the product's defaults, for a report row's label."""
    changed = [f"{n}={getattr(settings, n)}" for n in PERFORMANCE
               if getattr(settings, n) != Settings.model_fields[n].default]
    return ", ".join(changed) or "defaults"
