"""``rubricsearch judgments ...`` against a live uvicorn server (a subprocess on 127.0.0.1 with the tiny offline
checkpoints): add, list, export, delete, import, derive (dry run, then recorded), and the server's errors as CLI
errors; each step checked against what the server's API then holds, not only against what the CLI printed."""

from __future__ import annotations

import io
import json
import re
import zipfile
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from rubricsearch.app.cli import main
from rubricsearch.retrieval.images import decode_image
from tests.api_helpers import ADMIN_KEY, bearer, wait_job
from tests.conftest import noise_png
from tests.live_server import ServerFailed, live_server

pytestmark = pytest.mark.timeout(300)
BREEDS = ["tabby", "siamese", "tabby", "siamese"]
SET = "cli-cats"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
           tiny_reranker_dir: Path) -> Iterator[tuple[str, list[str]]]:
    """The live server's URL and the sha256 of the set's references (their manifest gives each a breed)."""
    try:
        with live_server(tmp_path_factory.mktemp("cli-judgments"), tiny_embedding_dir, tiny_reranker_dir,
                         RUBRICSEARCH_MODELS__DTYPE="float32",
                         RUBRICSEARCH_AUTH__ADMIN_API_KEYS=ADMIN_KEY) as (_, base):
            images = [noise_png(40 + 4 * i, 48, 300 + i) for i in range(len(BREEDS))]
            buf = io.BytesIO()
            with zipfile.ZipFile(buf, "w") as zf:
                for i, data in enumerate(images):
                    zf.writestr(f"img/{i}.png", data)
                zf.writestr("manifest.csv",
                            "file,breed\n" + "".join(f"img/{i}.png,{b}\n" for i, b in enumerate(BREEDS)))
            with httpx.Client(base_url=base, headers=bearer(ADMIN_KEY), timeout=60) as c:
                c.post("/v1/sets", json={"name": SET}).raise_for_status()
                job = c.post(f"/v1/sets/{SET}/images",
                             files=[("files", ("cats.zip", buf.getvalue(), "application/zip"))])
                assert wait_job(c, job.raise_for_status().json()["id"])["state"] == "succeeded"
            yield base, [decode_image(d).sha256 for d in images]
    except ServerFailed as exc:
        pytest.fail(str(exc))


def recorded(base: str) -> dict[tuple[str, str], tuple[bool, str]]:
    """(sha256, criterion) -> (holds, source), as the server's API lists them."""
    got = httpx.get(f"{base}/v1/sets/{SET}/judgments", params={"limit": 1000}, headers=bearer(ADMIN_KEY))
    got.raise_for_status()
    return {(j["sha256"], j["criterion"]): (j["holds"], j["source"]) for j in got.json()["data"]}


