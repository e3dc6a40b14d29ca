"""Facet quality floors of the trained demo reranker on the held-out faces (``bench/facet_quality.py`` measures
the same), and proof that they catch real bugs: the values swapped within each attribute, and each reference
given the probabilities of another. Each bug is patched into the facet job's computation and must fail the
floors. With random weights nothing about quality is claimed (the baseline is the bench's business)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import rubricsearch.indexer.jobs.facets as facet_jobs
from rubricsearch.app.demo.evaluation import eval_set
from rubricsearch.app.demo.facet_eval import FacetQuality, facet_quality

pytestmark = pytest.mark.slow

DOCS = 60
# Below the spread of fresh trainings (bench/demo_spread.py, six seeds, 60 held-out faces; docs/demo.md): species
# 0.967-0.983, fur 0.967-1.0, ears 0.617-0.983, stripes 0.550-0.867, eyes 0.900-0.983, mean 0.817-0.950. The
# injected bugs leave a mean of 0.153-0.423 and species 0.017-0.467 on every seed; random weights mean 0.427,
# most-frequent value mean 0.443.
FLOORS: dict[str, float] = {"species": 0.9, "fur": 0.9, "ears": 0.55, "stripes": 0.5, "eyes": 0.85}
MEAN_FLOOR = 0.75


def failures(q: FacetQuality) -> list[str]:
    out = [f"{attr} accuracy {q.accuracy[attr]:.3f} < {floor}" for attr, floor in FLOORS.items()
           if not q.accuracy[attr] >= floor]
    if not q.mean >= MEAN_FLOOR:
        out.append(f"mean accuracy {q.mean:.3f} < {MEAN_FLOOR}")
    return out


@pytest.fixture(scope="module")
def faces() -> tuple[Any, Any]:
    return eval_set(DOCS)


def measure(demo_models: dict[str, Path], faces: tuple[Any, Any]) -> FacetQuality:
    return facet_quality(str(demo_models["reranker"]), *faces)


def test_trained_reranker_clears_the_facet_floors(demo_models: dict[str, Path],
                                                  faces: tuple[Any, Any], guarded: Any) -> None:
    q = measure(demo_models, faces)
    guarded(mean=q.mean, **q.accuracy)
    assert q.vision_encodes == 0
    assert failures(q) == [], (q.accuracy, q.chance)


def _patched(monkeypatch: pytest.MonkeyPatch, bug: str) -> None:
    real = facet_jobs.judge_values

    def buggy(reranker: Any, images: Sequence[Any], groups: Sequence[Sequence[str]], **kw: Any) -> Any:
        judged = real(reranker, images, groups, **kw)
        if bug == "swapped":  # each attribute's probabilities assigned to its values in reverse order
            return [[list(reversed(probs)) for probs in per_image] for per_image in judged]
        return judged[1:] + judged[:1]  # each reference given the next one's probabilities

    monkeypatch.setattr(facet_jobs, "judge_values", buggy)


@pytest.mark.parametrize("bug", ["swapped", "wrong_reference"])
def test_injected_bugs_fail_the_floors(bug: str, demo_models: dict[str, Path],
                                       faces: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch,
                                       guarded: Any) -> None:
    _patched(monkeypatch, bug)
    q = measure(demo_models, faces)
    guarded(bug_mean=q.mean, **{f"bug_{attr}": v for attr, v in q.accuracy.items()})
    assert failures(q), (bug, q.accuracy)
