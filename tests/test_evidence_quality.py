"""Evidence floors of the trained demo reranker on held-out faces (``bench/evidence_quality.py`` measures the same
on more faces, beside a random map and random weights), and proof that they catch real bugs: the grid transposed,
and each face given the map of another face. Each bug is patched into the computation and must fail the floors."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import rubricsearch.app.demo.evidence_eval as evidence_eval
import rubricsearch.rerank.evidence as evidence
from rubricsearch.app.demo.evidence_eval import Row, measure_evidence
from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.task import TaskReranker

pytestmark = pytest.mark.slow

FACES = 12
# Below what the default method measured on 60 held-out faces (docs/performance.md, "Per-criterion evidence").
POINTING_FLOOR = 0.7
MASS_OVER_AREA_FLOOR = 1.5  # the map's mass on the region at least 1.5 times the region's share of the image
AGREES_FLOOR = 0.7  # the faces' own judgements (stripes the weakest: 0.75 on these faces, 0.87 on 60)


@pytest.fixture(scope="module")
def runtime(demo_models: dict[str, Path]) -> Iterator[LocalScoringRuntime]:
    reranker = load_reranker(demo_models["reranker"], device="cpu", dtype="float32", fused_kernels=False)
    assert isinstance(reranker, TaskReranker) and isinstance(reranker.runtime, LocalScoringRuntime)
    yield reranker.runtime
    reranker.close()


def failures(rows: list[Row]) -> list[str]:
    out = []
    for r in rows:
        if not r.pointing >= POINTING_FLOOR:
            out.append(f"{r.attribute}: pointing game {r.pointing:.3f} < {POINTING_FLOOR}")
        if not r.mass >= MASS_OVER_AREA_FLOOR * r.area:
            out.append(f"{r.attribute}: mass on the region {r.mass:.3f} < {MASS_OVER_AREA_FLOOR} x area {r.area:.3f}")
        if not r.agrees >= AGREES_FLOOR:
            out.append(f"{r.attribute}: {r.agrees:.3f} of the maps explain a judgement that agrees with the truth")
    return out


def test_trained_reranker_points_at_the_drawn_attribute(runtime: LocalScoringRuntime, guarded: Any) -> None:
    rows = measure_evidence(runtime, "trained", evidence.DEFAULT_METHOD, 128, FACES)
    guarded(**{f"{r.attribute}_pointing": r.pointing for r in rows}, **{f"{r.attribute}_mass": r.mass for r in rows})
    assert failures(rows) == [], rows


def _transposed(monkeypatch: pytest.MonkeyPatch) -> None:
    real = evidence.image_map

    def buggy(sha256: str, role: Any, pkg: Any, values: torch.Tensor, size: Any) -> Any:
        found = real(sha256, role, pkg, values, size)
        return evidence.ImageEvidence(sha256=found.sha256, role=found.role, size=found.size, grid=found.grid,
                                      boxes=found.boxes, values=[list(col) for col in zip(*found.values, strict=True)])

    monkeypatch.setattr(evidence, "image_map", buggy)


def _other_reference(monkeypatch: pytest.MonkeyPatch) -> None:
    real = evidence_eval.explain
    seen: list[Any] = []

    def buggy(runtime: Any, criterion: str, document: Any, sizes: Any, **kw: Any) -> Any:
        seen.append((document, sizes))  # each face gets the map of the face explained before it
        other, other_sizes = seen[-2] if len(seen) > 1 else seen[-1]
        return real(runtime, criterion, other, other_sizes, **kw)

    monkeypatch.setattr(evidence_eval, "explain", buggy)


@pytest.mark.parametrize("bug", ["transposed", "other reference"])
def test_the_floors_catch_a_broken_map(runtime: LocalScoringRuntime, monkeypatch: pytest.MonkeyPatch,
                                       bug: str) -> None:
    (_transposed if bug == "transposed" else _other_reference)(monkeypatch)
    rows = measure_evidence(runtime, "buggy", evidence.DEFAULT_METHOD, 128, FACES)
    assert failures(rows) != [], rows
