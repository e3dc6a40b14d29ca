"""Issue 50 item 2 and issue 47 item 3: the verdicts the Compare page shows on the 40-face demo set, with the trained
demo models, the set prepared as ``rubricsearch demo`` prepares it (judgments from the faces' attributes, the
calibration refitted) and searched through the API (``app/demo/set_quality.py``; ``bench/demo_set_quality.py``
prints the same table, docs/demo.md has the numbers).

The floors sit below what every training of the default plan reached, over plan seeds that stand for other
processors (docs/demo.md, "The demo set's verdicts" and "Across seeds and processors"): the demo models differ by
processor, so a promise about single faces is guarded at the spread's worst, not at one run's. A pooled band
without per-criterion thresholds lets more striped faces pass "no dark forehead stripes" than that: the test of
the promise is run against it too.
"""

from __future__ import annotations

import base64
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.demo.faces import CANDIDATES, candidate_images, demo_faces, demo_images
from rubricsearch.app.demo.set_quality import (
    NO_DARK_STRIPES,
    SetQuality,
    measure_set,
    non_faces,
    prepared_state,
)
from rubricsearch.app.main import create_app
from rubricsearch.rerank.calibration import Calibration, verdicts
from rubricsearch.retrieval.images import sha256_hex

pytestmark = pytest.mark.slow

# pooled over every (criterion, face) cell: the shown band (fitted on every judgment) 0.981 / 0.980 at 9.1 %
# uncertain, held out (five folds of faces) 0.964 / 0.960 at 9.9 % (2026-12-06, the default plan's models)
FLOORS = {"match_precision": 0.9, "no_match_precision": 0.9}
MAX_UNCERTAIN = 0.2
# Faces of the 40 that pass an absence they show. Seeds 0-2 (docs/demo.md): striped faces passing either stripe
# absence 1, 1, 0 (with one pooled band: 4, 8, 5); foxes passing "not a fox" 0, 0, 0.
STRIPE_ABSENCES = ("no forehead stripes", NO_DARK_STRIPES)
MAX_STRIPED_PASSING = 2
MAX_FOXES_PASSING = 1
# A candidate's two attribute twins searched alone, the worse one's rank: at most 3, 5 and 4 on seeds 0-2.
TWINS_WITHIN = 6


