"""Training jobs of the admin API: a set's reranker or embedder fine-tuned from its judgments off the event loop, with
progress, cancel, resume, and a registered version at the end.

A job runs on a thread of the process that started (or resumed) it; the steps run, validation loss, rate and
ETA are written to the job's catalog row at every step, so any process reads them. Cancel sets the job's flag:
the trainer stops at its next step and no version is written (the version is saved only after training, into
a temporary folder renamed when complete). Resume restarts the job cleanly from step 0 with its recorded
settings, seed and judgment snapshot: the trainer's state (best adapters, early-stopping count, data order, LR
schedule) lives in memory, and with the same seed and data a clean restart makes the same version as an
uninterrupted run, which a checkpoint of part of that state would not promise.
"""

from __future__ import annotations

import logging
import shutil
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.services import worker_id
from rubricsearch.app.training import judged_cells, train_set
from rubricsearch.indexer.catalog import JobRecord, SetRecord, get_set, list_judgments
from rubricsearch.indexer.catalog.sets import new_id
from rubricsearch.indexer.catalog.tables import JobState, utcnow
from rubricsearch.indexer.catalog.versions import (
    ModelName,
    add_version,
    cancel_training_job,
    create_training_job,
    finish_training_job,
    record_progress,
    reopen_training_job,
    start_training_job,
    touch_training_job,
    training_job,
)
from rubricsearch.rerank.tuning.cells import example, split_by_reference
from rubricsearch.retrieval.errors import (
    BackendUnavailable,
    Conflict,
    InvalidInput,
    NotFound,
    RubricSearchError,
)
from rubricsearch.retrieval.tuning.contrastive import AT
from rubricsearch.retrieval.tuning.contrastive import split as contrastive_split
from rubricsearch.retrieval.tuning.loop import Progress
from rubricsearch.retrieval.tuning.settings import TuningSettings

if TYPE_CHECKING:  # app.state builds this module's service
    from rubricsearch.app.state import AppState

log = logging.getLogger("rubricsearch.training")

VERSIONS_DIR = "versions"  # under the data dir: versions/<set id>/<version id>/
HEARTBEAT_S = 10.0  # a running job's row is touched this often between steps too
STALE_S = 60.0  # a running job whose row was not touched for this long was left by a stopped process


# each trainer's held-out metric (Progress.metric): its name in the progress detail, and which value is better
VALIDATION: dict[str, tuple[str, Callable[[float, float], float]]] = {"log-loss": ("log_loss", min),
                                                                      f"ndcg@{AT}": ("ndcg", max)}


class Cancelled(Exception):
    """Raised from the progress callback: the trainer stops at this step and saves nothing."""


