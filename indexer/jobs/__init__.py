"""Ingestion jobs: durable staging, batched crash-safe processing, workers, deletes and reconciliation.

The API and CLI use :class:`IngestionService` (create/follow/cancel jobs, delete images and sets,
reconcile); a process that indexes runs an :class:`IngestionRunner` (``recover()`` then ``start()``, or
``run_until_idle()`` in the foreground).
"""

from indexer.jobs.model import STAGES, StageTimes, describe
from indexer.jobs.pipeline import BatchProcessor, BatchResult
from indexer.jobs.reconcile import ReconcileReport, SweepReport, reconcile_set, sweep
from indexer.jobs.runner import IngestionRunner, RecoveryReport, default_worker_id
from indexer.jobs.service import IngestionService, SetDeletion
from indexer.jobs.sources import JobSources
from indexer.jobs.staging import StagedUploadSource, Staging

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
    "default_worker_id",
    "describe",
    "reconcile_set",
    "sweep",
]
