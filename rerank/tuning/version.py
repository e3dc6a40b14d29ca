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
    split = tuned.split
    return tuned.card(
        kind="reranker", base=tuned.base, loaded=tuned.loaded,
        method="LoRA on the language model's linear layers, merged; vision tower and LM head unchanged",
        data={**(about or {}), "train_references": len(split.train_references),
              "validation_references": len(split.validation_references), "train_judgments": len(split.train),
              "validation_judgments": len(split.validation)},
        settings=tuned.settings.to_json("reranker"),
        held_out="the validation references' judgments (split by reference)",
        before=tuned.before.to_json(), after=tuned.after.to_json())


def save_version(tuned: Tuned, out: Path, about: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Merge, save the checkpoint and its card into the new folder ``out`` (atomically); returns the card."""
    refuse_existing(out)
    written = card(tuned, about)
    save_merged(tuned.peft_model, tuned.base, tuned.loaded.tower_hash, out, written)
    return written
