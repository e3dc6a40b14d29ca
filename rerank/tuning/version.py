"""A trained reranker as a new model version (:mod:`retrieval.tuning.version` writes the folder).

``card.json`` says what made it: the base, the judgments used, the settings, the held-out metrics before and
after, the wall time, and the vision encodes (0); it names the tower hash and the packages' fingerprint, the
base's, so every package stored for the base serves the version.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from rubricsearch.rerank.tuning.trainer import Tuned
from rubricsearch.retrieval.tuning.version import refuse_existing, save_merged


def card(tuned: Tuned, about: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``about``: where the judgments came from (the set), recorded with the data snapshot."""
    ids = tuned.judgment_ids
    return {
        "kind": "reranker",
        "base_model": str(tuned.base.resolve()),
        "method": "LoRA on the language model's linear layers, merged; vision tower and LM head unchanged",
        "data": {**(about or {}), "judgment_ids": ids, "max_judgment_id": tuned.max_judgment_id,
                 "judgments": len(ids),
                 "skipped_without_package": tuned.skipped_without_package,
                 "train_references": len(tuned.split.train_references),
                 "validation_references": len(tuned.split.validation_references),
                 "train_judgments": len(tuned.split.train), "validation_judgments": len(tuned.split.validation)},
        "settings": tuned.settings.to_json(),
        "training": {"steps_run": tuned.steps_run, "best_step": tuned.best_step,
                     "first_loss": round(tuned.losses[0], 4) if tuned.losses else None,
                     "last_loss": round(tuned.losses[-1], 4) if tuned.losses else None,
                     "device": str(tuned.loaded.device), "dtype": str(tuned.loaded.dtype).removeprefix("torch.")},
        "metrics": {"held_out": "the validation references' judgments (split by reference)",
                    "before": tuned.before.to_json(), "after": tuned.after.to_json()},
        "wall_s": round(tuned.wall_s, 2),
        "vision_encodes": tuned.vision_encodes,
        "tower_hash": tuned.loaded.tower_hash,
        "package_fingerprint": tuned.fingerprint,
    }


def save_version(tuned: Tuned, out: Path, about: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Merge, save the checkpoint and its card into the new folder ``out`` (atomically); returns the card."""
    refuse_existing(out)
    written = card(tuned, about)
    save_merged(tuned.peft_model, tuned.base, tuned.loaded.tower_hash, out, written)
    return written
