"""Build (or reuse) the demo checkpoints: a small Qwen3-VL embedder and reranker trained on generated faces.

Each result is an ordinary Hugging Face checkpoint directory (safetensors, config, the test checkpoints'
tokenizer, processor and chat template) that :func:`retrieval.load_embedder` and
:func:`rerank.load_reranker` load like real ones. A card (``rubricsearch_demo_model.json``) records the
recipe, seed, data sizes, losses and training time; a directory whose card matches the requested recipe is
reused, so the data dir caches it.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from rubricsearch.app.demo.policy import PolicySize, policy_current, write_policy
from rubricsearch.app.demo.train_embedder import EmbedderRecipe, train_embedder
from rubricsearch.app.demo.train_reranker import RerankerRecipe, frozen_packages, init_from_embedder, train_reranker
from rubricsearch.app.demo.training import DEMO_CARD, Arch, ImageBank, Trainee, base_checkpoint, seed_everything
from rubricsearch.rerank.rubric import POLICY_FILE

log = logging.getLogger("rubricsearch.demo")

DEMO_MODELS_DIR = "demo-models"  # under the data dir
EMBEDDING_DIR = "demo-embedding"
RERANKER_DIR = "demo-reranker"
Role = Literal["embedding", "reranker"]
DIRS: dict[str, str] = {"embedding": EMBEDDING_DIR, "reranker": RERANKER_DIR}
TRAIN_SEED = 3
# What the banner, provenance, the CLI, the API and /v1/models call the models that serve: one wording each.
DEMO_LABEL = "demo models trained on generated faces: only the demo set's rankings mean anything"


@dataclass(frozen=True)
class DemoPlan:
    """Everything that decides the weights; the cards store it, and a different plan retrains."""

    seed: int = 0
    train_images: int = 240
    arch: Arch = field(default_factory=Arch)
    embedder: EmbedderRecipe = field(default_factory=EmbedderRecipe)
    reranker: RerankerRecipe = field(default_factory=RerankerRecipe)
    version: int = 3  # raised when the faces are drawn differently: the cards hold the plan, not the pixels

    def card(self, role: Role = "embedding") -> dict[str, Any]:
        """The embedder's card leaves the reranker recipe out (changing it does not retrain the embedder);
        the reranker's has everything, as it starts from the embedder."""
        card = {"version": self.version, "seed": self.seed, "train_images": self.train_images,
                "arch": asdict(self.arch), "embedder": asdict(self.embedder)}
        return card | {"reranker": asdict(self.reranker)} if role == "reranker" else card


def read_card(path: Path) -> dict[str, Any] | None:
    try:
        card = json.loads((path / DEMO_CARD).read_text())
    except (OSError, ValueError):
        return None
    return card if isinstance(card, dict) else None


def cached(path: Path, plan: DemoPlan, role: Role = "embedding") -> bool:
    """Whether ``path`` holds a finished checkpoint of exactly this plan."""
    card = read_card(path)
    if card is None or (path / "config.json").exists() is False:
        return False
    if role == "reranker" and not (path / POLICY_FILE).exists():  # its policy is measured as part of the build
        return False
    return bool(json.loads(json.dumps(plan.card(role))) == card.get("plan"))


@contextmanager
def _atomic(out: Path) -> Iterator[Path]:
    """A temporary sibling to train in; its ``final`` directory replaces ``out`` when the block completes."""
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".demo-train-", dir=out.parent))
    try:
        yield work
        if out.exists():
            shutil.rmtree(out)
        (work / "final").rename(out)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def _bank(trainee: Trainee, plan: DemoPlan) -> ImageBank:
    return ImageBank.build(trainee.encoder, "train", plan.train_images, seed=TRAIN_SEED)


