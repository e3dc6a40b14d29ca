"""train-demo-models writes ordinary HF checkpoints that the real loaders serve, and reuses them when current."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest

from rubricsearch.app.demo.checkpoints import DemoPlan, build_all, build_embedder, cached, read_card
from rubricsearch.app.demo.evaluation import eval_set
from rubricsearch.app.demo.policy import PolicySize
from rubricsearch.app.demo.train_embedder import EmbedderRecipe
from rubricsearch.app.demo.train_reranker import RerankerRecipe
from rubricsearch.app.demo.training import DEMO_CARD
from rubricsearch.rerank.rubric import POLICY_FILE, QUERY_KINDS, read_policy
from rubricsearch.retrieval.qwen.model.prompts import Content

pytestmark = pytest.mark.slow

# a few steps on a small batch: this checks the machinery (gradients through the inference forward, saving,
# loading, caching), not quality
QUICK = DemoPlan(train_images=24, embedder=EmbedderRecipe(steps=2, batch=6, pool=6, tower_steps=2,
                                                                tower_batch=6, tower_images=24),
                 reranker=RerankerRecipe(steps=2, queries=2, documents=4))


# The trainer's policy measurement on a few faces and queries: these tests check that it runs with the checkpoint, is
# recorded whole and is deterministic, not what it finds (tests/test_demo_quality.py serves the default plan's
# measurement), and the default size would cost most of each build.
FEW = PolicySize(docs=30, per_kind=3, shortlist=8)


def _vectors(path: Path) -> np.ndarray:
    from rubricsearch.retrieval import load_embedder

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


def _scores(path: Path) -> list[float]:
    from rubricsearch.rerank import load_reranker

    _, images = eval_set(3)
    reranker = load_reranker(str(path), device="cpu")
    try:
        return reranker.score({"text": "green eyes"}, [{"image": i} for i in images], "Judge it")
    finally:
        reranker.close()


def test_both_models_train_load_and_are_seeded(tmp_path: Path) -> None:
    """The reranker starts from the embedder and keeps its tower: one package per image serves both."""
    from rubricsearch.rerank import load_reranker
    from rubricsearch.retrieval import load_embedder

    a = build_all(tmp_path / "a", QUICK, threads=1, policy_size=FEW)
    b = build_all(tmp_path / "b", QUICK, threads=1, policy_size=FEW)
    for role in ("embedding", "reranker"):
        card_a, card_b = read_card(a[role]), read_card(b[role])
        assert card_a is not None and card_b is not None and card_a["losses"] == card_b["losses"]
        assert len(card_a["losses"]) == 2 and all(np.isfinite(card_a["losses"]))
    assert cached(a["reranker"], QUICK, "reranker") and not cached(a["reranker"], QUICK)
    # the trainer measured its rerank policy with the checkpoint; without it the reranker is not finished
    policy = read_policy(a["reranker"])
    assert set(policy.kinds) == set(QUERY_KINDS)
    assert all(p.measured is not None and p.calibration is not None for p in policy.kinds.values())
    assert json.loads((a["reranker"] / POLICY_FILE).read_text()) == json.loads(
        (b["reranker"] / POLICY_FILE).read_text())  # measured deterministically
    # a policy file of another measurement's version is measured again, the weights kept
    current = json.loads((a["reranker"] / POLICY_FILE).read_text())
    assert not any("judgement_calibration" in row for row in current["kinds"].values())  # the set calibrates
    older = current | {"version": current["version"] - 1}
    (a["reranker"] / POLICY_FILE).write_text(json.dumps(older))
    weights = {f.name: f.stat().st_mtime_ns for f in a["reranker"].glob("*.safetensors")}
    assert build_all(tmp_path / "a", QUICK, threads=1, policy_size=FEW) == a
    assert json.loads((a["reranker"] / POLICY_FILE).read_text()) == current
    assert {f.name: f.stat().st_mtime_ns for f in a["reranker"].glob("*.safetensors")} == weights
    (a["reranker"] / POLICY_FILE).unlink()
    assert not cached(a["reranker"], QUICK, "reranker")
    # another reranker recipe retrains the reranker only
    assert cached(a["embedding"], dataclasses.replace(QUICK, reranker=RerankerRecipe(steps=3)))
    assert np.allclose(_vectors(a["embedding"]), _vectors(b["embedding"]), atol=1e-5)
    scores = _scores(a["reranker"])
    assert np.allclose(scores, _scores(b["reranker"]), atol=1e-5) and all(0 < s < 1 for s in scores)
    emb, rr = load_embedder(str(a["embedding"]), device="cpu"), load_reranker(str(a["reranker"]), device="cpu")
    assert emb.packages.fingerprint == rr.packages.fingerprint
