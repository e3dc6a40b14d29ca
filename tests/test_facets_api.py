"""Attribute facets through the REST API on tiny real checkpoints, the real FAISS index and SQLite catalog:
the schema and its bounds, the facet job (from cached packages: the vision towers never run), probabilities
that are the reranker's own judgement of each reference, ``facets.<attr>`` filters inside the vector search,
recomputing only changed attributes, facets for references ingested later, and a set deleted under a job."""

from __future__ import annotations

import io
import time
import zipfile
from collections.abc import Callable
from typing import Any

import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import claim_next_items, list_images, resolve_set
from rubricsearch.indexer.jobs.facets import FacetJobs
from rubricsearch.rerank.facets import distribution, packaged_reference
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import CRITERION_TEXT_ONLY
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content
from tests.api_helpers import ADMIN_KEY, bearer, client_for, tower_states, wait_job
from tests.conftest import TowerCounter, noise_png

pytestmark = pytest.mark.timeout(300)
ADMIN = bearer(ADMIN_KEY)
N = 6
SCHEMA = {"attributes": [
    {"name": "ear_shape", "values": ["upright triangular", "round",
                                     {"value": "folded", "description": "The ears fold forward"}]},
    {"name": "fur_length", "values": ["short", "long"]},
]}


state = tower_states("api-facets")


@pytest.fixture(scope="module")
def client(state: AppState) -> TestClient:
    return client_for(state)