def table_rows(out: str) -> list[list[str]]:
    """The data rows of a printed table (after the header and its dashes), split on runs of 2+ spaces."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if set(line.replace(" ", "")) == {"-"}) + 1
    return [re.split(r" {2,}", line.strip()) for line in lines[start:] if line.strip() and not line.startswith("(")]


def test_judgments_through_the_server(server: tuple[str, list[str]], tmp_path: Path,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    base, shas = server
    remote = ["--server", base, "--api-key", ADMIN_KEY]
    image_ids = {j["sha256"]: j["id"] for j in httpx.get(f"{base}/v1/sets/{SET}/images", headers=bearer(ADMIN_KEY))
                 .json()["data"]}

    assert main(["judgments", "add", SET, "--image", shas[0], "--criterion", " striped ", "--holds", *remote]) == 0
    assert main(["judgments", "add", SET, "--image", str(image_ids[shas[1]]), "--criterion", "striped",
                 "--not-holds", "--author", "ana", *remote]) == 0
    capsys.readouterr()
    assert recorded(base) == {(shas[0], "striped"): (True, "person"), (shas[1], "striped"): (False, "person")}

    assert main(["judgments", "list", SET, *remote]) == 0
    rows = table_rows(capsys.readouterr().out)
    assert sorted((r[2], r[3], r[4], r[5]) for r in rows) == sorted(
        [(shas[0][:12], "striped", "yes", "person"), (shas[1][:12], "striped", "no", "person")])
    assert main(["judgments", "list", SET, "--image", shas[1], *remote]) == 0
    assert [r[6] for r in table_rows(capsys.readouterr().out)] == ["ana"]

    export = tmp_path / "cats.jsonl"
    assert main(["judgments", "export", SET, "-o", str(export), *remote]) == 0
    lines = [json.loads(line) for line in export.read_text().splitlines()]
    assert {(j["sha256"], j["holds"]) for j in lines} == {(shas[0], True), (shas[1], False)}

    assert main(["judgments", "delete", SET, "--all", *remote]) == 2  # no terminal to ask: nothing deleted
    assert len(recorded(base)) == 2
    assert main(["judgments", "delete", SET, "--all", "--yes", *remote]) == 0
    assert "deleted 2 judgments" in capsys.readouterr().out
    assert recorded(base) == {}

    assert main(["judgments", "import", SET, str(export), *remote]) == 0
    assert "recorded 2 judgments from 2 lines" in capsys.readouterr().out
    assert recorded(base) == {(shas[0], "striped"): (True, "person"), (shas[1], "striped"): (False, "person")}

    assert main(["judgments", "derive", SET, "breed", "--statement", "siamese=A siamese cat", "--dry-run",
                 *remote]) == 0
    out = capsys.readouterr().out
    assert sorted(table_rows(out)[:2]) == [["siamese", "A siamese cat", "2", "2"],
                                           ["tabby", "The breed is tabby", "2", "2"]]
    assert "would record (dry run) 8 judgments" in out and len(recorded(base)) == 2
    assert main(["judgments", "derive", SET, "breed", "--statement", "siamese=A siamese cat", *remote]) == 0
    assert "recorded 8 judgments" in capsys.readouterr().out
    derived = {k: v for k, v in recorded(base).items() if v[1] == "derived"}
    assert derived == {(s, c): (holds, "derived") for s, breed in zip(shas, BREEDS, strict=True)
                       for c, holds in (("The breed is tabby", breed == "tabby"),
                                        ("A siamese cat", breed == "siamese"))}

    one = httpx.get(f"{base}/v1/sets/{SET}/judgments", params={"image": shas[0], "criterion": "striped"},
                    headers=bearer(ADMIN_KEY)).json()["data"][0]["id"]
    assert main(["judgments", "delete", SET, str(one), *remote]) == 0
    assert f"deleted judgment {one}" in capsys.readouterr().out
    assert (shas[0], "striped") not in recorded(base) and len(recorded(base)) == 9


def test_errors_come_back_as_cli_errors(server: tuple[str, list[str]], tmp_path: Path,
                                        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    base, shas = server
    monkeypatch.delenv("RUBRICSEARCH_CLIENT_URL", raising=False)
    assert main(["judgments", "list", SET]) == 2
    assert "give --server URL" in capsys.readouterr().err
    remote = ["--server", base, "--api-key", ADMIN_KEY]
    assert main(["judgments", "list", "no-such-set", *remote]) == 2
    assert "error (not_found)" in capsys.readouterr().err
    before = recorded(base)
    assert main(["judgments", "add", SET, "--image", "9" * 64, "--criterion", "x", "--holds", *remote]) == 2
    assert "error (not_found)" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"sha256": shas[0], "criterion": "ok", "holds": True}) + "\n"
                   + json.dumps({"sha256": shas[1], "criterion": "ok", "holds": "maybe"}) + "\n")
    assert main(["judgments", "import", SET, str(bad), *remote]) == 2
    assert "line 2" in capsys.readouterr().err
    assert main(["judgments", "derive", SET, "no-such-field", *remote]) == 2
    assert "error (invalid_input)" in capsys.readouterr().err
    assert recorded(base) == before  # every refused request changed nothing
