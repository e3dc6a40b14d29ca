"""Embedder versions through the training job API, on tiny random-weight checkpoints: a job with ``model:
embedder`` registers a version; activation is guarded side by side on held-out judgments (the criteria it
trained on and the set's other criteria); a refused activation changes nothing (vectors, catalog, provenance);
an accepted one re-embeds the set from packages and switches the query embedder with it; rollback restores both.
"""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from sqlalchemy import update

from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import JudgmentSpec, record_judgments, resolve_set
from rubricsearch.indexer.catalog.tables import Judgment, JudgmentSource
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.tuning.judgments import reference
from rubricsearch.retrieval.tuning.loop import TowerCalls
from tests.api_helpers import ADMIN_KEY, bearer, one_state, wait_job
from tests.test_training_jobs import make_set, picture, wait_training

pytestmark = pytest.mark.timeout(600)
ADMIN = bearer(ADMIN_KEY)
SET = "embedded"
TRAINED, OTHER = "a red picture", "a blue picture"
SMALL = {"model": "embedder", "steps": 60, "batch": 8, "lr": 0.005, "seed": 1}

state, client = one_state("embedder-jobs")


def set_id(state: AppState) -> str:
    with state.catalog.read() as session:
        return resolve_set(session, SET).id


def judge(state: AppState, red: dict[int, bool], criterion: str, holds: bool) -> None:
    """``holds``: whether the criterion holds for the red pictures."""
    with state.catalog.write() as session:
        record_judgments(session, set_id(state), [JudgmentSpec(i, criterion, is_red == holds, JudgmentSource.API)
                                                  for i, is_red in red.items()])


def search(client: TestClient) -> dict[str, Any]:
    r = client.post("/v1/search", json={"set_id": SET, "criteria": [TRAINED], "top_k": 40, "top_n": 40,
                                        "rerank": False})
    assert r.status_code == 200, r.text
    return r.json()


def train(client: TestClient) -> dict[str, Any]:
    r = client.post(f"/v1/sets/{SET}/training-jobs", json=SMALL, headers=ADMIN)
    assert r.status_code == 202, r.text
    job = wait_training(client, SET, r.json()["id"])
    assert job["state"] == "succeeded" and job["model"] == "embedder", job
    return job


def vectors(state: AppState) -> dict[str, np.ndarray]:
    sid = set_id(state)
    with state.catalog.read() as session:
        from rubricsearch.indexer.catalog import list_images

        shas = [img.sha256 for img in list_images(session, sid, limit=100).items]
    return state.index.vectors(sid, shas)


@pytest.fixture(scope="module")
def versions(client: TestClient, state: AppState) -> dict[str, Any]:
    """A version trained on flipped labels of one criterion (corrected in place afterwards, same judgment ids),
    then judgments of another criterion (never trained on by the first version: its other criteria), then a
    version trained on the truth of both with the same seed (so the same held-out references)."""
    red = make_set(client, SET, 24)
    judge(state, red, TRAINED, holds=False)
    flipped = train(client)
    with state.catalog.write() as session:
        session.execute(update(Judgment).values(holds=~Judgment.holds))
    judge(state, red, OTHER, holds=False)
    truth = train(client)
    return {"flipped": flipped, "truth": truth, "red": red}


def test_a_job_trains_an_embedder_version(client: TestClient, versions: dict[str, Any]) -> None:
    job = versions["truth"]
    assert job["progress"]["vision_encodes"] == 0 and job["progress"]["validation_ndcg"] is not None
    assert job["progress"]["validation_log_loss"] is None
    listed = client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()
    assert (listed["active"], listed["active_embedder"]) == ("base", "base")
    assert [v["model"] for v in listed["data"]] == ["embedder", "embedder"]
    card = listed["data"][1]["card"]
    assert card["kind"] == "embedder" and card["data"]["validation_judgment_ids"] and card["vision_encodes"] == 0
    # the settings it trained with: the embedder's pull, not the reranker's preserve (which it does not read)
    assert "preserve" not in job["settings"] and "preserve" not in card["settings"] and card["settings"]["pull"] > 0


