"""A 200 on a metadata write is durable for filters: SIGKILL a real server at random points after PATCHes and
manifest uploads, restart it, and every filter must keep exactly the images whose catalog metadata passes it.

The catalog commits before the FAISS payload file is saved (the index saves on an interval), so what a crash
loses of the payloads start-up reconciliation must restore from the catalog. Runs on SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import os
import random
import signal
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from rubricsearch.retrieval.images import decode_image
from tests.api_helpers import ADMIN_KEY, bearer, wait_job
from tests.conftest import noise_png
from tests.conftest_catalog import CATALOG_BACKENDS
from tests.live_server import live_server

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]
SEED = 20261206
N = 6
COLORS = ("red", "green", "blue")


@pytest.fixture(params=CATALOG_BACKENDS)
def server_env(request: pytest.FixtureRequest) -> dict[str, str]:
    env = {"RUBRICSEARCH_MODELS__DTYPE": "float32", "RUBRICSEARCH_AUTH__ADMIN_API_KEYS": ADMIN_KEY,
           "RUBRICSEARCH_AUTH__RATE_LIMIT_PER_MINUTE": "0"}
    if request.param == "postgres":
        env["RUBRICSEARCH_DATABASE_URL"] = str(request.getfixturevalue("postgres_schema_url"))
    return env


@contextmanager
def server(data: Path, models: tuple[Path, Path], env: dict[str, str]) -> Iterator[tuple[Any, httpx.Client]]:
    with live_server(data, *models, **env) as (proc, base), \
            httpx.Client(base_url=base, headers=bearer(ADMIN_KEY), timeout=60) as client:
        yield proc, client


def catalog_metadata(client: httpx.Client) -> dict[str, dict[str, Any]]:
    page = client.get("/v1/sets/crash/images?limit=100")
    assert page.status_code == 200, page.text
    return {img["sha256"]: img["metadata"] for img in page.json()["data"]}


def filtered(client: httpx.Client, flt: dict[str, Any]) -> set[str]:
    r = client.post("/v1/search", json={"set_id": "crash", "rubric": "a picture", "rerank": False, "top_k": 50,
                                        "top_n": 0, "filter": flt})
    assert r.status_code == 200, r.text
    return {h["image"]["sha256"] for h in r.json()["hits"]}


def check_filters_agree(client: httpx.Client) -> None:
    meta = catalog_metadata(client)
    assert len(meta) == N
    for color in COLORS:
        want = {sha for sha, m in meta.items() if m.get("color") == color}
        assert filtered(client, {"must": [{"key": "color", "match": {"value": color}}]}) == want, color
    for n in range(4):
        want = {sha for sha, m in meta.items() if isinstance(m.get("n"), int) and m["n"] >= n}
        assert filtered(client, {"must": [{"key": "n", "range": {"gte": n}}]}) == want, n


def test_metadata_writes_survive_sigkill(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                         server_env: dict[str, str]) -> None:
    """Two kill rounds cover both states start-up repair meets: the first kill comes in the process that ingested
    (the index file, saved at the job's end, holds no payloads: repair fills them in), the second after a restart
    whose repair saved the file (it holds the first round's payloads, which the second round's writes change:
    repair overwrites them). Further rounds would repeat the second's state."""
    data, models = tmp_path / "data", (tiny_embedding_dir, tiny_reranker_dir)
    images = [noise_png(40 + 3 * i, 48, 4100 + i) for i in range(N)]
    shas = [decode_image(d).sha256 for d in images]
    rng = random.Random(SEED)
    for round_ in range(2):
        with server(data, models, server_env) as (proc, client):
            if round_ == 0:
                assert client.post("/v1/sets", json={"name": "crash"}).status_code == 201
                job = client.post("/v1/sets/crash/images",
                                  files=[("files", (f"{i}.png", d, "image/png")) for i, d in enumerate(images)]).json()
                assert wait_job(client, job["id"])["state"] == "succeeded", job
            check_filters_agree(client)
            for sha in rng.sample(shas, 3):
                change = {"color": rng.choice(COLORS), "n": rng.randint(0, 3)}
                r = client.patch(f"/v1/sets/crash/images/{sha}", json={"metadata": change})
                assert r.status_code == 200, r.text
            rows = [{"sha256": sha, "color": rng.choice(COLORS), "n": rng.randint(0, 3)}
                    for sha in rng.sample(shas, 3)]
            body = "".join(json.dumps(row) + "\n" for row in rows).encode()
            r = client.post("/v1/sets/crash/manifest", files={"file": ("manifest.jsonl", body)})
            assert r.status_code == 200, r.text
            time.sleep(rng.uniform(0.0, 0.5))
            os.kill(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    with server(data, models, server_env) as (_, client):
        check_filters_agree(client)