@pytest.fixture(scope="module")
def demo_set(demo_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> Iterator[tuple[Any, str]]:
    state, set_id = prepared_state(demo_models["embedding"], demo_models["reranker"],
                                   tmp_path_factory.mktemp("demo-set") / "data")
    try:
        yield state, set_id
    finally:
        state.close()


@pytest.fixture(scope="module")
def measured(demo_set: tuple[Any, str]) -> SetQuality:
    return measure_set(*demo_set)


def failures(q: SetQuality) -> list[str]:
    out = []
    for name, band in (("shown", q.shown), ("held out", q.held_out)):
        for field, floor in FLOORS.items():
            value = getattr(band, field)
            if value is None or value < floor:
                out.append(f"{name} {field} {value} < {floor}")
        if band.share_uncertain > MAX_UNCERTAIN:
            out.append(f"{name} share uncertain {band.share_uncertain:.3f} > {MAX_UNCERTAIN}")
    return out


def wrong_matches(q: SetQuality, criterion: str) -> list[str]:
    return next(r.wrong_matches for r in q.rows if r.criterion == criterion)


def test_the_demo_sets_verdicts_hold_their_precision(measured: SetQuality, guarded: Any) -> None:
    guarded(demo_set_match_precision=measured.shown.match_precision,
            demo_set_no_match_precision=measured.shown.no_match_precision,
            demo_set_uncertain=measured.shown.share_uncertain,
            demo_set_held_out_match_precision=measured.held_out.match_precision,
            demo_set_held_out_no_match_precision=measured.held_out.no_match_precision,
            demo_set_held_out_uncertain=measured.held_out.share_uncertain)
    assert measured.shown.judgments == 40 * len(measured.rows)
    assert failures(measured) == [], measured


def striped_passing(q: SetQuality) -> list[str]:
    return [face for criterion in STRIPE_ABSENCES for face in wrong_matches(q, criterion)]


def test_striped_faces_rarely_pass_no_stripes_and_foxes_not_a_fox(measured: SetQuality, guarded: Any) -> None:
    striped, foxes = striped_passing(measured), wrong_matches(measured, "not a fox")
    guarded(demo_set_striped_passing_no_stripes=len(striped), demo_set_foxes_passing_not_a_fox=len(foxes))
    assert len(striped) <= MAX_STRIPED_PASSING and len(foxes) <= MAX_FOXES_PASSING, (striped, foxes)


def test_a_pooled_band_lets_striped_faces_pass(demo_set: tuple[Any, str], monkeypatch: pytest.MonkeyPatch,
                                              guarded: Any) -> None:
    """Every criterion at the pooled thresholds (no band of its own, "no X" not mirrored from X): the promise
    above fails, so it measures the per-criterion bands."""

    def pooled(self: Calibration, raw: Any, criteria: Any, negated: Any) -> Any:
        assert self.mapping is not None
        p = self.mapping.apply(raw)
        return p, verdicts(p, self.match_at, self.no_match_at)

    monkeypatch.setattr(Calibration, "cells", pooled)
    passed = striped_passing(measure_set(*demo_set))
    guarded(demo_set_striped_passing_pooled_band=len(passed))
    assert len(passed) > MAX_STRIPED_PASSING, passed


def _search(client: TestClient, set_id: str, image: dict[str, str] | str) -> dict[str, Any]:
    r = client.post("/v1/search", json={"set_id": set_id, "image": image, "top_k": 40, "top_n": 40})
    assert r.status_code == 200, r.text
    return dict(r.json())


def test_candidate_only_searches_get_verdicts_that_tell_a_blue_square_from_a_face(demo_set: tuple[Any, str]) -> None:
    """Through the API: a blue square, pixel noise, a photo-like and a white image alone are no match with every
    reference (pixel noise, nearer some faces than any two faces are to each other, only under the cohort-normalised
    score: docs/demo.md); a reference searched as the candidate is its own first hit and a match (by rule); each
    candidate's attribute twins rank within its first TWINS_WITHIN hits."""
    state, set_id = demo_set
    with TestClient(create_app(state.settings, state=state)) as client:
        for name, data in non_faces():
            alone = _search(client, set_id, "data:image/png;base64," + base64.b64encode(data).decode())
            use = alone["provenance"]["calibration"]
            assert use["applied"] and (use["fitted_to"], use["reads"]) == ("same_subject", "cohort_z"), (name, use)
            assert len(alone["hits"]) == 40 and {h["verdict"] for h in alone["hits"]} == {"no_match"}, name
        reference = sha256_hex(demo_images(40)[0][1])
        itself = _search(client, set_id, {"image_id": reference})
        assert itself["hits"][0]["image"]["sha256"] == reference and itself["hits"][0]["verdict"] == "match"
        keys = {sha256_hex(data): face.key for face, (_, data) in zip(demo_faces(40), demo_images(40), strict=True)}
        for face, (_, data) in zip(CANDIDATES, candidate_images(), strict=True):
            hits = _search(client, set_id, "data:image/png;base64," + base64.b64encode(data).decode())["hits"]
            ranks = [h["rank"] for h in hits if keys[h["image"]["sha256"]] == face.key]
            assert len(ranks) == 2 and max(ranks) <= TWINS_WITHIN, (face, ranks)
        # the quality report says how candidate-only searches do on the set's same-subject pairs
        fitted = client.get(f"/v1/sets/{set_id}/calibration").json()["candidate"]
        reported = client.get(f"/v1/sets/{set_id}/quality").json()["same_subject"]
        assert reported["status"] == "calibrated" and reported["held_out"] == fitted["held_out"]["band"]
        assert reported["pairs"] == fitted["judgments"] > 0 and reported["same"] > 0 and reported["different"] > 0
