"""A set's calibration follows its judgments on its own (``app/refits.py``), on tiny random-weight checkpoints:
every way of changing judgments through the API schedules a background refit that saves the next version; searches
answer, from the old fit, while a refit is under way; a burst of single judgments is a few refits, not one each;
a process that starts over sets whose judgments moved without it refits them; and indexing a judged reference that
was not indexed refits its set at a refitter's periodic look, whichever process indexed it. The CLI prints the
verdicts of the fit."""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.calibration import set_lock
from rubricsearch.app.cli.search import print_results
from rubricsearch.app.refits import Refitter
from rubricsearch.app.schemas.search import SearchBody
from rubricsearch.app.set_search import search_set
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import (
    JudgmentSpec,
    mark_image_failed,
    mark_images_indexed,
    record_judgments,
    resolve_set,
)
from rubricsearch.indexer.catalog.tables import JudgmentSource
from tests.api_helpers import ADMIN_KEY, bearer, one_state, wait_job
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(600)
ADMIN = bearer(ADMIN_KEY)
CRITERIA = ["short fur", "triangular ears", "green eyes"]
URL = "/v1/sets/auto/judgments"
WAIT_S = 120.0  # a refit of these few cells takes seconds; the bound only keeps a broken refitter from hanging
LOOK_S = 0.5  # the tests' refitters look this often for sets whose fit lags the catalog (a server's: LOOK_S)

state, client = one_state("refits")


@pytest.fixture(scope="module")
def shas(client: TestClient) -> list[str]:
    """12 references ingested through the API."""
    assert client.post("/v1/sets", json={"name": "auto"}, headers=ADMIN).status_code == 201
    images = [noise_png(40 + 4 * i, 52, 900 + i) for i in range(12)]
    job = client.post("/v1/sets/auto/images", headers=ADMIN,
                      files=[("files", (f"a{i}.png", d, "image/png")) for i, d in enumerate(images)]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded"
    listed = client.get("/v1/sets/auto/images", params={"limit": 100}, headers=ADMIN).json()
    return sorted(row["sha256"] for row in listed["data"])


def set_id(state: AppState) -> str:
    with state.catalog.read() as session:
        return resolve_set(session, "auto").id


def until(done: Callable[[], Any], what: str) -> Any:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        got = done()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"not within {WAIT_S} s: {what}")


def calibration(client: TestClient) -> dict[str, Any] | None:
    r = client.get("/v1/sets/auto/calibration")
    return r.json() if r.status_code == 200 else None


def settled(client: TestClient) -> dict[str, Any]:
    """The calibration once no refit is pending and it covers every judgment."""

    def fresh() -> dict[str, Any] | None:
        got = calibration(client)
        return got if got and not got["stale"]["stale"] and not got["stale"]["refit_pending"] else None

    return until(fresh, "the calibration catches up with the judgments")  # type: ignore[no-any-return]


def search_use(client: TestClient) -> dict[str, Any] | None:
    """The calibration a search's provenance names."""
    r = client.post("/v1/search", json={"set_id": "auto", "criteria": CRITERIA[:2], "top_k": 12, "top_n": 12})
    assert r.status_code == 200, r.text
    return r.json()["provenance"]["calibration"]  # type: ignore[no-any-return]


def search_version(client: TestClient) -> int | None:
    use = search_use(client)
    return None if use is None else int(use["version"])


def all_ids(client: TestClient) -> list[int]:
    return [j["id"] for j in client.get(URL, params={"limit": 1000}).json()["data"]]


def test_judgments_recorded_through_the_api_are_refitted_in_the_background(client: TestClient, state: AppState,
                                                                          shas: list[str]) -> None:
    assert calibration(client) is None
    rng = np.random.default_rng(3)
    r = client.post(URL, headers=ADMIN, json=[{"sha256": s, "criterion": c, "holds": bool(rng.random() < 0.5)}
                                              for s in shas for c in CRITERIA])
    assert r.status_code == 200, r.text
    assert state.refits is not None and state.refits.pending(set_id(state))  # scheduled, not done on the request
    fitted = settled(client)
    assert fitted["version"] == 1 and fitted["judgments"] == len(shas) * len(CRITERIA)
    assert fitted["max_judgment_id"] == max(all_ids(client))
    assert search_version(client) == 1
    quality = client.get("/v1/sets/auto/quality").json()
    assert quality["calibration_version"] == 1 and quality["stale"]["refit_pending"] is False


