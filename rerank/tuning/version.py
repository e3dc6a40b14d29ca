"""A trained reranker as a new model version: a checkpoint folder beside the base, never an overwrite.

The adapters are merged into the language model (peft's ``merge_and_unload``) and the whole
``Qwen3VLForConditionalGeneration`` is saved as the base was, so the product's loader and a vLLM server load the
version like any checkpoint. ``card.json`` says what made it: the base, the judgments used, the settings, the
held-out metrics before and after, the wall time, and the vision encodes (0). The tower's weights are the base's,
bit for bit, so every package stored for the base serves the version; the card names the tower hash and the
packages' fingerprint, and saving refuses a version whose tower moved.

The folder is written under a temporary name next to ``out`` and renamed when complete, so a failure (a full
disk included) leaves no half version.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from rubricsearch.rerank.tuning.trainer import Tuned
from rubricsearch.retrieval.durable import fsync_dir
from rubricsearch.retrieval.errors import Conflict, InsufficientStorage, PackageMismatch, disk_full
from rubricsearch.retrieval.qwen.model.loading import tower_hash

CARD = "card.json"
WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


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
    if out.exists():
        raise Conflict("the version folder exists already: a version is never overwritten; name a new one",
                       out=str(out))
    merged = tuned.peft_model.merge_and_unload()
    if tower_hash(merged.visual) != tuned.loaded.tower_hash:
        raise PackageMismatch("the vision tower changed in training: the stored packages would not fit the version")
    written = card(tuned, about)
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(merged, tuned.base, tmp, written)
        os.rename(tmp, out)
        fsync_dir(out.parent)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        if disk_full(exc):
            raise InsufficientStorage("the disk filled while saving the version: nothing was kept",
                                      out=str(out)) from exc
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return written


def _write(merged: Any, base: Path, tmp: Path, written: dict[str, Any]) -> None:
    from transformers import Qwen3VLForConditionalGeneration

    full = Qwen3VLForConditionalGeneration.from_pretrained(str(base), dtype=merged.dtype)
    full.model.load_state_dict({k: v.to("cpu") for k, v in merged.state_dict().items()})
    tmp.mkdir()
    with torch.no_grad():
        full.save_pretrained(str(tmp), safe_serialization=True)
    for item in base.iterdir():  # tokenizer, processor, chat template and the checkpoint's other files
        if item.is_file() and not item.name.endswith(WEIGHTS) and not (tmp / item.name).exists():
            shutil.copy2(item, tmp / item.name)
    (tmp / CARD).write_text(json.dumps(written, indent=2, sort_keys=True))
    for item in tmp.iterdir():
        with open(item, "rb") as f:
            os.fsync(f.fileno())
    fsync_dir(tmp)
