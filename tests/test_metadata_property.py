"""Property: any text or number through any metadata entrance is either stored and readable everywhere (listing,
export, counts, a search filtering on it), or refused with a 4xx and nothing stored.

Entrances: PATCH (JSON), a JSONL manifest, a CSV manifest, a facet schema and a search filter; values are
arbitrary Unicode (lone surrogates and NUL included) and integers of any size, floats and booleans, alone or
in lists. Bounded by ``max_examples`` to well under a minute on tiny checkpoints, FAISS and SQLite.
"""

from __future__ import annotations

import csv
import io
import json
from typing import Any

import pytest
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from rubricsearch.retrieval.images import decode_image
from tests.api_helpers import ADMIN_KEY, bearer, one_state, wait_job
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(600)
ADMIN = {**bearer(ADMIN_KEY), "Content-Type": "application/json"}
EXAMPLES = settings(max_examples=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

CHARS = st.characters(exclude_categories=()) | st.sampled_from(["\ud800", "\udfff", "\x00", "\U0001f600", "é"])
TEXT = st.text(CHARS, max_size=12)
INTS = st.integers() | st.integers(min_value=-(2**70), max_value=2**70) | st.sampled_from([2**63 - 1, 2**63,
                                                                                          -(2**63), 10**400])
SCALARS = TEXT | INTS | st.floats() | st.booleans()
VALUES = SCALARS | st.lists(SCALARS, max_size=3)


state, client = one_state("api-property")


@pytest.fixture(scope="module")
def sha(client: TestClient) -> str:
    assert client.post("/v1/sets", json={"name": "prop"}, headers=ADMIN).status_code == 201
    image = noise_png(36, 40, 4242)
    job = client.post("/v1/sets/prop/images", headers=bearer(ADMIN_KEY),
                      files=[("files", ("a.png", image, "image/png"))]).json()
    assert wait_job(client, job["id"])["state"] == "succeeded", job
    return decode_image(image).sha256


def as_json(value: Any) -> bytes:
    """JSON as a client may write it: \\u escapes spell what UTF-8 cannot carry; NaN and huge numbers as Python
    spells them (a server must refuse what it cannot store, however it is spelled)."""
    return json.dumps(value, ensure_ascii=True).encode()


def stored(client: TestClient) -> dict[str, Any]:
    page = client.get("/v1/sets/prop/images", headers=ADMIN)
    assert page.status_code == 200, page.text
    [image] = page.json()["data"]
    return dict(image["metadata"])


def readable_everywhere(client: TestClient, sha: str, meta: dict[str, Any]) -> None:
    export = client.get("/v1/sets/prop/manifest.jsonl", headers=ADMIN)
    assert export.status_code == 200
    [row] = [json.loads(line) for line in export.text.splitlines()]
    assert row == {"sha256": sha, "file": "a.png", **meta}
    assert client.get("/v1/sets/prop/metadata/counts", headers=ADMIN).status_code == 200
    value = meta.get("v")
    scalar = value[0] if isinstance(value, list) and value else value
    flt = ({"must": [{"key": "v", "match": {"value": scalar}}]} if isinstance(scalar, str | int) and
           len(str(scalar)) <= 1024 else {"must": [{"key": "v", "range": {"gte": scalar}}]}
           if isinstance(scalar, float) else None)
    body = {"set_id": "prop", "rubric": "a picture", "rerank": False, "top_n": 0, "filter": flt}
    r = client.post("/v1/search", headers=ADMIN, content=as_json(body))
    assert r.status_code == 200, r.text
    assert [h["image"]["sha256"] for h in r.json()["hits"]] == [sha]
    assert r.json()["hits"][0]["image"]["metadata"] == meta


def check(client: TestClient, sha: str, response: Any, before: dict[str, Any]) -> None:
    assert response.status_code < 500, response.text
    after = stored(client)
    if response.status_code >= 400:
        assert after == before, response.text
    else:
        readable_everywhere(client, sha, after)
    client.patch(f"/v1/sets/prop/images/{sha}", headers=ADMIN, json={"metadata": {}, "replace": True})


@EXAMPLES
@given(value=VALUES)
def test_patch(client: TestClient, sha: str, value: Any) -> None:
    before = stored(client)
    r = client.patch(f"/v1/sets/prop/images/{sha}", headers=ADMIN, content=as_json({"metadata": {"v": value}}))
    if r.status_code == 200:
        assert stored(client)["v"] == value
    check(client, sha, r, before)


@EXAMPLES
@given(value=VALUES)
def test_jsonl_manifest(client: TestClient, sha: str, value: Any) -> None:
    before = stored(client)
    body = as_json({"sha256": sha, "v": value}) + b"\n"
    r = client.post("/v1/sets/prop/manifest", headers=bearer(ADMIN_KEY), files={"file": ("m.jsonl", body)})
    check(client, sha, r, before)


@EXAMPLES
@given(cell=TEXT | INTS.map(str))
def test_csv_manifest(client: TestClient, sha: str, cell: str) -> None:
    before = stored(client)
    out = io.StringIO()
    csv.writer(out).writerows([["sha256", "v"], [sha, cell]])
    body = out.getvalue().encode("utf-8", "surrogatepass")  # a surrogate so spelled is not UTF-8: refused
    r = client.post("/v1/sets/prop/manifest", headers=bearer(ADMIN_KEY), files={"file": ("m.csv", body)})
    check(client, sha, r, before)


@EXAMPLES
@given(value=TEXT)
def test_facet_schema(client: TestClient, sha: str, value: str) -> None:
    url = "/v1/sets/prop/facets/schema"
    before = client.get(url, headers=ADMIN).json()
    r = client.put(url, headers=ADMIN, content=as_json({"attributes": [{"name": "a", "values": ["x", value]}]}))
    assert r.status_code < 500, r.text
    after = client.get(url, headers=ADMIN)
    assert after.status_code == 200
    if r.status_code >= 400:
        assert after.json() == before
    else:
        assert after.json()["attributes"][0]["values"][1]["value"] == value.strip()


@EXAMPLES
@given(value=SCALARS)
def test_filter_value(client: TestClient, sha: str, value: Any) -> None:
    for condition in ({"match": {"value": value}}, {"range": {"gte": value}}):
        body = {"set_id": "prop", "rubric": "a picture", "rerank": False, "top_n": 0,
                "filter": {"must": [{"key": "v", **condition}]}}
        r = client.post("/v1/search", headers=ADMIN, content=as_json(body))
        assert r.status_code in (200, 422), r.text
