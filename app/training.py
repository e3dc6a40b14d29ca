"""Fine-tuning the serving reranker on a set's judgments, as the product runs it: which checkpoint, which cells,
which packages, and where the new version goes.

The cells are the set's judgments of indexed references (their packages exist, as for a calibration refit);
the packages are read from the data dir's store under the checkpoint's tower and the serving preprocessing
(:func:`app.model_loading.model_config`), so training finds exactly the packages search reads. The checkpoint
is the configured reranker, or the one that serves in its place in this data dir (the demo's trained model).
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.model_loading import model_config
from rubricsearch.app.plugins import first
from rubricsearch.app.settings import Settings
from rubricsearch.indexer.catalog import ImageStatus, SetRecord, get_images, list_judgments
from rubricsearch.rerank.tuning import JudgedCell, Progress, TuningSettings, fine_tune_reranker, save_version
from rubricsearch.retrieval.errors import BackendUnavailable, Conflict

if TYPE_CHECKING:  # app.state builds the training jobs, which use this module
    from rubricsearch.app.state import AppState


def judged_cells(state: AppState, set_record: SetRecord, upto: int | None = None,
                 ids: Collection[int] | None = None) -> list[JudgedCell]:
    """The set's judgments of indexed references, in id order (references not indexed have no package yet):
    those with id <= ``upto`` (a job's data snapshot) or in ``ids`` when given."""
    with state.catalog.read() as session:
        judgments = [j for j in list_judgments(session, set_record.id)
                     if (upto is None or j.id <= upto) and (ids is None or j.id in ids)]
        images = get_images(session, {j.image_id for j in judgments})
    return [JudgedCell(j.id, images[j.image_id].sha256, j.criterion, j.holds) for j in judgments
            if j.image_id in images and images[j.image_id].status == ImageStatus.INDEXED]


def reranker_checkpoint(settings: Settings, model: str | None = None) -> Path:
    """The local folder of the reranker to fine-tune: ``model``, else the configured one (a folder or a hub id in
    the local cache), else the checkpoint a plug-in serves in its place in this data dir (the demo's)."""
    name = model or settings.models.reranker_model
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if model is None:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:  # not in the cache (or not a hub id): a plug-in's checkpoint may serve instead
            fallback = first(lambda plugin: plugin.fallback_model(settings.data_dir, "reranker"))
            if fallback is not None:
                return Path(fallback)
    raise BackendUnavailable(f"the reranker {name!r} is not a local checkpoint here: fine-tuning needs its files "
                             "(give --model DIR)", model=name)


def train_set(state: AppState, set_record: SetRecord, out: Path, tuning: TuningSettings, *,
              model: str | None = None, progress: Callable[[Progress], None] | None = None,
              upto: int | None = None) -> dict[str, Any]:
    """Fine-tune the reranker on the set's judgments (those with id <= ``upto`` when given) and save the version
    to the new folder ``out``; returns the card, whose data names the held-out (validation) judgments that an
    activation compares versions on. Nothing is written unless training succeeds (and never over an existing
    folder)."""
    if out.exists():
        raise Conflict("the version folder exists already: a version is never overwritten; name a new one",
                       out=str(out))
    tuning.check()
    base = reranker_checkpoint(state.settings, model)
    config = model_config(state.settings, "reranker", "local")
    tuned = fine_tune_reranker(base, judged_cells(state, set_record, upto), state.store, settings=tuning,
                               vision=config.vision, device=state.settings.models.device, progress=progress)
    held_out = sorted(e.cell.judgment_id for e in tuned.split.validation)
    return save_version(tuned, out, about={"set_id": set_record.id, "set_name": set_record.name,
                                           "validation_judgment_ids": held_out})
