"""The demo data's promises: splits never share an image, queries' ground truth is right, the metrics are."""

from __future__ import annotations

import random
from pathlib import Path

import pytest

from rubricsearch.app.demo.evaluation import eval_queries, recall_at, score
from rubricsearch.app.demo.faces import ATTRIBUTES, Criterion, Face, draw_face, faces, png_bytes
from rubricsearch.app.demo.rubrics import KINDS, Query, sample_query


def test_splits_are_deterministic_and_share_no_image() -> None:
    by_split = {s: faces(s, 24, seed=1) for s in ("train", "eval", "demo")}
    assert by_split["train"] == faces("train", 24, seed=1)
    images = {s: {png_bytes(draw_face(f, seed=1)) for f in fs} for s, fs in by_split.items()}
    assert all(len(v) == 24 for v in images.values())  # no two faces of a split draw the same
    assert not images["train"] & images["eval"] and not images["train"] & images["demo"]
    assert not images["eval"] & images["demo"]
    # the same attributes in two splits are still different pictures (nuisance differs)
    a, b = Face("cat", "grey", "round", True, "blue", 1, "train"), Face("cat", "grey", "round", True, "blue", 1, "eval")
    assert a.key == b.key and png_bytes(draw_face(a)) != png_bytes(draw_face(b))


def test_a_full_pass_covers_every_attribute_value() -> None:
    grid = faces("eval", 120)
    assert len({f.key for f in grid}) == 120
    for attribute in ATTRIBUTES:
        assert len({f.value(attribute) for f in grid}) >= 2


def test_criteria_text_and_truth() -> None:
    fox = Face("fox", "ginger", "triangle", False, "amber", 1)
    assert Criterion("ears", "triangle").text == "triangular ears" and Criterion("ears", "triangle").holds(fox)
    assert Criterion("fur", "ginger", negated=True).text == "no ginger fur"
    assert not Criterion("fur", "ginger", negated=True).holds(fox)
    assert Criterion("stripes", "plain").text == "no forehead stripes" and Criterion("stripes", "plain").holds(fox)
    assert Criterion("stripes", "stripes", negated=True).holds(fox)
    assert Criterion("species", "cat", negated=True).text == "not a cat"


def test_sampled_queries_match_their_kind() -> None:
    rng = random.Random(0)
    pool = faces("candidate", 120, seed=2)
    for kind in KINDS:
        for _ in range(30):
            q = sample_query(rng, kind, pool)
            assert q.kind == kind
            if kind == "negative":
                assert any(c.negative for c in q.criteria)
            if kind == "criteria":
                assert q.criteria and not any(c.negative for c in q.criteria) and q.candidate is None
            if kind == "candidate":
                assert q.candidate is not None and not q.criteria and q.relevant(q.candidate)
            if kind == "candidate+criteria":  # a candidate's criteria describe the candidate
                assert q.candidate is not None and all(c.holds(q.candidate) for c in q.criteria)


def test_queries_are_seeded_and_single_criteria_cover_every_value() -> None:
    from rubricsearch.app.demo.search_eval import rubric_queries, single_criterion_queries

    assert eval_queries(3) == eval_queries(3) and rubric_queries(4) == rubric_queries(4)
    single = single_criterion_queries()
    assert len(single) == 14 and len({q.texts[0] for q in single}) == 14
    assert all(2 <= len(q.criteria) <= 3 for q in rubric_queries(8))


def test_metrics() -> None:
    assert recall_at([3, 1, 2], {1}, 1) == 0.0 and recall_at([3, 1, 2], {1}, 5) == 1.0
    assert recall_at([0, 1, 2, 3, 4, 5], {0, 1, 5, 6, 7, 8, 9}, 5) == pytest.approx(2 / 5)
    docs = [Face("cat", "grey", "round", True, "blue", i, "eval") for i in range(2)]
    docs[1] = Face("fox", "grey", "round", True, "blue", 1, "eval")
    q = Query("criteria", (Criterion("species", "fox"),))
    perfect, wrong = score([q], docs, [[1, 0]])[0], score([q], docs, [[0, 1]])[0]
    assert (perfect.r1, perfect.ndcg10) == (1.0, 1.0) and wrong.r1 == 0.0 and wrong.ndcg10 < 1.0


def test_hub_check_is_offline_and_fast(tmp_path: Path) -> None:
    """Whether a model can load without the hub is answered from the file system (no network request)."""
    from rubricsearch.app.model_loading import hub_model_available

    assert not hub_model_available("Qwen/Not-Downloaded-Embedding")
    assert not hub_model_available("not a repo id!")
    assert not hub_model_available(str(tmp_path))  # a directory without a checkpoint
    (tmp_path / "config.json").write_text("{}")
    assert hub_model_available(str(tmp_path))


def test_hub_probe_answers_in_seconds(monkeypatch: pytest.MonkeyPatch) -> None:
    """``hub_reachable``: false with HF_HUB_OFFLINE, else a TCP connect to HF_ENDPOINT (here 127.0.0.1 only)."""
    import socket
    import time

    from rubricsearch.app.model_loading import hub_reachable

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        port = listener.getsockname()[1]
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{port}")
        assert hub_reachable()
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
        assert not hub_reachable()  # offline mode asks nothing
    monkeypatch.delenv("HF_HUB_OFFLINE")
    started = time.monotonic()
    assert not hub_reachable()  # the listener is gone: refused at once
    assert time.monotonic() - started < 5
