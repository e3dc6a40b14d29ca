"""train-demo-models writes an ordinary HF checkpoint that the real loader serves, and reuses it when current."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest

from app.demo.evaluation import eval_set
from app.demo.models import DemoPlan, build_embedder, cached, read_card
from app.demo.train_embedder import EmbedderRecipe
from app.demo.training import DEMO_CARD
from retrieval.qwen.prompts import Content

pytestmark = pytest.mark.slow

# a few steps on a small batch: this checks the machinery (gradients through the inference forward, saving,
# loading, caching), not quality
QUICK = DemoPlan(train_images=24, embedder=EmbedderRecipe(steps=2, batch=6, pool=6))


def _vectors(path: Path) -> np.ndarray:
    from retrieval import load_embedder

    _, images = eval_set(4)
    embedder = load_embedder(str(path), device="cpu")
    try:
        return embedder.embed_contents([Content(texts=[], images=[i]) for i in images], [None] * len(images))
    finally:
        embedder.close()


def test_trained_checkpoint_loads_through_the_real_loader_and_is_reused(tmp_path: Path) -> None:
    out = build_embedder(tmp_path / "demo-embedding", QUICK, threads=1)
    card = read_card(out)
    assert card is not None and card["plan"]["embedder"]["steps"] == 2 and len(card["losses"]) == 2
    assert all(np.isfinite(card["losses"]))
    assert (out / "config.json").exists() and list(out.glob("*.safetensors"))
    assert (out / "chat_template.jinja").exists() or (out / "tokenizer_config.json").exists()
    assert not list(tmp_path.glob(".demo-train-*"))  # the work directory is gone
    first = _vectors(out)
    assert first.shape[0] == 4 and np.allclose(np.linalg.norm(first, axis=1), 1.0, atol=1e-4)

    stamp = (out / DEMO_CARD).stat().st_mtime_ns
    assert build_embedder(out, QUICK, threads=1) == out and (out / DEMO_CARD).stat().st_mtime_ns == stamp
    other = dataclasses.replace(QUICK, seed=1)
    assert cached(out, QUICK) and not cached(out, other)


def test_training_is_seeded(tmp_path: Path) -> None:
    a = build_embedder(tmp_path / "a", QUICK, threads=1)
    b = build_embedder(tmp_path / "b", QUICK, threads=1)
    card_a, card_b = read_card(a), read_card(b)
    assert card_a is not None and card_b is not None and card_a["losses"] == card_b["losses"]
    assert np.allclose(_vectors(a), _vectors(b), atol=1e-5)
