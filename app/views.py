"""The API views of catalog records that several routes (and the CLI) return: jobs and images."""

from __future__ import annotations

from rubricsearch.app.schemas.images import ImageOut
from rubricsearch.app.schemas.jobs import JobErrorOut, JobIgnoredOut, JobManifestOut, JobOut
from rubricsearch.indexer.catalog import ImageRecord, ItemState, JobRecord
from rubricsearch.indexer.catalog.versions import TRAIN
from rubricsearch.indexer.jobs import IngestionService

MAX_ERRORS = 100


def job_errors(service: IngestionService, job: JobRecord) -> list[JobErrorOut]:
    errors = [JobErrorOut(ref="", error=job.error)] if job.error else []
    if job.failed:
        failed = service.job_items(job.id, states=[ItemState.FAILED], limit=MAX_ERRORS)
        errors += [JobErrorOut(ref=i.source_ref, error=i.error or "failed") for i in failed]
    return errors[:MAX_ERRORS]


def job_source(job: JobRecord) -> str:
    """A short human description of what the job reads (its options hold the details)."""
    options = job.options
    if job.kind == "zip":
        return str(options.get("archive_name") or "archive.zip")
    if job.kind == "folder":
        return str(options.get("path") or "folder")
    if job.kind == "url":
        n = int(options.get("urls", job.total))
        return f"{n} URL{'' if n == 1 else 's'}"
    if job.kind == "upload":
        n = int(options.get("files", job.total))
        return f"{n} uploaded file{'' if n == 1 else 's'}"
    if job.kind == TRAIN:  # total and done count its steps
        return f"the set's judgments up to id {options.get('max_judgment_id')}"
    return job.kind


def job_out(service: IngestionService, job: JobRecord) -> JobOut:
    ignored = [JobIgnoredOut(ref=str(e.get("ref", "")), reason=str(e.get("reason", "")))
               for e in job.options.get("skipped_entries", []) if isinstance(e, dict)]
    manifest = job.options.get("manifest")
    return JobOut(id=job.id, set_id=job.set_id, kind=job.kind, state=job.state.value, total=job.total,
                  done=job.done, failed=job.failed, skipped=job.skipped, progress=round(job.progress, 4),
                  errors=job_errors(service, job), source=job_source(job),
                  manifest=JobManifestOut.model_validate(manifest) if isinstance(manifest, dict) else None,
                  ignored=int(job.options.get("source_skipped", len(ignored))), ignored_entries=ignored,
                  created_at=job.created_at, started_at=job.started_at, finished_at=job.finished_at,
                  paused=None if job.finished else service.paused)


def image_out(record: ImageRecord) -> ImageOut:
    sha = record.sha256
    return ImageOut(id=record.id, sha256=sha, original_name=record.original_name, width=record.width,
                    height=record.height, byte_size=record.byte_size, status=record.status.value,
                    error=record.error, source=record.source.value, created_at=record.created_at,
                    url=f"/v1/images/{sha}", thumbnail_url=f"/v1/images/{sha}/thumbnail", metadata=record.meta,
                    facets={k: {"value": v["value"], "p": v["p"], "probs": v["probs"]}
                            for k, v in record.facets.items() if isinstance(v, dict)})
