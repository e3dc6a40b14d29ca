"""A full disk under PostgreSQL: the catalog database lives in a tablespace on a small tmpfs that the test mounts
(and removes), filled to the last byte, so PostgreSQL itself raises disk_full (SQLSTATE 53100) when a table must
grow. Writes that need space get 507, the server stays up, nothing is half-written, a delete still works, and
writes work again once space is freed. Needs root (to mount) and the test cluster's ``postgres`` account (to create
the tablespace, as ``scripts/ci_postgres.sh`` sets it up); skipped otherwise."""

from __future__ import annotations

import os
import subprocess
import tempfile
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from sqlalchemy.engine import make_url

from rubricsearch.app.main import create_app
from rubricsearch.app.state import AppState
from tests.api_helpers import ADMIN_KEY, api_settings, bearer
from tests.conftest import noise_png
from tests.conftest_catalog import POSTGRES_ENV
from tests.test_disk_full import fill

pytestmark = [pytest.mark.slow, pytest.mark.postgres, pytest.mark.timeout(180)]
ADMIN = bearer(ADMIN_KEY)


def _superuser(url: str) -> list[str]:
    """psql as the cluster's superuser, through the ``postgres`` account and the socket ``ci_postgres.sh`` uses."""
    parsed = make_url(url)
    socket_dir = os.environ.get("RUBRICSEARCH_PG_HOME", "/tmp/rubricsearch-pg")
    return ["runuser", "-u", "postgres", "--", "psql", "-h", socket_dir, "-p", str(parsed.port or 5432),
            "-U", "postgres", "-d", "postgres", "-v", "ON_ERROR_STOP=1", "-qtAX", "-c"]


@pytest.fixture
def full_database() -> Iterator[tuple[str, Path]]:
    """(URL of a fresh database on a 16 MiB tmpfs tablespace, the tmpfs mount)."""
    url = os.environ.get(POSTGRES_ENV)
    if not url:
        pytest.skip(f"{POSTGRES_ENV} is not set")
    psql = _superuser(url)
    mount = Path(tempfile.mkdtemp(prefix="rs-pgfull-"))
    name = f"rs_full_{uuid.uuid4().hex[:8]}"
    role = make_url(url).username
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,uid=postgres,gid=postgres,mode=700", "tmpfs",
                           str(mount)], capture_output=True)
    if done.returncode != 0:
        mount.rmdir()
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode(errors='replace').strip()}")
    try:
        made = subprocess.run([*psql, f"CREATE TABLESPACE {name} LOCATION '{mount}'"], capture_output=True)
        if made.returncode != 0:
            pytest.skip(f"cannot create a tablespace as the cluster's superuser: {made.stderr.decode().strip()}")
        subprocess.run([*psql, f"CREATE DATABASE {name} OWNER {role} TABLESPACE {name}"], check=True)
        yield make_url(url).set(database=name).render_as_string(hide_password=False), mount
    finally:
        subprocess.run([*psql, f"DROP DATABASE IF EXISTS {name} WITH (FORCE)"], capture_output=True)
        subprocess.run([*psql, f"DROP TABLESPACE IF EXISTS {name}"], capture_output=True)
        subprocess.run(["umount", "-l", str(mount)], check=False)
        mount.rmdir()


def test_postgres_disk_full_is_507_and_deletes_still_work(full_database: tuple[str, Path], tmp_path: Path,
                                                           tiny_embedding_dir: Path, tiny_reranker_dir: Path) -> None:
    import psycopg
    from psycopg import errors as pg_errors

    url, mount = full_database
    settings = api_settings(tmp_path / "data", tiny_embedding_dir, tiny_reranker_dir, ingest={"workers": 0},
                            packages={"memory_bytes": 0},
                            database_url=url)
    state = AppState.build(settings)
    try:
        client = TestClient(create_app(settings, state=state), raise_server_exceptions=False)
        assert client.post("/v1/sets", json={"name": "kept", "dimensions": 64}, headers=ADMIN).status_code == 201
        assert client.post("/v1/sets", json={"name": "doomed", "dimensions": 64}, headers=ADMIN).status_code == 201
        fill(mount / "filler")

        # the condition is PostgreSQL's own: a table that must grow cannot
        with psycopg.connect(make_url(url).set(drivername="postgresql").render_as_string(hide_password=False)) as c, \
                pytest.raises(pg_errors.DiskFull) as raised:
            c.execute("CREATE TABLE probe AS SELECT g, repeat('x', 500) AS pad FROM generate_series(1, 100000) g")
        assert raised.value.sqlstate == "53100"

        files = [("files", (f"u{i}.png", noise_png(40, 40, seed=600 + i), "image/png")) for i in range(3)]
        upload = client.post("/v1/sets/kept/images", files=files, headers=ADMIN)  # the first job rows: new pages
        assert upload.status_code == 507, upload.text
        error = upload.json()["error"]
        assert error["type"] == "insufficient_storage" and "disk" in error["message"], error
        assert client.get("/healthz").status_code == 200
        assert client.get("/v1/jobs").json()["data"] == []  # no half-made job
        assert not [p for p in (tmp_path / "data" / "staging").iterdir()]  # nor its staged files

        assert client.delete("/v1/sets/doomed", headers=ADMIN).status_code in (200, 202, 204)
        (mount / "filler").unlink()
        again = client.post("/v1/sets/kept/images", files=files, headers=ADMIN)
        assert again.status_code in (201, 202), again.text
        assert [s["name"] for s in client.get("/v1/sets").json()["data"]] == ["kept"]
    finally:
        state.close()
