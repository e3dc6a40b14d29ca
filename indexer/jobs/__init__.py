"""Ingestion jobs: durable staging, batched crash-safe processing, workers, deletes and reconciliation.

The API and CLI use :class:`IngestionService` (create/follow/cancel jobs, delete images and sets,
reconcile) and hand the files a person gives to :func:`create_job_from_files` (where every zip enters); a
process that indexes runs an :class:`IngestionRunner` (``recover()`` then ``start()``, or ``run_until_idle()`` in
the foreground).
"""

from rubricsearch.indexer.jobs.intake import create_job_from_files, is_zip
from rubricsearch.indexer.jobs.model import STAGES, StageTimes, describe
from rubricsearch.indexer.jobs.pipeline import BatchProcessor, BatchResult
from rubricsearch.indexer.jobs.reconcile import ReconcileReport, SweepReport, reconcile_set, sweep
from rubricsearch.indexer.jobs.runner import IngestionRunner, RecoveryReport, default_worker_id
from rubricsearch.indexer.jobs.service import IngestionService, SetDeletion
from rubricsearch.indexer.jobs.sources import JobSources
from rubricsearch.indexer.jobs.staging import StagedUploadSource, Staging

__all__ = [
    "STAGES",
    "BatchProcessor",
    "BatchResult",
    "IngestionRunner",
    "IngestionService",
    "JobSources",
    "ReconcileReport",
    "RecoveryReport",
    "SetDeletion",
    "StageTimes",
    "StagedUploadSource",
    "Staging",
    "SweepReport",
    "create_job_from_files",
    "default_worker_id",
    "describe",
    "is_zip",
    "reconcile_set",
    "sweep",
]
