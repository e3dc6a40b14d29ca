"""Fine-tuning a set's reranker through the admin API, on tiny random-weight checkpoints: a job with progress
registers a version; activation is guarded side by side on held-out judgments (a version trained on flipped
labels is refused, one trained on the truth passes); searches of the set score with the active version and name
it; rollback; cancel, resume, one job per set, and bad input changing nothing.

The attribute is one a random tower still separates: a red or a blue picture.
"""

from __future__ import annotations

import io
import time
from dataclasses import asdict
from datetime import timedelta
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient
from PIL import Image
from sqlalchemy import update

from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import JudgmentSpec, record_judgments, resolve_set
from rubricsearch.indexer.catalog.tables import IngestionJob, Judgment, JudgmentSource, utcnow
from rubricsearch.indexer.catalog.versions import create_training_job, start_training_job
from rubricsearch.retrieval.tuning.settings import DEFAULTS
from tests.api_helpers import ADMIN_KEY, bearer, one_state, wait_job

pytestmark = pytest.mark.timeout(600)
ADMIN = bearer(ADMIN_KEY)
SET = "tuned"
CRITERIA = ("a red picture", "a blue picture")
SMALL = {"steps": 40, "batch": 16, "lr": 0.002, "seed": 1}

state, client = one_state("training-jobs")