def test_activation_is_guarded_and_switches_vectors_and_queries_together_and_rollback_restores(
        client: TestClient, state: AppState, versions: dict[str, Any]) -> None:
    flipped, truth = (versions[k]["progress"]["version_id"] for k in ("flipped", "truth"))
    base_vectors, base_search = vectors(state), search(client)
    assert base_search["provenance"]["embedder_version"] == "base"

    refused = client.post(f"/v1/sets/{SET}/versions/{flipped}/activate", headers=ADMIN)
    assert refused.status_code == 409, refused.text
    table = refused.json()["error"]["details"]["comparison"]
    assert table["active"] == "base" and not table["passed"] and table["vision_encodes"] == 0
    rows = {row["metric"]: row for row in table["metrics"]}
    assert rows["ndcg@10"]["candidate_is"] != "better"  # the base ranks the flipped truth's way already
    assert rows["ndcg@10 other criteria"]["active"] is not None, "the other criterion is measured too"
    # nothing changed: the vectors, the catalog, what searches embed with
    now = vectors(state)
    assert all(np.array_equal(now[s], base_vectors[s]) for s in base_vectors)
    assert client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()["active_embedder"] == "base"
    again = search(client)
    assert again["provenance"]["embedder_version"] == "base" and again["hits"] == base_search["hits"]

    passed = client.post(f"/v1/sets/{SET}/versions/{truth}/activate", headers=ADMIN)
    assert passed.status_code == 200, passed.text
    body = passed.json()
    assert body["active"] == truth and body["comparison"]["passed"]
    assert body["calibration"].startswith("unchanged")
    rows = {row["metric"]: row for row in body["comparison"]["metrics"]}
    assert "worse" not in {r["candidate_is"] for r in rows.values()} and rows["ndcg@10"]["candidate_is"] == "better"
    listed = client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()
    assert (listed["active"], listed["active_embedder"]) == ("base", truth)
    # every vector is the version's, made from packages; queries are embedded by the version
    version = state.embedders.load(next(v for v in _records(state) if v.id == truth))
    switched = vectors(state)
    shas = sorted(switched)
    usage = Usage()
    expected = version.embed_contents([Content(images=[reference(s)]) for s in shas], [None] * len(shas),
                                      dimensions=state.index.dim(set_id(state)), usage=usage)
    assert usage.total() == 0
    for i, sha in enumerate(shas):
        np.testing.assert_allclose(switched[sha], expected[i], atol=1e-5)
    assert max(float(np.abs(switched[s] - base_vectors[s]).max()) for s in shas) > 1e-5
    tuned = search(client)
    assert tuned["provenance"]["embedder_version"] == truth
    assert [h["ann_score"] for h in tuned["hits"]] != [h["ann_score"] for h in base_search["hits"]]
    # against the active version, the flipped one ranks worse: refused, and nothing changes
    again = client.post(f"/v1/sets/{SET}/versions/{flipped}/activate", headers=ADMIN)
    assert again.status_code == 409, again.text
    table = again.json()["error"]["details"]["comparison"]
    assert table["active"] == truth and {r["metric"]: r for r in table["metrics"]}["ndcg@10"]["candidate_is"] == "worse"
    assert all(np.array_equal(v, switched[s]) for s, v in vectors(state).items())
    assert search(client)["provenance"]["embedder_version"] == truth

    back = client.post(f"/v1/sets/{SET}/versions/rollback", params={"model": "embedder"}, headers=ADMIN)
    assert back.status_code == 200, back.text
    assert back.json()["active"] == "base"
    restored = vectors(state)
    for sha in shas:
        np.testing.assert_allclose(restored[sha], base_vectors[sha], atol=1e-5)
    after = search(client)
    assert after["provenance"]["embedder_version"] == "base"
    assert [h["image"]["sha256"] for h in after["hits"]] == [h["image"]["sha256"] for h in base_search["hits"]]
    assert client.post(f"/v1/sets/{SET}/versions/rollback", params={"model": "embedder"},
                       headers=ADMIN).status_code == 409


