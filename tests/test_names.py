"""Names on the way in: set names, uploaded file names and zip entries are stored in NFC without control, bidi or
zero-width characters, so look-alike set names are one name and no escape sequence or override reaches a
terminal or a page."""

from __future__ import annotations

import unicodedata
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from rubricsearch.app.state import AppState
from rubricsearch.indexer.jobs import IngestionService
from rubricsearch.indexer.names import clean_name
from tests.api_helpers import ADMIN_KEY, bearer, built_state, client_for
from tests.conftest import noise_png
from tests.test_ingestion import items, make_service, runner, zip_of  # noqa: F401  (the fixture)

ADMIN = bearer(ADMIN_KEY)


def test_clean_name() -> None:
    nfd = unicodedata.normalize("NFD", "café")
    assert nfd != "café" and clean_name(nfd) == "café"
    assert clean_name("ca\u200bts\ufeff") == "cats"
    assert clean_name("photo\u202egnp.exe") == "photognp.exe"
    assert clean_name("red\x1b[31m\x07\x9b.png") == "red[31m.png"
    assert clean_name("  \u2066x\u2069 ") == "x"
    assert clean_name("c\u0430ts") != "cats"  # a Cyrillic а is another letter, kept


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
          ) -> Iterator[AppState]:
    yield from built_state(tmp_path_factory, "names", tiny_embedding_dir, tiny_reranker_dir)


def test_look_alike_set_names_are_one_name(state: AppState) -> None:
    client = client_for(state)
    made = client.post("/v1/sets", json={"name": "café\u202e"}, headers=ADMIN)
    assert made.status_code == 201 and made.json()["name"] == "café"
    for twin in (unicodedata.normalize("NFD", "café"), "caf\u200bé", "\u2066café\u2069"):
        again = client.post("/v1/sets", json={"name": twin}, headers=ADMIN)
        assert again.status_code == 409, (twin, again.text)
    assert client.get("/v1/sets/" + unicodedata.normalize("NFC", "café")).status_code == 200
    empty = client.post("/v1/sets", json={"name": "\u200b\u202e"}, headers=ADMIN)
    assert empty.status_code == 422


def test_zip_entries_and_upload_names_lose_control_and_bidi_characters(
        make_service: Callable[..., IngestionService]) -> None:  # noqa: F811
    service = make_service()
    ref = service.create_set("files\x1b[2J")
    assert ref.name == "files[2J"
    archive = zip_of({"evil\x1b]0;owned\x07.png": noise_png(20, 20, seed=1),
                      "report\u202egnp.exe.png": noise_png(21, 21, seed=2)})
    job = service.create_job_from_zip(ref.id, archive, name="a.zip")
    refs = [i.source_ref for i in items(service, job.id)]
    assert sorted(refs) == ["evil]0;owned.png", "reportgnp.exe.png"]
    up = service.create_job_from_uploads(ref.id, [("x\u200f\x1b.png", noise_png(22, 22, seed=3))])
    assert [i.source_ref for i in items(service, up.id)] == ["x.png"]
    assert runner(service).run_until_idle() == 3  # the entries are read under their clean names
    assert service.get_job(job.id).done == 2