def build_embedder(out: Path, plan: DemoPlan | None = None, *, threads: int | None = None,
                   force: bool = False) -> Path:
    """Train the demo embedder into ``out`` (atomically: a temporary sibling, renamed when complete)."""
    plan = plan or DemoPlan()
    if not force and cached(out, plan):
        log.info("reusing demo embedder at %s", out)
        return out
    with _atomic(out) as work:
        started = time.monotonic()
        rng = seed_everything(plan.seed)
        base = base_checkpoint(work / "base", "embedding", arch=plan.arch, seed=plan.seed)
        trainee = Trainee(base, threads=threads)
        losses = train_embedder(trainee, _bank(trainee, plan), plan.embedder, rng)
        seconds = time.monotonic() - started
        trainee.save(work / "final", {"plan": plan.card(), "losses": [round(x, 4) for x in losses],
                                      "train_seconds": round(seconds, 1),
                                      "note": "demo embedder trained on generated faces (app/demo); not a real model"})
    log.info("demo embedder trained in %.0f s -> %s", seconds, out)
    return out


def build_reranker(out: Path, embedder: Path, plan: DemoPlan | None = None, *, threads: int | None = None,
                   force: bool = False, policy_size: PolicySize = PolicySize()) -> Path:
    """Train the demo reranker into ``out``, starting from the demo embedder at ``embedder``, and measure its rerank
    policy at ``policy_size``."""
    plan = plan or DemoPlan()
    if not force and cached(out, plan, "reranker"):
        if not policy_current(out):
            log.info("measuring the rerank policy of %s again (an older measurement)", out)
            write_policy(embedder, out, policy_size)
        log.info("reusing demo reranker at %s", out)
        return out
    with _atomic(out) as work:
        started = time.monotonic()
        rng = seed_everything(plan.seed + 1)
        base = base_checkpoint(work / "base", "reranker", arch=plan.arch, seed=plan.seed)
        trainee = Trainee(base, threads=threads)
        init_from_embedder(trainee, Trainee(embedder, threads=threads))
        bank = _bank(trainee, plan)
        losses = train_reranker(trainee, bank, frozen_packages(trainee, bank), plan.reranker, rng)
        seconds = time.monotonic() - started
        trainee.save(work / "final", {"plan": plan.card("reranker"), "losses": [round(x, 4) for x in losses],
                                      "train_seconds": round(seconds, 1),
                                      "note": "demo reranker trained on generated faces (app/demo); not a real model"})
        measured = time.monotonic()
        policy = write_policy(embedder, work / "final", policy_size)
        log.info("rerank policy measured in %.0f s: %s", time.monotonic() - measured,
                 "; ".join(f"{kind} nDCG@10 {row['recall_ndcg10']:.3f} recall, {row['reranked_ndcg10']:.3f} reranked"
                           for kind, row in policy["kinds"].items()))
    log.info("demo reranker trained in %.0f s -> %s", seconds, out)
    return out


def build_all(data_dir: Path, plan: DemoPlan | None = None, *, threads: int | None = None,
              force: bool = False, policy_size: PolicySize = PolicySize()) -> dict[str, Path]:
    """Both demo models (the reranker starts from the embedder, so a retrained embedder retrains it too)."""
    embedder = build_embedder(data_dir / EMBEDDING_DIR, plan, threads=threads, force=force)
    reranker = build_reranker(data_dir / RERANKER_DIR, embedder, plan, threads=threads, force=force,
                              policy_size=policy_size)
    return {"embedding": embedder, "reranker": reranker}


def demo_checkpoint(data_dir: Path, kind: str) -> Path | None:
    """The trained demo checkpoint of this kind in the data dir (current plan), or None."""
    role: Role = "reranker" if kind == "reranker" else "embedding"
    path = data_dir / DEMO_MODELS_DIR / DIRS[role]
    return path if kind in DIRS and cached(path, DemoPlan(), role) else None


def is_demo_model(data_dir: Path, model_id: str, kind: str = "embedding") -> bool:
    """Whether the model served as ``model_id`` (its public id, never a path) is the data dir's demo model."""
    from rubricsearch.retrieval.qwen.model.loading import public_model_id

    demo = demo_checkpoint(data_dir, kind)
    return demo is not None and public_model_id(demo) == model_id