def test_the_cli_prints_each_hits_verdict_and_each_cells(client: TestClient, state: AppState, shas: list[str],
                                                        capsys: pytest.CaptureFixture[str]) -> None:
    """``rubricsearch search`` prints what the API gives: each hit's verdict and chance, each cell's verdict."""
    settled(client)
    response = search_set(state, SearchBody(set_id="auto", criteria=CRITERIA[:2], top_k=12, top_n=12))
    assert response.provenance.calibration is not None and response.provenance.calibration.applied
    capsys.readouterr()
    print_results(response)
    lines = capsys.readouterr().out.splitlines()
    assert response.hits
    for hit in response.hits:
        row = next(line for line in lines if hit.image.sha256[:12] in line)
        assert hit.verdict is not None and hit.probability is not None
        assert f"{hit.verdict} {hit.probability:.2f}" in row
        for c in CRITERIA[:2]:
            assert f"{hit.criteria[c]:.4f} {hit.criteria_verdicts[c].verdict}" in row
    assert f"calibration: version {response.provenance.calibration.version}," in "\n".join(lines)


def test_searches_answer_from_the_old_fit_while_a_refit_is_under_way(client: TestClient, state: AppState,
                                                                     shas: list[str]) -> None:
    before = settled(client)["version"]
    lock = set_lock(set_id(state))
    with lock:  # the refit starts and waits here, as it would behind an asked-for refit of the set
        assert client.post(URL, headers=ADMIN, json={"sha256": shas[0], "criterion": "a new one",
                                                     "holds": True}).status_code == 200
        assert state.refits is not None
        until(lambda: state.refits.running == set_id(state), "the refit starts")  # type: ignore[union-attr]
        for _ in range(3):
            use = search_use(client)
            assert use is not None and use["version"] == before and use["stale"]["refit_pending"]
        stale = calibration(client)["stale"]  # type: ignore[index]
        assert stale == {"stale": True, "new": 1, "gone": 0, "refit_pending": True}
    assert settled(client)["version"] == before + 1
    assert search_version(client) == before + 1


def test_a_burst_of_single_judgments_is_a_few_refits(client: TestClient, state: AppState, shas: list[str]) -> None:
    before = settled(client)["version"]
    for k in range(50):
        r = client.post(URL, headers=ADMIN, json={"sha256": shas[k % len(shas)], "criterion": CRITERIA[k % 3],
                                                  "holds": k % 2 == 0})
        assert r.status_code == 200, r.text
    after = settled(client)
    assert 1 <= after["version"] - before <= 3, after["version"] - before
    assert after["max_judgment_id"] == max(all_ids(client))


def test_deletes_imports_and_derivations_are_followed(client: TestClient, state: AppState,
                                                      shas: list[str]) -> None:
    version = settled(client)["version"]
    one = client.get(URL, params={"criterion": "a new one"}).json()["data"][0]
    assert client.delete(f"{URL}/{one['id']}", headers=ADMIN).status_code == 200
    fitted = settled(client)
    assert fitted["version"] == version + 1 and fitted["stale"]["gone"] == 0

    exported = client.get(URL, params={"format": "jsonl", "criterion": CRITERIA[0]}).content
    assert client.delete(URL, params={"criterion": CRITERIA[0]}, headers=ADMIN).status_code == 200
    assert settled(client)["judgments"] == fitted["judgments"] - len(shas)
    upload = {**ADMIN, "Content-Type": "application/x-ndjson"}
    assert client.post(f"{URL}/import", content=exported, headers=upload).status_code == 200
    assert settled(client)["judgments"] == fitted["judgments"]

    assert client.delete(f"/v1/sets/auto/images/{shas[-1]}", headers=ADMIN).status_code == 204
    assert settled(client)["judgments"] == fitted["judgments"] - len(CRITERIA)