def ingest(client: TestClient, name: str, seeds: range) -> list[str]:
    images = [noise_png(40 + 4 * (s % 5), 48, s) for s in seeds]
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        for s, data in zip(seeds, images, strict=True):
            zf.writestr(f"img/{s}.png", data)
        zf.writestr("manifest.csv", "file,label\n" + "".join(f"img/{s}.png,Cat {s}\n" for s in seeds))
    job = client.post(f"/v1/sets/{name}/images", headers=ADMIN,
                      files=[("files", ("cats.zip", buf.getvalue(), "application/zip"))]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded", job
    return [decode_image(d).sha256 for d in images]


def images_of(state: AppState, name: str) -> dict[str, Any]:
    with state.catalog.read() as s:
        set_id = resolve_set(s, name).id
        return {i.sha256: i for i in list_images(s, set_id, limit=1000).items}


def towers(state: AppState, count_tower: Callable[[Any], TowerCounter]) -> list[TowerCounter]:
    return [count_tower(state.embedder.runtime.vision.loaded.model.visual),  # type: ignore[attr-defined]
            count_tower(state.reranker.runtime.vision.loaded.model.visual)]  # type: ignore[attr-defined]


def search(client: TestClient, name: str, flt: dict[str, Any]) -> dict[str, Any]:
    got = client.post("/v1/search", headers=ADMIN, json={"set_id": name, "rubric": "a cat", "rerank": False,
                                                          "top_k": 50, "top_n": 0, "filter": flt})
    assert got.status_code == 200, got.text
    return dict(got.json())


def test_facets_from_packages_filters_counts_and_recompute(
        client: TestClient, state: AppState, count_tower: Callable[[Any], TowerCounter]) -> None:
    assert client.post("/v1/sets", json={"name": "cats"}, headers=ADMIN).status_code == 201
    shas = ingest(client, "cats", range(300, 300 + N))
    put = client.put("/v1/sets/cats/facets/schema", headers=ADMIN, json=SCHEMA)
    assert put.status_code == 200, put.text
    assert put.json()["version"] == 1 and put.json()["stale"] == N

    counted = towers(state, count_tower)
    encodes = state.reranker.stats["vision_encodes"]
    job = client.post("/v1/sets/cats/facets/jobs", headers=ADMIN)
    assert job.status_code == 202, job.text
    done = wait_job(client, job.json()["id"])
    assert (done["kind"], done["state"], done["done"]) == ("facets", "succeeded", N)
    assert [c.calls for c in counted] == [0, 0]  # the vision towers never ran
    assert state.reranker.stats["vision_encodes"] == encodes and state.facets.usage.total() == 0

    rows = images_of(state, "cats")
    for sha in shas:
        facets = rows[sha].facets
        assert rows[sha].meta == {"label": f"Cat {int(rows[sha].original_name[4:-4])}"}  # user metadata untouched
        assert set(facets) == {"ear_shape", "fur_length", "_schema_version"}
        for attr in ("ear_shape", "fur_length"):
            probs = facets[attr]["probs"]
            assert sum(probs.values()) == pytest.approx(1, abs=1e-4)
            assert facets[attr]["value"] == max(probs, key=probs.__getitem__)
            assert facets[attr]["p"] == probs[facets[attr]["value"]]
    # the stored probabilities are the reranker's judgement of *this* reference's package, value by value
    statements = ["The ear shape is upright triangular", "The ear shape is round", "The ears fold forward"]
    for sha in (shas[0], shas[-1]):
        scores = state.reranker.score_pairs([Pair(Content(texts=[t]), Content(images=[packaged_reference(sha)]),
                                                  CRITERION_TEXT_ONLY.format(criterion=t)) for t in statements])
        want = distribution(scores)
        got = list(rows[sha].facets["ear_shape"]["probs"].values())
        assert got == pytest.approx(want, abs=1e-4)

    listed = client.get("/v1/sets/cats/images", headers=ADMIN).json()["data"]
    assert {i["sha256"]: i["facets"]["fur_length"]["value"] for i in listed} == {
        s: rows[s].facets["fur_length"]["value"] for s in shas}
    counts = client.get("/v1/sets/cats/facets/counts", headers=ADMIN, params={"min_confidence": 0}).json()
    assert counts["images"] == N and sum(counts["attributes"]["fur_length"].values()) == N
    for value, n in counts["attributes"]["ear_shape"].items():
        chosen = {s for s in shas if rows[s].facets["ear_shape"]["value"] == value}
        assert n == len(chosen)
        hits = search(client, "cats", {"must": [{"key": "facets.ear_shape", "match": {"value": value},
                                                 "min_confidence": 0}]})["hits"]
        assert {h["image"]["sha256"] for h in hits} == chosen
    # the threshold: only references whose chosen value reaches it
    cut = sorted(rows[s].facets["fur_length"]["p"] for s in shas)[N // 2]
    keep = {s for s in shas if rows[s].facets["fur_length"]["p"] >= cut}
    hits = search(client, "cats", {"must": [{"key": "facets.fur_length", "match": {"any": ["short", "long"]},
                                             "min_confidence": cut}]})["hits"]
    assert {h["image"]["sha256"] for h in hits} == keep
    none = search(client, "cats", {"must": [{"key": "facets.fur_length", "match": {"value": "short"},
                                             "min_confidence": 1.0}]})
    assert none["hits"] == [] and none["provenance"]["filter"]["reason"]

    # a metadata change keeps the facets in the index payload
    assert client.patch(f"/v1/sets/cats/images/{shas[0]}", headers=ADMIN,
                        json={"metadata": {"label": "renamed"}}).status_code == 200
    value = rows[shas[0]].facets["ear_shape"]["value"]
    hits = search(client, "cats", {"must": [{"key": "facets.ear_shape", "match": {"value": value},
                                             "min_confidence": 0}]})["hits"]
    assert shas[0] in {h["image"]["sha256"] for h in hits}

    # a schema change recomputes only the attribute that changed
    changed = {"attributes": [SCHEMA["attributes"][0], {"name": "fur_length", "values": ["short", "medium", "long"]}]}
    put = client.put("/v1/sets/cats/facets/schema", headers=ADMIN, json=changed).json()
    assert put["version"] == 2 and put["stale"] == N
    pairs = state.reranker.stats["scored_pairs"]
    wait_job(client, client.post("/v1/sets/cats/facets/jobs", headers=ADMIN).json()["id"])
    assert state.reranker.stats["scored_pairs"] - pairs == N * 3
    after = images_of(state, "cats")
    for sha in shas:
        assert after[sha].facets["ear_shape"] == rows[sha].facets["ear_shape"]
        assert set(after[sha].facets["fur_length"]["probs"]) == {"short", "medium", "long"}
    assert client.put("/v1/sets/cats/facets/schema", headers=ADMIN, json=changed).json()["version"] == 2

    # references ingested later get their facets from a follow-up job
    more = ingest(client, "cats", range(400, 402))
    deadline = time.monotonic() + 120
    while any(not images_of(state, "cats")[s].facets for s in more):
        assert time.monotonic() < deadline, "new references got no facets"
        time.sleep(0.1)
    state.facets.join(60)
    assert client.get("/v1/sets/cats/facets/schema", headers=ADMIN).json()["stale"] == 0
    assert state.facets.usage.total() == 0  # (ingestion encoded the new references, the facet job did not)


def test_the_default_threshold_is_the_constant(client: TestClient, state: AppState,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """(Runs after the test above, on its facets.) A condition or count that names no threshold uses it."""
    flt = {"must": [{"key": "facets.fur_length", "match": {"any": ["short", "medium", "long"]}}]}
    for threshold, expect in ((0.0, N + 2), (1.0, 0)):
        for module in ("rubricsearch.app.set_search", "rubricsearch.app.routers.facets"):  # search, counts
            monkeypatch.setattr(f"{module}.FACET_MIN_CONFIDENCE", threshold)
        assert len(search(client, "cats", flt)["hits"]) == expect
        counts = client.get("/v1/sets/cats/facets/counts", headers=ADMIN).json()
        assert counts["min_confidence"] == threshold and sum(counts["attributes"]["fur_length"].values()) == expect


@pytest.mark.parametrize(("schema", "named"), [
    ({"attributes": [{"name": f"a{i}", "values": ["x", "y"]} for i in range(33)]}, "at most 32 attributes"),
    ({"attributes": [{"name": "a", "values": [f"v{i}" for i in range(33)]}]}, "needs 2..32 values"),
    ({"attributes": [{"name": "a", "values": ["x", "x"]}]}, "listed twice"),
    ({"attributes": [{"name": "a.b", "values": ["x", "y"]}]}, "attributes[0].name"),
    ({"attributes": [{"name": "a", "values": ["x", "y"]}, {"name": "a", "values": ["x", "y"]}]}, "named twice"),
])
def test_schema_over_its_bounds_is_422_naming_it(client: TestClient, schema: dict[str, Any], named: str) -> None:
    client.post("/v1/sets", json={"name": "bounds"}, headers=ADMIN)
    got = client.put("/v1/sets/bounds/facets/schema", headers=ADMIN, json=schema)
    assert got.status_code == 422 and named in got.text, got.text
    assert client.get("/v1/sets/bounds/facets/schema", headers=ADMIN).json()["version"] == 0


@pytest.mark.parametrize(("flt", "named"), [
    ({"must": [{"key": "facets.ear_shape", "match": {"value": "round"}, "min_confidence": 2}]}, "min_confidence"),
    ({"must": [{"key": "facets.ear_shape", "range": {"gt": 1}}]}, "'range'"),
    ({"must": [{"key": "facets.a b", "match": {"value": "x"}}]}, "invalid facet attribute"),
])
def test_bad_facet_filters_are_422(client: TestClient, flt: dict[str, Any], named: str) -> None:
    client.post("/v1/sets", json={"name": "bounds"}, headers=ADMIN)
    got = client.post("/v1/search", headers=ADMIN, json={"set_id": "bounds", "rubric": "x", "filter": flt})
    assert got.status_code == 422 and named in got.text, got.text


def test_a_set_deleted_under_a_facet_job_ends_it_cleanly(client: TestClient, state: AppState) -> None:
    assert client.post("/v1/sets", json={"name": "gone"}, headers=ADMIN).status_code == 201
    ingest(client, "gone", range(500, 508))
    client.put("/v1/sets/gone/facets/schema", headers=ADMIN, json=SCHEMA)
    job = client.post("/v1/sets/gone/facets/jobs", headers=ADMIN).json()
    assert client.delete("/v1/sets/gone", headers=ADMIN).status_code in (200, 204)
    state.facets.join(60)
    assert not any(t.is_alive() for t in state.facets._threads.values())
    assert client.get(f"/v1/jobs/{job['id']}", headers=ADMIN).status_code == 404
    assert client.get("/healthz").status_code == 200

    # deterministic: the job exists with all its items pending when its set goes
    assert client.post("/v1/sets", json={"name": "gone"}, headers=ADMIN).status_code == 201
    ingest(client, "gone", range(500, 504))
    client.put("/v1/sets/gone/facets/schema", headers=ADMIN, json=SCHEMA)
    with state.catalog.read() as s:
        set_id = resolve_set(s, "gone").id
    pending = state.facets.start(set_id)
    assert pending.total == 4
    assert client.delete("/v1/sets/gone", headers=ADMIN).status_code in (200, 204)
    assert state.facets.run(pending.id) is None


def test_a_facet_job_resumes_after_a_crash(client: TestClient, state: AppState) -> None:
    """A worker that died holding a batch: starting facets again continues the same job, nothing twice."""
    assert client.post("/v1/sets", json={"name": "resume"}, headers=ADMIN).status_code == 201
    shas = ingest(client, "resume", range(600, 605))
    client.put("/v1/sets/resume/facets/schema", headers=ADMIN, json=SCHEMA)
    with state.catalog.read() as s:
        set_id = resolve_set(s, "resume").id
    first = FacetJobs(state.catalog, state.index, state.reranker, worker_id="host:1", batch_size=2)
    job = first.start(set_id)
    first._batch(set_id, _claim(state, first, job.id))  # one batch done
    _claim(state, first, job.id)  # ... and the next claimed when the process died
    again = FacetJobs(state.catalog, state.index, state.reranker, worker_id="host:1", batch_size=2)
    assert again.start(set_id).id == job.id
    ended = again.run(job.id)
    assert ended is not None and (ended.state.value, ended.done, ended.failed) == ("succeeded", 5, 0)
    assert all(images_of(state, "resume")[s].facets for s in shas)
    with state.catalog.write() as s:
        assert claim_next_items(s, "other", job_id=job.id) == []


def _claim(state: AppState, jobs: Any, job_id: str) -> list[Any]:
    with state.catalog.write() as s:
        return list(claim_next_items(s, jobs.worker_id, job_id=job_id, limit=jobs.batch_size))


def test_a_reference_without_a_package_fails_its_item_and_encodes_nothing(
        client: TestClient, state: AppState, count_tower: Callable[[Any], TowerCounter]) -> None:
    assert client.post("/v1/sets", json={"name": "lost"}, headers=ADMIN).status_code == 201
    shas = ingest(client, "lost", range(700, 703))
    client.put("/v1/sets/lost/facets/schema", headers=ADMIN, json=SCHEMA)
    state.packages.store.flush()
    assert state.packages.store.delete_image(shas[1]) >= 1  # its packages were lost
    counted = towers(state, count_tower)
    done = wait_job(client, client.post("/v1/sets/lost/facets/jobs", headers=ADMIN).json()["id"])
    assert (done["done"], done["failed"]) == (2, 1)
    assert "no cached visual package" in str(done["errors"])
    assert [c.calls for c in counted] == [0, 0] and state.facets.usage.total() == 0
    rows = images_of(state, "lost")
    assert rows[shas[1]].facets == {} and rows[shas[0]].facets and rows[shas[2]].facets


def test_a_cancelled_facet_job_stops(client: TestClient, state: AppState) -> None:
    assert client.post("/v1/sets", json={"name": "cancel"}, headers=ADMIN).status_code == 201
    ingest(client, "cancel", range(800, 804))
    client.put("/v1/sets/cancel/facets/schema", headers=ADMIN, json=SCHEMA)
    with state.catalog.read() as s:
        set_id = resolve_set(s, "cancel").id
    jobs = FacetJobs(state.catalog, state.index, state.reranker, worker_id="host:2", batch_size=1)
    job = jobs.start(set_id)
    assert client.post(f"/v1/jobs/{job.id}/cancel", headers=ADMIN).status_code in (200, 202)
    ended = jobs.run(job.id)
    assert ended is not None and ended.state.value == "cancelled" and ended.done == 0
    assert not any(images_of(state, "cancel")[i].facets for i in images_of(state, "cancel"))
