"""The one zip intake (indexer/jobs/intake.py): what the API's upload and the CLI hand in becomes one job, every
archive read through ZipSource, with the refusals each entrance shows its user."""

from __future__ import annotations

import io
from collections.abc import Callable
from typing import BinaryIO

import pytest

from rubricsearch.indexer.jobs import IngestionService, create_job_from_files
from rubricsearch.retrieval.errors import InvalidInput, InvalidMetadata, PayloadTooLarge, UnsupportedMedia
from tests.conftest import noise_png
from tests.test_ingestion import make_service, zip_of  # noqa: F401 - the fixture

MANIFEST = b"file,label\nz/a.png,Tabby\n"


def files(*named: tuple[str, bytes]) -> list[tuple[str | None, BinaryIO]]:
    return [(name, io.BytesIO(data)) for name, data in named]


@pytest.fixture
def service(make_service: Callable[..., IngestionService]) -> IngestionService:  # noqa: F811
    return make_service()


def test_a_lone_archive_is_a_zip_job_with_its_manifest(service: IngestionService) -> None:
    ref = service.create_set("lone", embedding_dim=64)
    archive = zip_of({"z/a.png": noise_png(20, 20, 1), "z/b.png": noise_png(20, 22, 2), "manifest.csv": MANIFEST})
    job = create_job_from_files(service, ref.id, files(("cats.zip", archive)))
    assert (job.kind, job.total, job.options["archive_name"]) == ("zip", 2, "cats.zip")
    assert job.options["manifest"] == {"name": "manifest.csv", "images": 1}
    metas = {item.source_ref: item.meta for item in service.job_items(job.id)}
    assert metas == {"z/a.png": {"label": "Tabby"}, "z/b.png": None}


def test_archives_sent_with_other_files_expand_into_one_upload_job(service: IngestionService) -> None:
    ref = service.create_set("mixed", embedding_dim=64)
    archive = zip_of({"z/a.png": noise_png(20, 20, 3), "z/notes.txt": b"hi"})
    job = create_job_from_files(service, ref.id, files(("x.png", noise_png(20, 20, 4)), ("more.zip", archive)))
    assert (job.kind, job.total) == ("upload", 2)
    assert sorted(item.source_ref for item in service.job_items(job.id)) == ["a.png", "x.png"]


def test_what_a_mixed_request_cannot_carry_is_refused_whole(service: IngestionService) -> None:
    ref = service.create_set("refused", embedding_dim=64)
    image = ("x.png", noise_png(20, 20, 5))
    with pytest.raises(InvalidMetadata, match="uploaded on its own"):
        create_job_from_files(service, ref.id, files(image, ("m.zip", zip_of({"manifest.csv": MANIFEST}))))
    with pytest.raises(InvalidInput, match=r"entry '\.\./evil\.png' cannot be read .*on its own"):
        create_job_from_files(service, ref.id, files(image, ("bad.zip", zip_of({"../evil.png": image[1]}))))
    big = zip_of({f"z/{i}.png": noise_png(40, 40, 10 + i) for i in range(3)})
    expanded = len(image[1]) + sum(len(noise_png(40, 40, 10 + i)) for i in range(3))
    with pytest.raises(PayloadTooLarge, match="expand to more than"):
        create_job_from_files(service, ref.id, files(image, ("big.zip", big)), max_expanded_bytes=expanded - 1)
    job = create_job_from_files(service, ref.id, files(image, ("big.zip", big)), max_expanded_bytes=expanded)
    assert job.total == 4
    with pytest.raises(InvalidMetadata, match="not in the `metadata` field"):
        create_job_from_files(service, ref.id, files(image, ("big.zip", big)), {"x.png": {"label": "x"}})
    with pytest.raises(InvalidMetadata, match="a manifest is not an image"):
        create_job_from_files(service, ref.id, files(image, ("manifest.csv", MANIFEST)))
    with pytest.raises(UnsupportedMedia, match=r"only \.zip archives are read"):
        create_job_from_files(service, ref.id, files(image, ("more.tar.gz", b"\x1f\x8b")))
    with pytest.raises(InvalidInput, match="not a zip file"):
        create_job_from_files(service, ref.id, files(("broken.zip", b"PK\x03\x04junk")))
    assert [j.id for j in service.list_jobs(set_id=ref.id)] == [job.id]  # nothing else was queued
