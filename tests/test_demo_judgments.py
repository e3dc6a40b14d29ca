"""The demo set ships its judgments and calibration the way any team's set gets them (issue 47): its faces' true
attributes as metadata, judgments derived from them by the product's derivation, the calibration fitted by the
product's refit; a restart changes nothing, and a judgment recorded since is refitted on at the next start.

Tiny random-weight checkpoints: what is checked is the path, not the fit's quality (tests/test_demo_verdicts.py
measures that with the trained demo models).
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path

import pytest

from rubricsearch.app.calibration import current
from rubricsearch.app.demo.cli import calibrate_demo_set, ensure_demo_set
from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion, demo_faces
from rubricsearch.app.demo.judgments import AUTHOR, demo_metadata, ensure_judgments
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import JudgmentSource, JudgmentSpec, find_images, list_judgments, record_judgment
from tests.api_helpers import api_settings

FACES = 10


@pytest.fixture(scope="module")
def demo_state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path
               ) -> Iterator[tuple[AppState, str]]:
    state = AppState.preparing(api_settings(tmp_path_factory.mktemp("demo-judgments"), tiny_embedding_dir,
                                            tiny_reranker_dir, ingest={"workers": 0}))
    try:
        state.load()
        set_id = ensure_demo_set(state, FACES, out=io.StringIO())
        out = io.StringIO()
        calibrate_demo_set(state, set_id, FACES, out=out)
        assert "calibration v1 fitted" in out.getvalue(), out.getvalue()
        yield state, set_id
    finally:
        state.close()


def test_every_face_is_judged_on_every_statement_by_its_true_attributes(demo_state: tuple[AppState, str]) -> None:
    state, set_id = demo_state
    truth = demo_metadata(FACES)
    with state.catalog.read() as session:
        images = find_images(session, set_id, list(truth))
        judgments = list_judgments(session, set_id)
    assert len(images) == FACES and all(images[sha].meta == truth[sha] for sha in truth)
    faces = {sha: face for sha, face in zip(truth, demo_faces(FACES), strict=True)}
    by_id = {image.id: faces[sha] for sha, image in images.items()}
    statements = {Criterion(a, v).text: Criterion(a, v) for a in ATTRIBUTES for v in VALUES[a]
                  if any(face.value(a) == v for face in faces.values())}
    assert {"dark forehead stripes", "no forehead stripes", "a fox", "triangular ears"} <= set(statements)
    assert len(judgments) == FACES * len(statements)
    assert {(j.image_id, j.criterion) for j in judgments} == {(i, s) for i in by_id for s in statements}
    for j in judgments:
        assert j.holds == statements[j.criterion].holds(by_id[j.image_id]), j
        assert j.source is JudgmentSource.DERIVED and j.author == AUTHOR
    found = current(state.catalog, set_id)
    assert found is not None and found[0].judgments == len(judgments) and not found[1].stale
    # candidate-only searches: every face searched as the candidate, each other face one pair, the twins (every
    # subject is drawn twice) the same subject
    pairs = found[0].candidate
    assert pairs is not None and pairs.judgments == FACES * (FACES - 1)
    assert pairs.per_criterion[0].yes == FACES and pairs.per_criterion[0].no == FACES * (FACES - 2)


def test_a_restart_changes_nothing_and_a_new_judgment_is_fitted_on(demo_state: tuple[AppState, str]) -> None:
    state, set_id = demo_state
    found = current(state.catalog, set_id)
    assert found is not None
    again = ensure_judgments(state, set_id, FACES)
    assert (again.recorded, again.refitted, again.calibration_version) == (0, False, found[0].version)
    with state.catalog.write() as session:
        image_id = list_judgments(session, set_id)[0].image_id
        record_judgment(session, set_id, JudgmentSpec(image_id, "a whisker", True, JudgmentSource.API, "a person"))
    later = ensure_judgments(state, set_id, FACES)
    assert later.refitted and later.calibration_version == found[0].version + 1
    refitted = current(state.catalog, set_id)
    assert refitted is not None and refitted[0].judgments == found[0].judgments + 1 and not refitted[1].stale
