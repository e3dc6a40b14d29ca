"""The learning test's attribute (issue 48): the collar, which the demo models never saw, is drawn in its colour,
and, off by default, leaves every demo face as it was drawn (so the demo models and their training are unchanged)."""

from __future__ import annotations

import hashlib

import numpy as np

from rubricsearch.app.demo.faces import (
    CANDIDATES,
    COLLAR_VALUES,
    COLLARS,
    Split,
    demo_faces,
    draw_face,
    faces,
    with_collars,
)

# What the renderer drew before the collar existed (main ba484c5): the demo set, the Compare page's candidates
# and the first 60 faces of every split the demo models are trained, tuned and evaluated on, at their seeds.
DEFAULT_PLAN_DIGEST = "32b14232a3f047405bddba479ddda09c0aa91ce2a4ef469ab1d41c7f17b1e5bb"


def test_faces_without_a_collar_draw_what_they_drew_before_it() -> None:
    h = hashlib.sha256()
    drawn = [(f, 7) for f in demo_faces()] + [(f, 1234) for f in CANDIDATES]
    splits: tuple[tuple[Split, int], ...] = (("train", 3), ("eval", 11), ("tune", 31), ("candidate", 12))
    for split, seed in splits:
        drawn += [(f, seed) for f in faces(split, 60, seed=seed)]
    for face, seed in drawn:
        assert face.collar is None
        h.update(face.name.encode())
        h.update(draw_face(face, seed=seed).tobytes())
    assert h.hexdigest() == DEFAULT_PLAN_DIGEST


def test_the_collar_is_drawn_in_its_colour_and_shared_evenly() -> None:
    chosen = with_collars(faces("tune", 30, seed=1), seed=1)
    assert sorted(f.collar or "" for f in chosen) == sorted(COLLAR_VALUES * 10)
    assert all(f"-{f.collar}-collar-" in f.name for f in chosen)
    for face in chosen:
        pixels = np.asarray(draw_face(face, seed=1), dtype=np.int32)
        near = {name: int((np.abs(pixels - np.array(rgb)).sum(axis=2) < 60).sum()) for name, rgb in COLLARS.items()}
        for name, count in near.items():  # hundreds of pixels of its colour, none of the other's
            assert (count > 300) == (face.collar == name), (face.name, near)


def test_the_diagnosis_names_the_criterion_a_wrong_top_face_fails() -> None:
    from rubricsearch.app.demo.learning import rubrics
    from rubricsearch.app.demo.learning_diagnosis import rubric_misses

    docs = with_collars(faces("eval", 90, seed=2), seed=2)
    q = rubrics(docs)[0]
    other_c, collar_c = q.criteria
    # both criteria read right (0.9 / 0.1), but one face wearing the collar without the other attribute is
    # given the other criterion at 1.0: it tops the geometric mean, a miss of the other criterion
    wrong = next(i for i, f in enumerate(docs) if collar_c.holds(f) and not other_c.holds(f))
    scores = {c.text: np.array([0.9 if c.holds(f) else 0.1 for f in docs]) for c in q.criteria}
    scores[other_c.text][wrong] = 1.0
    scores[collar_c.text][wrong] = 0.95
    _, report = rubric_misses(docs, scores, [q])
    assert report["causes"] == {"other": 1, "collar": 0, "both": 0}
    assert report["top5"] == {"served": 0.0, "collar truth": 0.0, "other truth": 1.0, "min aggregate": 0.0}
    scores[other_c.text][wrong] = 0.1  # read right again: the top 5 all meet both
    assert rubric_misses(docs, scores, [q])[1]["top5"]["served"] == 1.0