class TrainingJobs:
    """Starts, follows, cancels and resumes training jobs; one per process (AppState holds it)."""

    def __init__(self, state: AppState) -> None:
        self.state = state
        self.worker = f"{worker_id(state.settings)}:train"
        self._threads: dict[str, threading.Thread] = {}
        self._lock = threading.Lock()
        self._stopping = threading.Event()

    def versions_dir(self, set_id: str) -> Path:
        return Path(self.state.settings.data_dir) / VERSIONS_DIR / set_id

    def start(self, set_record: SetRecord, tuning: TuningSettings, model: ModelName = "reranker") -> JobRecord:
        """Check the settings and the judgments, record the job (409 while another of the set runs) and start it
        (``model``: which of the set's models it fine-tunes). Bad input raises before anything is written."""
        self._require(model)
        tuning.check()
        cells = judged_cells(self.state, set_record)
        if not cells:
            raise InvalidInput("the set has no judgments of indexed references to train on: record judgments first",
                               set_id=set_record.id)
        if len({c.holds for c in cells}) < 2:
            raise InvalidInput("every judgment of the set answers the same: training needs yes and no judgments",
                               set_id=set_record.id, judgments=len(cells))
        # halves that cannot train: refused now
        if model == "embedder":
            contrastive_split(cells, tuning.seed)
        else:
            split_by_reference([example(c) for c in cells], tuning.seed)
        with self.state.catalog.read() as session:
            upto = max(j.id for j in list_judgments(session, set_record.id))
        options = {"model": model, "settings": tuning.read_by(model), "max_judgment_id": upto}
        with self.state.catalog.write() as session:
            job = create_training_job(session, set_record.id, tuning.steps, options)
        self._launch(job.id)
        return job

    def get(self, job_id: str, set_id: str | None = None) -> JobRecord:
        with self.state.catalog.read() as session:
            job = training_job(session, job_id)
        if set_id is not None and job.set_id != set_id:
            raise NotFound("training job not found in this set", job_id=job_id, set_id=set_id)
        return job

    def cancel(self, job_id: str) -> JobRecord:
        with self.state.catalog.write() as session:
            return cancel_training_job(session, job_id)

    def resume(self, job_id: str) -> JobRecord:
        """Run a cancelled, failed or interrupted job again from step 0 (its settings and judgment snapshot)."""
        if self.running(job_id):
            raise Conflict("the job is still stopping in this process: resume it once it has", job_id=job_id)
        self._require(self.get(job_id).options.get("model", "reranker"))
        with self.state.catalog.write() as session:
            job = reopen_training_job(session, job_id, utcnow() - timedelta(seconds=STALE_S))
        self._launch(job.id)
        return job

    def _require(self, model: ModelName) -> None:
        """A version is compared, activated and served by the process holding its model: a job runs there."""
        loaded = self.state.embedder_ if model == "embedder" else self.state.reranker_
        if loaded is None:
            raise BackendUnavailable(f"training the {model} needs the {model} loaded in this process (a version is "
                                     "compared and served with the model it was trained from)", model=model)

    def running(self, job_id: str) -> bool:
        with self._lock:
            thread = self._threads.get(job_id)
        return thread is not None and thread.is_alive()

    def close(self, timeout_s: float = 30.0) -> None:
        """Stop: running jobs are cancelled at their next step (resume runs them again)."""
        self._stopping.set()
        with self._lock:
            threads = list(self._threads.values())
        for thread in threads:
            thread.join(timeout_s)

    def _launch(self, job_id: str) -> None:
        thread = threading.Thread(target=self._run, args=(job_id,), name=f"train-{job_id[:8]}", daemon=True)
        with self._lock:
            self._threads = {k: t for k, t in self._threads.items() if t.is_alive()}
            self._threads[job_id] = thread
        thread.start()

    def _run(self, job_id: str) -> None:
        catalog = self.state.catalog
        try:
            with catalog.write() as session:
                job = start_training_job(session, job_id, self.worker)
            with catalog.read() as session:
                set_record = get_set(session, job.set_id)
        except RubricSearchError as exc:  # cancelled before it started, or the set was deleted
            log.warning("training job %s cannot start: %s", job_id, exc.message)
            return
        tuning = TuningSettings(**job.options["settings"])
        model: ModelName = job.options.get("model", "reranker")
        version_id = new_id()
        out = self.versions_dir(set_record.id) / version_id
        beat = threading.Event()
        ticker = threading.Thread(target=self._heartbeat, args=(job_id, beat), daemon=True)
        ticker.start()
        tracker = _Tracker(tuning.steps)

        def progress(p: Any) -> None:
            detail = tracker.step(p)
            with catalog.write() as session:
                cancel = record_progress(session, job_id, p.step, detail)
            if cancel or self._stopping.is_set():
                raise Cancelled

        try:
            card = train_set(self.state, set_record, out, tuning, progress=progress,
                             kind="embedding" if model == "embedder" else "reranker",
                             upto=job.options["max_judgment_id"])
            with catalog.write() as session:
                add_version(session, set_record.id, model, str(out), card, version_id=version_id, job_id=job_id)
                record_progress(session, job_id, card["training"]["steps_run"],
                                {**tracker.last, "version_id": version_id, "vision_encodes": card["vision_encodes"],
                                 "metrics": card["metrics"], "wall_s": card["wall_s"]})
                finish_training_job(session, job_id, JobState.SUCCEEDED)
        except Cancelled:
            self._finish(job_id, JobState.CANCELLED, None)
        except RubricSearchError as exc:
            shutil.rmtree(out, ignore_errors=True)  # registered nowhere (the set went, or the catalog failed)
            self._finish(job_id, JobState.FAILED, f"{exc.kind}: {exc.message}")
        except Exception as exc:
            shutil.rmtree(out, ignore_errors=True)
            log.exception("training job %s failed", job_id)
            self._finish(job_id, JobState.FAILED, f"internal: {exc}")
        finally:
            beat.set()

    def _finish(self, job_id: str, state: JobState, error: str | None) -> None:
        try:
            with self.state.catalog.write() as session:
                finish_training_job(session, job_id, state, error)
        except NotFound:  # the set (and its jobs) were deleted meanwhile
            pass

    def _heartbeat(self, job_id: str, done: threading.Event) -> None:
        while not done.wait(HEARTBEAT_S):
            try:
                with self.state.catalog.write() as session:
                    touch_training_job(session, job_id)
            except RubricSearchError:
                return


class _Tracker:
    """The progress detail: steps, losses, the measured rate and the ETA at that rate."""

    def __init__(self, steps: int) -> None:
        self.steps, self.started = steps, time.monotonic()
        self.first: tuple[int, float] | None = None  # the rate is measured from the first step (not the loading)
        self.validation: float | None = None
        self.best: float | None = None
        self.last: dict[str, Any] = {}

    def step(self, p: Progress) -> dict[str, Any]:
        now = time.monotonic()
        elapsed = now - self.started
        self.first = self.first or (p.step, now)
        rate = (p.step - self.first[0]) / (now - self.first[1]) if now > self.first[1] else None
        name, best = VALIDATION[p.metric]
        if p.validation is not None:
            self.validation = p.validation
            self.best = p.validation if self.best is None else best(self.best, p.validation)
        self.last = {"loss": round(p.loss, 5), f"validation_{name}": self.validation,
                     f"best_validation_{name}": self.best,
                     "steps_per_s": round(rate, 4) if rate else None,
                     "eta_s": round((self.steps - p.step) / rate, 1) if rate else None,
                     "elapsed_s": round(elapsed, 2)}
        return self.last
