"""A trained model as a new version: a checkpoint folder beside the base, never an overwrite.

The adapters are merged into the language model (:func:`rubricsearch.retrieval.tuning.loop.merged`) and the whole
``Qwen3VLForConditionalGeneration`` is saved as the base was, so the product's loader and a vLLM server load the
version like any checkpoint. ``card.json`` says what made it (each trainer writes its own). The tower's weights
are the base's, bit for bit, so every package stored for the base serves the version; saving refuses a version
whose tower moved.

The folder is written under a temporary name next to ``out`` and renamed when complete, so a failure (a full
disk included) leaves no half version.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch

from rubricsearch.retrieval.durable import fsync_dir
from rubricsearch.retrieval.errors import Conflict, InsufficientStorage, PackageMismatch, disk_full
from rubricsearch.retrieval.qwen.model.loading import tower_hash
from rubricsearch.retrieval.tuning.loop import merged

CARD = "card.json"
WEIGHTS = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json")


def refuse_existing(out: Path) -> None:
    if out.exists():
        raise Conflict("the version folder exists already: a version is never overwritten; name a new one",
                       out=str(out))


def save_merged(peft_model: Any, base: Path, base_tower_hash: str, out: Path, card: dict[str, Any]) -> None:
    """Merge the adapters, check the tower, and save the checkpoint with ``card`` into the new folder ``out``
    (atomically)."""
    refuse_existing(out)
    model = merged(peft_model)
    if tower_hash(model.visual) != base_tower_hash:
        raise PackageMismatch("the vision tower changed in training: the stored packages would not fit the version")
    tmp = out.parent / f".{out.name}.partial-{uuid.uuid4().hex[:8]}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _write(model, base, tmp, card)
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
