"""Build (or reuse) the demo embedding checkpoint: a small Qwen3-VL trained on generated faces.

The result is an ordinary Hugging Face checkpoint directory (safetensors, config, the test checkpoints'
tokenizer, processor and chat template) that :func:`retrieval.load_embedder` loads like any real one. A
card (``rubricsearch_demo_model.json``) records the recipe, seed, data sizes, losses and training time;
a directory whose card matches the requested recipe is reused, so the data dir caches it.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from app.demo.train_embedder import EmbedderRecipe, train_embedder
from app.demo.training import DEMO_CARD, Arch, ImageBank, Trainee, base_checkpoint, seed_everything

log = logging.getLogger("rubricsearch.demo")

DEMO_MODELS_DIR = "demo-models"  # under the data dir
EMBEDDING_DIR = "demo-embedding"
TRAIN_SEED = 3


@dataclass(frozen=True)
class DemoPlan:
    """Everything that decides the weights; the card stores it, and a different plan retrains."""

    seed: int = 0
    train_images: int = 240
    arch: Arch = field(default_factory=Arch)
    embedder: EmbedderRecipe = field(default_factory=EmbedderRecipe)
    version: int = 1

    def card(self) -> dict[str, Any]:
        return {"version": self.version, "seed": self.seed, "train_images": self.train_images,
                "arch": asdict(self.arch), "embedder": asdict(self.embedder)}


def read_card(path: Path) -> dict[str, Any] | None:
    try:
        card = json.loads((path / DEMO_CARD).read_text())
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None


def cached(path: Path, plan: DemoPlan) -> bool:
    """Whether ``path`` holds a finished checkpoint of exactly this plan."""
    card = read_card(path)
    if card is None or (path / "config.json").exists() is False:
        return False
    return bool(json.loads(json.dumps(plan.card())) == card.get("plan"))


def build_embedder(out: Path, plan: DemoPlan | None = None, *, threads: int | None = None,
                   force: bool = False) -> Path:
    """Train the demo embedder into ``out`` (atomically: a temporary sibling, renamed when complete)."""
    plan = plan or DemoPlan()
    if not force and cached(out, plan):
        log.info("reusing demo embedder at %s", out)
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".demo-train-", dir=out.parent))
    try:
        started = time.monotonic()
        rng = seed_everything(plan.seed)
        base = base_checkpoint(work / "base", "embedding", arch=plan.arch, seed=plan.seed)
        trainee = Trainee(base, threads=threads)
        bank = ImageBank.build(trainee.encoder, "train", plan.train_images, seed=TRAIN_SEED)
        losses = train_embedder(trainee, bank, plan.embedder, rng)
        seconds = time.monotonic() - started
        final = work / "final"
        trainee.save(final, {"plan": plan.card(), "losses": [round(x, 4) for x in losses],
                             "train_seconds": round(seconds, 1),
                             "note": "demo embedder trained on generated faces (app/demo); not a real model"})
        if out.exists():
            shutil.rmtree(out)
        final.rename(out)
        log.info("demo embedder trained in %.0f s -> %s", seconds, out)
        return out
    finally:
        shutil.rmtree(work, ignore_errors=True)


def build_all(data_dir: Path, plan: DemoPlan | None = None, *, threads: int | None = None,
              force: bool = False) -> dict[str, Path]:
    return {"embedding": build_embedder(data_dir / EMBEDDING_DIR, plan, threads=threads, force=force)}


def demo_checkpoint(data_dir: Path, kind: str) -> Path | None:
    """The trained demo checkpoint of this kind in the data dir (current plan), or None.

    Only the embedder is trained so far; the reranker falls back to the random-weight test checkpoint."""
    path = data_dir / DEMO_MODELS_DIR / EMBEDDING_DIR
    return path if kind == "embedding" and cached(path, DemoPlan()) else None


def is_demo_model(data_dir: Path, model_id: str) -> bool:
    """Whether the model served as ``model_id`` (its public id, never a path) is the data dir's demo embedder."""
    from retrieval.qwen.loading import public_model_id

    demo = demo_checkpoint(data_dir, "embedding")
    return demo is not None and public_model_id(demo) == model_id