def test_a_refused_change_schedules_nothing(client: TestClient, state: AppState, shas: list[str]) -> None:
    version = settled(client)["version"]
    unknown = {"sha256": "0" * 64, "criterion": "c", "holds": True}
    assert client.post(URL, headers=ADMIN, json=[{"sha256": shas[0], "criterion": "c", "holds": True},
                                                 unknown]).status_code == 404
    assert client.delete(f"{URL}/{10**12}", headers=ADMIN).status_code == 404
    assert state.refits is not None and not state.refits.pending(set_id(state))
    assert calibration(client)["version"] == version  # type: ignore[index]


def test_a_process_that_starts_refits_what_moved_without_it(client: TestClient, state: AppState,
                                                            shas: list[str]) -> None:
    version = settled(client)["version"]
    image = client.get("/v1/sets/auto/images", headers=ADMIN).json()["data"][0]["id"]
    with state.catalog.write() as session:  # written where no refitter hears of it (another process, the CLI)
        record_judgments(session, set_id(state), [JudgmentSpec(image, "written offline", True, JudgmentSource.API)])
    assert calibration(client)["stale"]["new"] == 1  # type: ignore[index]
    started = Refitter(state.catalog, state.search).start()
    try:
        until(lambda: started.refits == 1, "the starting refitter refits the stale set")
        assert settled(client)["version"] == version + 1
    finally:
        started.stop(60)


@pytest.mark.parametrize("where", ["this process", "another process"])
def test_indexing_a_judged_reference_refits_its_set(client: TestClient, state: AppState, shas: list[str],
                                                    where: str) -> None:
    """A judgment of a reference that is not indexed (its re-index failed) is left out of the fit, having no package
    to be scored from. Once the reference is indexed again, by this process's ingestion or by another process's
    commit (a ``rubricsearch worker``), a refitter's periodic look finds the set and refits it to take the judgment
    in, though no judgment moved; ingestion tells no refitter. This refitter looks every :data:`LOOK_S`."""
    settled(client)
    images = {hashlib.sha256(data).hexdigest(): data for data in (noise_png(40 + 4 * i, 52, 900 + i)
                                                                  for i in range(12))}
    listed = client.get("/v1/sets/auto/images", params={"limit": 100}, headers=ADMIN).json()["data"]
    row = [r for r in listed if r["sha256"] in images][0 if where == "this process" else 1]
    with state.catalog.write() as session:  # as a failed re-index leaves a reference
        mark_image_failed(session, row["id"], "re-indexing failed: the test's")
    assert client.post(URL, headers=ADMIN, json={"sha256": row["sha256"], "criterion": f"indexed by {where}",
                                                 "holds": where == "this process"}).status_code == 200
    before = settled(client)
    looking = Refitter(state.catalog, state.search, look_s=LOOK_S).start()
    try:
        time.sleep(2 * LOOK_S)  # its look at start is over and found nothing to do: a later look must find the set
        if where == "this process":
            job = client.post("/v1/sets/auto/images", headers=ADMIN,
                              files=[("files", ("again.png", images[row["sha256"]], "image/png"))]).json()
            assert wait_job(client, job["id"])["state"] == "succeeded"
        else:
            with state.catalog.write() as session:  # another process's commit
                mark_images_indexed(session, [row["id"]])
        after = until(lambda: (got := calibration(client)) and got["version"] > before["version"] and got,
                      "a look finds the set whose judged reference was indexed")
    finally:
        looking.stop(60)
    assert after["judgments"] == before["judgments"] and after["max_judgment_id"] == before["max_judgment_id"]
    judged = len(client.get(URL, params={"image": row["sha256"], "limit": 1000}).json()["data"])
    assert judged >= 1 and after["skipped"] == before["skipped"] - judged
