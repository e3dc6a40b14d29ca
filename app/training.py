"""Fine-tuning a serving model on a set's judgments, as the product runs it: which checkpoint, which cells,
which packages, and where the new version goes.

The cells are the set's judgments of indexed references (their packages exist, as for a calibration refit);
the packages are read from the data dir's store under the checkpoint's tower and the serving preprocessing
(:func:`app.model_loading.model_config`), so training finds exactly the packages search reads. The checkpoint
is the configured model of that kind, or the one that serves in its place in this data dir (the demo's trained
model).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.model_loading import ModelKind, model_config
from rubricsearch.app.plugins import first
from rubricsearch.app.settings import Settings
from rubricsearch.indexer.catalog import ImageStatus, SetRecord, get_images, list_judgments
from rubricsearch.rerank.tuning import fine_tune_reranker, save_version
from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.tuning.embedder import fine_tune_embedder, save_embedder_version
from rubricsearch.retrieval.tuning.judgments import JudgedCell
from rubricsearch.retrieval.tuning.loop import Progress
from rubricsearch.retrieval.tuning.settings import TuningSettings
from rubricsearch.retrieval.tuning.version import refuse_existing

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


def checkpoint(settings: Settings, kind: ModelKind, model: str | None = None) -> Path:
    """The local folder of the model to fine-tune: ``model``, else the configured one of ``kind`` (a folder or a
    hub id in the local cache), else the checkpoint a plug-in serves in its place in this data dir (the demo's)."""
    name = model or (settings.models.reranker_model if kind == "reranker" else settings.models.embedding_model)
    path = Path(name).expanduser()
    if path.is_dir() and (path / "config.json").exists():
        return path
    if model is None:
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(name, local_files_only=True))
        except Exception:  # not in the cache (or not a hub id): a plug-in's checkpoint may serve instead
            fallback = first(lambda plugin: plugin.fallback_model(settings.data_dir, kind))
            if fallback is not None:
                return Path(fallback)
    raise BackendUnavailable(f"the {kind} model {name!r} is not a local checkpoint here: fine-tuning needs its "
                             "files (give the base checkpoint's folder)", model=name)


def train_set(state: AppState, set_record: SetRecord, out: Path, tuning: TuningSettings, *,
              kind: ModelKind = "reranker", model: str | None = None,
              progress: Callable[[Progress], None] | None = None, upto: int | None = None) -> dict[str, Any]:
    """Fine-tune the ``kind`` model (``model``: its base checkpoint, default the serving one) on the set's
    judgments (those with id <= ``upto`` when given) and save the version to the new folder ``out``; returns the
    card, whose data names the held-out (validation) judgments that an activation compares versions on. Nothing is
    written unless training succeeds (and never over an existing folder)."""
    refuse_existing(out)
    tuning.check()
    base = checkpoint(state.settings, kind, model)
    config = model_config(state.settings, kind, "local")
    cells = judged_cells(state, set_record, upto)
    if kind == "embedding":
        tuned_embedder = fine_tune_embedder(base, cells, state.store, settings=tuning, vision=config.vision,
                                            local=config.local, progress=progress)
        held_out = [c.judgment_id for c in cells if c.sha256 in tuned_embedder.validation_references]
        return save_embedder_version(tuned_embedder, out, _about(set_record, held_out))
    tuned = fine_tune_reranker(base, cells, state.store, settings=tuning, vision=config.vision, local=config.local,
                               progress=progress)
    return save_version(tuned, out, _about(set_record, [e.cell.judgment_id for e in tuned.split.validation]))


def _about(set_record: SetRecord, held_out: Sequence[int]) -> dict[str, Any]:
    return {"set_id": set_record.id, "set_name": set_record.name, "validation_judgment_ids": sorted(held_out)}