def test_references_ingested_under_an_active_embedder_get_its_vectors(client: TestClient, state: AppState,
                                                                       versions: dict[str, Any]) -> None:
    """A reference ingested while a version is the set's embedder is embedded by that version, from the package
    ingestion built (the version's tower never runs), so the set's vectors stay in one space, and so is a vector
    the reconcile restores; rollback re-embeds it with the base. A copy whose ingestion (or reconcile) embeds with
    the base fails."""
    truth = versions["truth"]["progress"]["version_id"]
    assert client.post(f"/v1/sets/{SET}/versions/{truth}/activate", headers=ADMIN).status_code == 200
    version = state.embedders.load(next(v for v in _records(state) if v.id == truth))
    towers = [TowerCalls(m.runtime.loaded.model.visual) for m in (state.embedder, version)]  # type: ignore[attr-defined]
    new = picture(True, 9_999)
    job = client.post(f"/v1/sets/{SET}/images", headers=ADMIN,
                      files=[("files", ("late.png", new, "image/png"))]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    encodes = [t.calls for t in towers]
    for t in towers:
        t.close()
    assert encodes == [1, 0], "one encode: the package ingestion builds with the base's tower, none by the version"
    sha, dim = hashlib.sha256(new).hexdigest(), state.index.dim(set_id(state))
    stored = state.index.vectors(set_id(state), [sha])[sha]
    usage = Usage()
    mine, base = (m.embed_contents([Content(images=[reference(sha)])], [None], dimensions=dim, usage=usage)[0]
                  for m in (version, state.embedder))
    assert usage.total() == 0
    np.testing.assert_allclose(stored, mine, atol=1e-5)
    assert float(np.abs(stored - base).max()) > 1e-5, "not the base's vector"
    # the reconcile of a vector the index lost (a crash between the catalog and the index) embeds with it too
    state.index.delete(set_id(state), [sha])
    assert state.ingestion.reconcile(set_id(state)).reembedded == 1
    np.testing.assert_allclose(state.index.vectors(set_id(state), [sha])[sha], mine, atol=1e-5)

    back = client.post(f"/v1/sets/{SET}/versions/rollback", params={"model": "embedder"}, headers=ADMIN)
    assert back.status_code == 200, back.text
    np.testing.assert_allclose(state.index.vectors(set_id(state), [sha])[sha], base, atol=1e-5)


def test_references_indexed_during_an_activation_get_the_new_embedders_vectors(
        client: TestClient, state: AppState, versions: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    """The two races of an activation with ingestion: a reference indexed while the set's vectors are staged gets
    the version's vector in the switch (a copy that switched only the staged references fails), and a batch
    embedded by the base that commits after the activation is embedded again (a copy without the commit's check
    fails)."""
    from rubricsearch.app.model_versions import activate_version
    from rubricsearch.indexer.jobs import reembed
    from rubricsearch.indexer.jobs.pipeline import BatchProcessor

    truth = versions["truth"]["progress"]["version_id"]
    record = next(v for v in _records(state) if v.id == truth)
    with state.catalog.read() as session:
        target = resolve_set(session, SET)

    def ingest(seed: int) -> str:
        data = picture(False, seed)
        job = client.post(f"/v1/sets/{SET}/images", headers=ADMIN,
                          files=[("files", (f"race{seed}.png", data, "image/png"))]).json()
        assert wait_job(client, job["id"])["state"] == "succeeded"
        return hashlib.sha256(data).hexdigest()

    def check(sha: str) -> None:
        usage = Usage()
        expected = state.embedders.load(record).embed_contents([Content(images=[reference(sha)])], [None],
                                                               dimensions=state.index.dim(target.id), usage=usage)
        np.testing.assert_allclose(state.index.vectors(target.id, [sha])[sha], expected[0], atol=1e-5)
        assert usage.total() == 0
        assert client.post(f"/v1/sets/{SET}/versions/rollback", params={"model": "embedder"},
                           headers=ADMIN).status_code == 200

    staged: list[str] = []
    require = reembed._require_packages

    def ingest_while_staging(embedder: Any, shas: list[str], set_id: str) -> None:
        require(embedder, shas, set_id)
        if not staged:  # the first check is before staging: a reference is indexed meanwhile
            staged.append(ingest(8_001))

    monkeypatch.setattr(reembed, "_require_packages", ingest_while_staging)
    activate_version(state, target, truth)
    monkeypatch.undo()
    check(staged[0])

    committing: list[bool] = []
    commit = BatchProcessor._commit

    def activate_first(self: BatchProcessor, units: list[Any]) -> Any:
        if not committing:  # the batch was embedded by the base; the version becomes active before it commits
            committing.append(True)
            activate_version(state, target, truth)
        return commit(self, units)

    monkeypatch.setattr(BatchProcessor, "_commit", activate_first)
    late = ingest(8_002)
    monkeypatch.undo()
    check(late)


def _records(state: AppState) -> list[Any]:
    from rubricsearch.indexer.catalog.versions import list_versions

    with state.catalog.read() as session:
        return list_versions(session, set_id(state), "embedder")


@pytest.mark.parametrize("body", [{"model": "embedder", "rank": 0}, {"model": "tower"}])
def test_bad_input_is_refused_and_records_nothing(client: TestClient, versions: dict[str, Any],
                                                  body: dict[str, Any]) -> None:
    jobs_before = client.get("/v1/jobs", params={"limit": 1000}, headers=ADMIN).json()["data"]
    r = client.post(f"/v1/sets/{SET}/training-jobs", json={**SMALL, **body}, headers=ADMIN)
    assert r.status_code in (400, 422), r.text
    assert client.get("/v1/jobs", params={"limit": 1000}, headers=ADMIN).json()["data"] == jobs_before