def picture(red: bool, seed: int) -> bytes:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 90, size=(48 + 4 * (seed % 3), 48, 3), dtype=np.uint8)
    pixels[..., 0 if red else 2] += 150
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def make_set(client: TestClient, name: str, n: int) -> dict[str, bool]:
    """A set of ``n`` pictures, half red, ingested through the API: red or not by catalog image id."""
    assert client.post("/v1/sets", json={"name": name}, headers=ADMIN).status_code == 201
    images = {f"p{i}.png": picture(i % 2 == 0, 100 * len(name) + i) for i in range(n)}
    job = client.post(f"/v1/sets/{name}/images", headers=ADMIN,
                      files=[("files", (k, v, "image/png")) for k, v in images.items()]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    rows = client.get(f"/v1/sets/{name}/images", params={"limit": 100}, headers=ADMIN).json()["data"]
    return {row["id"]: int(row["original_name"][1:-4]) % 2 == 0 for row in rows}


def judge(state: AppState, name: str, red: dict[int, bool], *, flipped: bool = False) -> None:
    with state.catalog.write() as session:
        set_id = resolve_set(session, name).id
        record_judgments(session, set_id, [
            JudgmentSpec(i, c, (is_red == (c == CRITERIA[0])) != flipped, JudgmentSource.API)
            for i, is_red in red.items() for c in CRITERIA])


def train(client: TestClient, name: str, **body: Any) -> dict[str, Any]:
    r = client.post(f"/v1/sets/{name}/training-jobs", json={**SMALL, **body}, headers=ADMIN)
    assert r.status_code == 202, r.text
    return r.json()


def wait_training(client: TestClient, name: str, job_id: str, until: Any = None) -> dict[str, Any]:
    deadline = time.monotonic() + 300
    while True:
        job: dict[str, Any] = client.get(f"/v1/sets/{name}/training-jobs/{job_id}", headers=ADMIN).json()
        if (until(job) if until is not None else job["state"] not in ("queued", "running")):
            return job
        assert time.monotonic() < deadline, job
        time.sleep(0.05)


def search(client: TestClient, name: str) -> dict[str, Any]:
    r = client.post("/v1/search", json={"set_id": name, "criteria": [CRITERIA[0]], "top_k": 40, "top_n": 40})
    assert r.status_code == 200, r.text
    return r.json()


@pytest.fixture(scope="module")
def red(client: TestClient) -> dict[str, bool]:
    return make_set(client, SET, 32)


@pytest.fixture(scope="module")
def versions(client: TestClient, state: AppState, red: dict[int, bool]) -> dict[str, dict[str, Any]]:
    """A version trained on flipped labels, the labels corrected in place (same judgment ids), then a version
    trained on the truth with the same seed (so the same held-out references)."""
    judge(state, SET, red, flipped=True)
    flipped = wait_training(client, SET, train(client, SET)["id"])
    assert flipped["state"] == "succeeded", flipped
    with state.catalog.write() as session:
        session.execute(update(Judgment).values(holds=~Judgment.holds))
    truth = wait_training(client, SET, train(client, SET)["id"])
    assert truth["state"] == "succeeded", truth
    return {"flipped": flipped, "truth": truth}


def test_a_job_reports_progress_and_registers_a_version(client: TestClient, versions: dict[str, Any]) -> None:
    job = versions["truth"]
    assert 1 <= job["steps_done"] <= job["steps_total"] == SMALL["steps"]
    progress = job["progress"]
    assert progress["vision_encodes"] == 0 and progress["version_id"]
    assert progress["validation_log_loss"] is not None and progress["steps_per_s"] > 0
    assert progress["eta_s"] is not None and progress["metrics"]["after"]["judgments"] > 0
    assert job["settings"]["rank"] == 8 and job["settings"]["seed"] == SMALL["seed"]
    listed = client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()
    assert listed["active"] == "base"
    ids = [v["id"] for v in listed["data"]]
    assert ids == [versions["flipped"]["progress"]["version_id"], progress["version_id"]]
    card = listed["data"][1]["card"]
    assert card["vision_encodes"] == 0 and card["data"]["validation_judgment_ids"]
    assert set(card["data"]["validation_judgment_ids"]) <= set(card["data"]["judgment_ids"])
    assert not any(v["active"] for v in listed["data"]) and listed["data"][1]["model"] == "reranker"
    # the job is one of the set's jobs too (one job system): kind train, steps as its items
    jobs = client.get("/v1/jobs", params={"set_id": SET}, headers=ADMIN).json()["data"]
    listed_job = next(j for j in jobs if j["id"] == job["id"])
    assert listed_job["kind"] == "train" and listed_job["done"] == job["steps_done"]
    assert listed_job["source"] == f"the set's judgments up to id {job['max_judgment_id']}"


class _Scheduled:
    """Stands in for the server's refitter (this app runs no background workers): records what was scheduled."""

    def __init__(self) -> None:
        self.sets: list[str] = []

    def changed(self, set_id: str) -> None:
        self.sets.append(set_id)

    def pending(self, set_id: str) -> bool:
        return False


def test_activation_is_guarded_side_by_side_and_rollback_undoes_it(client: TestClient, state: AppState,
                                                                  versions: dict[str, Any],
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    flipped, truth = (versions[k]["progress"]["version_id"] for k in ("flipped", "truth"))
    scheduled = _Scheduled()
    monkeypatch.setattr(state, "refits", scheduled)
    assert client.post(f"/v1/sets/{SET}/calibration", headers=ADMIN).status_code == 200  # fitted on the base
    base_scores = {h["image"]["sha256"]: h["criteria"][CRITERIA[0]] for h in search(client, SET)["hits"]}
    assert search(client, SET)["provenance"]["reranker_version"] == "base"

    refused = client.post(f"/v1/sets/{SET}/versions/{flipped}/activate", headers=ADMIN)
    assert refused.status_code == 409, refused.text
    table = refused.json()["error"]["details"]["comparison"]
    assert table["active"] == "base" and table["candidate"] == flipped and not table["passed"]
    assert {row["metric"] for row in table["metrics"]} == {"auc", "log_loss", "precision_at_0.5", "ndcg@10"}
    assert any(row["candidate_is"] == "worse" for row in table["metrics"]) and table["vision_encodes"] == 0
    assert client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()["active"] == "base"
    assert scheduled.sets == [], "a refused activation changes nothing, a refit included"

    passed = client.post(f"/v1/sets/{SET}/versions/{truth}/activate", headers=ADMIN)
    assert passed.status_code == 200, passed.text
    body = passed.json()
    assert body["active"] == truth and body["comparison"]["passed"] and body["comparison"]["held_out_judgments"] > 0
    auc = {row["metric"]: row for row in body["comparison"]["metrics"]}["auc"]
    assert auc["candidate"] > auc["active"]
    assert scheduled.sets == [resolve_id(state, SET)], "the new scores need the set's calibration refitted"

    tuned = search(client, SET)
    assert tuned["provenance"]["reranker_version"] == truth
    # the base's calibration does not describe the version's scores: it stops giving verdicts until a refit
    assert f"+{truth}" in tuned["provenance"]["calibration"]["reason"] and not tuned["provenance"]["calibration"][
        "applied"]
    tuned_scores = {h["image"]["sha256"]: h["criteria"][CRITERIA[0]] for h in tuned["hits"]}
    assert max(abs(tuned_scores[k] - base_scores[k]) for k in base_scores) > 1e-3, "the version scores the set"
    # against the active version, the flipped one is refused again, and nothing changes
    again = client.post(f"/v1/sets/{SET}/versions/{flipped}/activate", headers=ADMIN)
    assert again.status_code == 409 and again.json()["error"]["details"]["comparison"]["active"] == truth
    listed = client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()
    assert listed["active"] == truth and [v["active"] for v in listed["data"]] == [False, True]

    back = client.post(f"/v1/sets/{SET}/versions/rollback", headers=ADMIN)
    assert back.status_code == 200 and back.json()["active"] == "base"
    assert scheduled.sets == [resolve_id(state, SET)] * 2
    after = search(client, SET)
    assert after["provenance"]["reranker_version"] == "base"
    assert {h["image"]["sha256"]: h["criteria"][CRITERIA[0]] for h in after["hits"]} == pytest.approx(base_scores)
    assert client.post(f"/v1/sets/{SET}/versions/rollback", headers=ADMIN).status_code == 409  # nothing left


def test_cancel_stops_the_job_and_writes_no_version(client: TestClient, state: AppState,
                                                   versions: dict[str, Any]) -> None:
    before = client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()["data"]
    job = train(client, SET, steps=5000, batch=4)
    # one job per set at a time
    second = client.post(f"/v1/sets/{SET}/training-jobs", json=SMALL, headers=ADMIN)
    assert second.status_code == 409, second.text
    wait_training(client, SET, job["id"], lambda j: j["steps_done"] >= 2)
    assert search(client, SET)["hits"], "searches are answered while the job trains"
    cancelled = client.post(f"/v1/sets/{SET}/training-jobs/{job['id']}/cancel", headers=ADMIN)
    assert cancelled.status_code == 202 and cancelled.json()["cancel_requested"]
    done = wait_training(client, SET, job["id"])
    assert done["state"] == "cancelled" and done["steps_done"] < 5000
    assert client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()["data"] == before
    folder = Path(state.settings.data_dir) / "versions" / resolve_id(state, SET)
    assert sorted(p.name for p in folder.iterdir()) == sorted(v["id"] for v in before), "no half version"
    assert client.post(f"/v1/sets/{SET}/training-jobs/{job['id']}/cancel", headers=ADMIN).status_code == 409


def resolve_id(state: AppState, name: str) -> str:
    with state.catalog.read() as session:
        return resolve_set(session, name).id


def test_a_resumed_job_makes_the_version_an_uninterrupted_run_makes(client: TestClient,
                                                                   versions: dict[str, Any]) -> None:
    settings = {"steps": 8, "batch": 8, "seed": 4}
    whole = wait_training(client, SET, train(client, SET, **settings)["id"])
    assert whole["state"] == "succeeded"
    job = train(client, SET, **settings)
    client.post(f"/v1/sets/{SET}/training-jobs/{job['id']}/cancel", headers=ADMIN)
    assert wait_training(client, SET, job["id"])["state"] == "cancelled"
    resumed = client.post(f"/v1/sets/{SET}/training-jobs/{job['id']}/resume", headers=ADMIN)
    assert resumed.status_code == 202, resumed.text
    finished = wait_training(client, SET, job["id"])
    assert finished["state"] == "succeeded" and finished["max_judgment_id"] == whole["max_judgment_id"]
    assert finished["progress"]["metrics"] == whole["progress"]["metrics"]
    assert finished["progress"]["version_id"] != whole["progress"]["version_id"]
    assert client.post(f"/v1/sets/{SET}/training-jobs/{job['id']}/resume", headers=ADMIN).status_code == 409


def test_a_job_left_running_by_a_stopped_server_resumes_here(client: TestClient, state: AppState,
                                                             versions: dict[str, Any]) -> None:
    """A server that died mid-job leaves it running with a heartbeat that ages; resume runs it in this one."""
    with state.catalog.write() as session:
        job = create_training_job(session, resolve_id(state, SET), 3,
                                  {"model": "reranker", "settings": {**asdict(DEFAULTS["reranker"]), "steps": 3},
                                   "max_judgment_id": versions["truth"]["max_judgment_id"]})
        start_training_job(session, job.id, "a server that stopped")
    assert client.post(f"/v1/sets/{SET}/training-jobs/{job.id}/resume", headers=ADMIN).status_code == 409
    with state.catalog.write() as session:
        session.execute(update(IngestionJob).where(IngestionJob.id == job.id)
                        .values(heartbeat_at=utcnow() - timedelta(minutes=2)))
    assert client.post(f"/v1/sets/{SET}/training-jobs/{job.id}/resume", headers=ADMIN).status_code == 202
    assert wait_training(client, SET, job.id)["state"] == "succeeded"


def test_deleting_the_set_stops_its_job_and_removes_its_versions(client: TestClient, state: AppState) -> None:
    judge(state, "doomed", make_set(client, "doomed", 8))
    done = wait_training(client, "doomed", train(client, "doomed", steps=2)["id"])
    assert done["state"] == "succeeded"
    set_id = resolve_id(state, "doomed")
    folder = Path(state.settings.data_dir) / "versions" / set_id
    assert [p.name for p in folder.iterdir()] == [done["progress"]["version_id"]]
    job = train(client, "doomed", steps=5000, batch=4)
    wait_training(client, "doomed", job["id"], lambda j: j["steps_done"] >= 1)
    assert client.delete("/v1/sets/doomed", headers=ADMIN).status_code == 204
    deadline = time.monotonic() + 60
    while state.training.running(job["id"]):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert not folder.exists(), "the set's versions go with it, and the stopped job wrote none"
    assert client.post("/v1/sets/doomed/training-jobs", json=SMALL, headers=ADMIN).status_code == 404


@pytest.mark.parametrize(("name", "body", "status"), [
    ("unknown-set", {}, 404),
    ("unjudged", {}, 400),
    ("one-class", {}, 400),
    (SET, {"rank": 0}, 400),
    (SET, {"lr": 1.0}, 400),
    (SET, {"steps": 0}, 400),
    (SET, {"batch": "many"}, 422),  # not a number: the request's schema
    (SET, {"epochs": 3}, 422),
])
def test_bad_input_is_refused_and_records_nothing(client: TestClient, state: AppState, red: dict[int, bool],
                                                  name: str, body: dict[str, Any], status: int) -> None:
    for made in ("unjudged", "one-class"):
        if client.get(f"/v1/sets/{made}", headers=ADMIN).status_code == 404:
            ids = make_set(client, made, 4)
            if made == "one-class":
                with state.catalog.write() as session:
                    set_id = resolve_set(session, made).id
                    record_judgments(session, set_id, [JudgmentSpec(i, CRITERIA[0], True, JudgmentSource.API)
                                                       for i in ids])
    jobs_before = client.get("/v1/jobs", params={"limit": 1000}, headers=ADMIN).json()["data"]
    r = client.post(f"/v1/sets/{name}/training-jobs", json={**SMALL, **body}, headers=ADMIN)
    assert r.status_code == status, r.text
    assert client.get("/v1/jobs", params={"limit": 1000}, headers=ADMIN).json()["data"] == jobs_before


def test_a_full_disk_while_saving_fails_the_job_and_keeps_the_active_version(
        client: TestClient, state: AppState, versions: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    from rubricsearch.retrieval.tuning import version

    def full(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    before = client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json()
    monkeypatch.setattr(version, "_write", full)
    job = wait_training(client, SET, train(client, SET, steps=2)["id"])
    assert job["state"] == "failed" and job["error"].startswith("insufficient_storage"), job
    assert client.get(f"/v1/sets/{SET}/versions", headers=ADMIN).json() == before
    folder = Path(state.settings.data_dir) / "versions" / resolve_id(state, SET)
    assert not [p for p in folder.iterdir() if p.name.startswith(".")], "no temporary folder is left"


def test_a_job_trains_under_its_models_serving_configuration(client: TestClient, state: AppState,
                                                            red: dict[int, bool],
                                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """The trainer gets the local runtime configuration the server serves the model with (device, dtype, engine,
    kernels), so a version learns through the passes that will serve it."""
    from rubricsearch.app import training
    from rubricsearch.app.model_loading import model_config
    from rubricsearch.retrieval.errors import InvalidInput

    given: list[Any] = []

    def spy(*args: Any, **kwargs: Any) -> Any:
        given.append(kwargs.get("local"))
        raise InvalidInput("stopped by the test once the trainer's configuration is seen")

    monkeypatch.setattr(training, "fine_tune_reranker", spy)
    job = wait_training(client, SET, train(client, SET, steps=1)["id"])
    assert job["state"] == "failed" and "stopped by the test" in job["error"], job
    assert given == [model_config(state.settings, "reranker", "local").local]


@pytest.mark.parametrize("model", ["reranker", "embedder"])
def test_settings_left_out_take_the_chosen_models_defaults(model: str) -> None:
    from rubricsearch.app.schemas.training import TrainingBody

    assert DEFAULTS["reranker"].steps != DEFAULTS["embedder"].steps  # else this test could not tell them apart
    chosen = TrainingBody.model_validate({"model": model}).settings()
    assert chosen == DEFAULTS[model]  # type: ignore[index]
    given = TrainingBody.model_validate({"model": model, "steps": 7, "lr": 1e-3}).settings()
    assert (given.steps, given.lr) == (7, 1e-3)
