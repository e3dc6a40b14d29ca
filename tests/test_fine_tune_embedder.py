"""Fine-tuning the embedder from judgments and cached packages (retrieval/tuning/embedder.py), on the tiny
random-weight checkpoint.

One training run (a few steps) is shared by the tests that read its version; the error tests stop before any
training. What is promised: training runs the product's embedding forward, the version loads as an embedder and
reads the base's packages, its card says what made it, no reference went through the vision tower, the tower (so
every package) is unchanged, validation references are not trained on, and bad input changes nothing on disk.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.retrieval.embedding import load_embedder
from rubricsearch.retrieval.errors import Conflict
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.tuning import embedder as embedder_module
from rubricsearch.retrieval.tuning.contrastive import Criterion, criteria, hard_negatives, query_instruction, ranking
from rubricsearch.retrieval.tuning.embedder import (
    TunedEmbedder,
    embedding_vectors,
    fine_tune_embedder,
    save_embedder_version,
)
from rubricsearch.retrieval.tuning.judgments import JudgedCell, reference
from rubricsearch.retrieval.tuning.version import CARD
from tests.fine_tune_worlds import CPU, CRITERIA, SETTINGS, UNPACKAGED, World, world_of


@pytest.fixture(scope="module")
def world(tiny_embedding_dir: Path, tiny_reranker_other_tower_dir: Path, make_png: Callable[..., bytes]) -> World:
    return world_of("embedding", tiny_embedding_dir, tiny_reranker_other_tower_dir, make_png, 16)


@pytest.fixture(scope="module")
def trained(world: World, tmp_path_factory: pytest.TempPathFactory) -> tuple[TunedEmbedder, Path, dict[str, Any]]:
    # without the pull to the base's vectors: four steps on a random model then keep moving (the pull's early
    # stopping would keep the base, and these tests read what training changed)
    tuned = fine_tune_embedder(world.base, [*world.cells, UNPACKAGED], world.store, settings=SETTINGS, local=CPU,
                               pull=0.0)
    out = tmp_path_factory.mktemp("versions") / "embedder-v1"
    return tuned, out, save_embedder_version(tuned, out)



def assert_vectors_of(version_dir: Path, state: Any, record: Any, shas: list[str], vectors: Any) -> None:
    """The set's vectors are the version's embeddings of its references, from their packages (0 encodes)."""
    version = load_embedder(version_dir, store=state.store, device="cpu")
    usage = Usage()
    expected = version.embed_contents([Content(images=[reference(s)]) for s in shas], [None] * len(shas),
                                      dimensions=state.index.dim(record.id), usage=usage)
    assert usage.total() == 0
    for i, sha in enumerate(shas):
        np.testing.assert_allclose(vectors[sha], expected[i], atol=1e-5)

def test_the_training_forward_is_the_products_embedding(world: World) -> None:
    """The vectors trained on are the ones search and ingestion get: the criterion under search's instruction and
    the references under the default one, through the product's embedder."""
    embedder = load_embedder(world.base, store=world.store, device="cpu")
    runtime = embedder.runtime
    shas = list(world.images)[:5]
    contents = [Content(texts=[CRITERIA[0]]), *(Content(images=[reference(s)]) for s in shas)]
    instructions = [query_instruction(CRITERIA[0]), *([None] * len(shas))]
    trained = embedding_vectors(runtime, contents, instructions)
    served = embedder.embed_contents(contents, instructions)
    np.testing.assert_allclose(trained.detach().numpy(), served, atol=1e-5)
    assert trained.requires_grad, "the training forward carries gradients"
    # a different instruction gives other vectors: the comparison above can fail
    other = embedding_vectors(runtime, contents[:1], [None])
    assert not np.allclose(other.detach().numpy(), served[:1], atol=1e-5)


def test_the_version_loads_as_an_embedder_and_embeds_the_bases_packages(world: World, trained: Any) -> None:
    _, out, _ = trained
    docs = [Content(images=[reference(s)]) for s in list(world.images)[:6]]
    base = load_embedder(world.base, store=world.store, device="cpu")
    version = load_embedder(out, store=world.store, device="cpu")
    usage = Usage()
    before = base.embed_contents(docs, [None] * len(docs), usage=usage)
    after = version.embed_contents(docs, [None] * len(docs), usage=usage)
    assert usage.total() == 0, "the version reads the base's packages: no reference is encoded again"
    assert after.shape == before.shape
    assert np.abs(after - before).max() > 1e-6, "the merged adapters change the vectors"


def test_card_records_base_data_settings_metrics_and_time(world: World, trained: Any) -> None:
    _, out, written = trained
    on_disk = json.loads((out / CARD).read_text())
    assert on_disk == written
    assert on_disk["kind"] == "embedder" and on_disk["base_model"] == str(world.base.resolve())
    assert on_disk["data"]["judgment_ids"] == sorted(c.judgment_id for c in world.cells)
    assert on_disk["data"]["max_judgment_id"] == UNPACKAGED.judgment_id
    assert on_disk["data"]["skipped_without_package"] == 1
    assert {k: on_disk["settings"][k] for k in ("rank", "alpha", "lr", "steps", "seed", "temperature")} == {
        "rank": 8, "alpha": 32, "lr": 1e-3, "steps": 4, "seed": 3, "temperature": 0.1}
    # the pull's weight is the embedder's own setting; the reranker's preserve is not in its card
    assert on_disk["settings"]["pull"] == 0.0 and on_disk["settings"]["anchors"] > 0
    assert "preserve" not in on_disk["settings"]
    for side in ("before", "after"):
        metrics = on_disk["metrics"][side]
        assert metrics["queries"] == on_disk["data"]["validation_queries"] > 0
        assert metrics["references"] == on_disk["data"]["validation_references"] > 0
        assert 0.0 <= metrics["recall@10"] <= 1.0 and 0.0 < metrics["ndcg@10"] <= 1.0 and metrics["infonce"] > 0
    assert 1 <= on_disk["training"]["steps_run"] <= 4
    assert on_disk["wall_s"] > 0 and on_disk["training"]["dtype"] == "float32"
    assert not list(out.parent.glob(".*partial*")), "no temporary folder is left behind"


def test_training_runs_no_vision_encode(trained: Any) -> None:
    tuned, _, written = trained
    assert tuned.vision_encodes == 0 and written["vision_encodes"] == 0


def test_the_encode_counter_sees_a_trainer_that_runs_the_tower(world: World, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A broken copy that re-encodes its positives on every step is counted (so the 0 above means 0)."""
    original = embedder_module._Trainer.loss

    def reencoding(self: Any, batch: Any) -> torch.Tensor:
        self.runtime.vision.encode([world.images[p.positive] for p in batch])
        return original(self, batch)

    monkeypatch.setattr(embedder_module._Trainer, "loss", reencoding)
    tuned = fine_tune_embedder(world.base, world.cells, world.store, settings=replace(SETTINGS, steps=1),
                               local=CPU)
    assert tuned.vision_encodes > 0


def test_the_tower_and_so_every_package_is_unchanged(world: World, trained: Any) -> None:
    _, out, written = trained
    base, version = load_qwen(world.base, device="cpu"), load_qwen(out, device="cpu")
    assert version.tower_hash == base.tower_hash == written["tower_hash"]
    base_lm = dict(base.model.language_model.named_parameters())
    assert [n for n, p in version.model.language_model.named_parameters() if not torch.equal(p, base_lm[n])]
    embedder = load_embedder(out, store=world.store, device="cpu")
    assert embedder.packages.fingerprint is not None
    assert embedder.packages.fingerprint.digest() == written["package_fingerprint"]
    assert len(embedder.packages.find([reference(s) for s in world.images])) == len(world.images)


def test_validation_references_are_never_trained_on(trained: Any, world: World) -> None:
    tuned, _, written = trained
    assert not tuned.train_references & tuned.validation_references
    assert tuned.train_references | tuned.validation_references == set(world.images)
    assert written["data"]["train_references"] + written["data"]["validation_references"] == len(world.images)


def test_the_ranking_metrics() -> None:
    """recall@10, nDCG@10 and the held-out loss of known orders: perfect, reversed (both relevant references past
    rank 10), and one relevant reference fourth."""
    refs = [f"r{i}" for i in range(12)]
    yes = frozenset({"r0", "r1"})
    c = Criterion("x", yes, frozenset(refs) - yes)
    perfect = np.array([[12.0 - i for i in range(12)]])
    assert (ranking([c], perfect, refs, 0.1).recall, ranking([c], perfect, refs, 0.1).ndcg) == (1.0, 1.0)
    reversed_ = -perfect  # r0 and r1 rank last: neither is in the top 10
    assert (ranking([c], reversed_, refs, 0.1).recall, ranking([c], reversed_, refs, 0.1).ndcg) == (0.0, 0.0)
    third = np.array([[5.0 if r == "r0" else 9.0 if r == "r1" else 0.0 for r in refs]])
    third[0, 2:4] = [8.0, 7.0]  # r1 first, then r2 and r3, then r0: fourth
    m = ranking([c], third, refs, 0.1)
    assert m.recall == 1.0 and m.ndcg == pytest.approx((1 + 1 / np.log2(5)) / (1 + 1 / np.log2(3)))
    assert ranking([c], perfect, refs, 0.1).loss < m.loss < ranking([c], reversed_, refs, 0.1).loss


def test_hard_negatives_are_the_judged_no_else_the_nearest_non_matches() -> None:
    cells = [JudgedCell(1, "a", "x", True), JudgedCell(2, "b", "x", False), JudgedCell(3, "c", "y", True),
             JudgedCell(4, "a", "y", True)]
    side = criteria(cells, {"a", "b", "c", "d"})
    assert [c.text for c in side] == ["x", "y"]
    scores = np.array([[0.0, 0.0, 0.0, 0.0], [0.9, 0.1, 0.8, 0.5]])  # y: nearest a, c (both yes), then d, b
    assert hard_negatives(side, scores, ["a", "b", "c", "d"]) == [["b"], ["d", "b"]]


# -- re-embedding a set with a version, from its packages (indexer/jobs/reembed.py), and the CLI's activation ------

REFERENCES = 16
COLOURS = ("a red picture", "a blue picture")
TRAIN_ARGS = ["--steps", "6", "--batch", "8", "--lr", "0.005", "--seed", "1"]

@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path
             ) -> Iterator[Path]:
    """A data dir served by the tiny checkpoints (the embedder is the versions' base) with one ingested set of
    pictures, red (even numbers) or blue: a colour criterion a few steps can teach."""
    from rubricsearch.app.cli import main
    from tests.test_training_jobs import picture

    tmp_path = tmp_path_factory.mktemp("reembed")
    with pytest.MonkeyPatch.context() as monkeypatch:
        for key, value in {"RUBRICSEARCH_DATA_DIR": str(tmp_path / "data"),
                           "RUBRICSEARCH_MODELS__EMBEDDING_MODEL": str(tiny_embedding_dir),
                           "RUBRICSEARCH_MODELS__RERANKER_MODEL": str(tiny_reranker_dir),
                           "RUBRICSEARCH_MODELS__DTYPE": "float32", "RUBRICSEARCH_MODELS__DEVICE": "cpu",
                           "RUBRICSEARCH_PACKAGES__STORAGE_DTYPE": "float32"}.items():
            monkeypatch.setenv(key, value)
        monkeypatch.chdir(tmp_path)
        photos = tmp_path / "photos"
        photos.mkdir()
        for i in range(REFERENCES):
            (photos / f"p{i}.png").write_bytes(picture(i % 2 == 0, 700 + i))
        assert main(["sets", "create", "parts"]) == 0
        assert main(["ingest", "parts", str(photos), "--quiet"]) == 0
        yield tmp_path


def reembed_set(state: Any, record: Any, version: Path) -> Any:
    """The set re-embedded with the checkpoint ``version`` from its packages (no activation recorded)."""
    from rubricsearch.app.model_loading import model_config
    from rubricsearch.indexer.jobs.reembed import reembed_set_from_packages

    embedder = load_embedder(version, model_config(state.settings, "embedding", "local"), store=state.store)
    try:
        return reembed_set_from_packages(state.catalog, state.index, embedder, record.id,
                                         scratch=state.settings.data_dir / "reembed")
    finally:
        embedder.close()


@contextlib.contextmanager
def opened() -> Iterator[tuple[Any, Any, list[str]]]:
    """The data dir's state, the set and its references."""
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import open_state
    from rubricsearch.indexer.catalog import list_images, resolve_set

    state = open_state(Settings())
    try:
        with state.catalog.read() as session:
            record = resolve_set(session, "parts")
            shas = [img.sha256 for img in list_images(session, record.id, limit=100).items]
        yield state, record, shas
    finally:
        state.close()


def test_reembedding_switches_every_vector_to_the_versions_without_the_tower(data_dir: Path, trained: Any,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """Every reference gets the version's vector of its package; 0 encodes; and while the new vectors are made
    (three embedding calls here) searches still read the old ones: a copy that switched chunk by chunk fails."""
    from rubricsearch.indexer.jobs import reembed
    from rubricsearch.retrieval.embedding.task import TaskEmbedder

    _, out, _ = trained
    monkeypatch.setattr(reembed, "CHUNK", 6)  # 16 references: three calls
    with opened() as (state, record, shas):
        old = state.index.vectors(record.id, shas)
        seen: list[bool] = []
        original = TaskEmbedder.embed_contents

        def watching(self: Any, *args: Any, **kwargs: Any) -> np.ndarray:
            now = state.index.vectors(record.id, shas)
            seen.append(all(np.array_equal(now[s], old[s]) for s in shas))
            return original(self, *args, **kwargs)

        monkeypatch.setattr(TaskEmbedder, "embed_contents", watching)
        report = reembed_set(state, record, out)
        monkeypatch.setattr(TaskEmbedder, "embed_contents", original)
        assert seen == [True, True, True], "the old vectors serve until the switch"
        assert (report.references, report.skipped, report.vision_encodes) == (len(shas), 0, 0)
        new = state.index.vectors(record.id, shas)
        assert_vectors_of(out, state, record, shas, new)
        assert max(float(np.abs(new[s] - old[s]).max()) for s in shas) > 1e-5, "the vectors did change"
        assert not list((state.settings.data_dir / "reembed").glob("*")), "the staging file is gone"


def test_reembedding_with_a_version_of_another_tower_switches_nothing(data_dir: Path,
                                                                       tiny_reranker_other_tower_dir: Path) -> None:
    """A checkpoint whose tower has no packages in the store: refused before any vector is written."""
    with opened() as (state, record, shas):
        old = state.index.vectors(record.id, shas)
        with pytest.raises(Conflict):
            reembed_set(state, record, tiny_reranker_other_tower_dir)
        now = state.index.vectors(record.id, shas)
        assert all(np.array_equal(now[s], old[s]) for s in shas)


def _judge_colours(*, flipped: bool) -> None:
    """Both colour criteria judged on every reference by its colour (``flipped``: the other way round)."""
    from rubricsearch.indexer.catalog import JudgmentSpec, delete_judgments, list_images, record_judgments

    with opened() as (state, record, _), state.catalog.write() as session:
        images = list_images(session, record.id, limit=100).items
        delete_judgments(session, record.id)
        record_judgments(session, record.id, [
            JudgmentSpec(img.id, c, (int(img.original_name[1:-4]) % 2 == 0) == (k == 0) != flipped)
            for img in images for k, c in enumerate(COLOURS)])


def _active_embedder() -> str:
    from rubricsearch.indexer.catalog.versions import active_version_id

    with opened() as (state, record, _), state.catalog.read() as session:
        return active_version_id(session, record.id, "embedder") or "base"


def test_train_embedder_cli_activates_through_the_guard(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``--activate`` is the API's activation: a version that does not beat the active embedder on held-out
    judgments is refused with the side-by-side table and nothing changes (vectors, active version); one that
    does is recorded as the set's active embedder, with the set re-embedded by it from packages."""
    from rubricsearch.app.cli import main

    _judge_colours(flipped=True)
    with opened() as (state, record, shas):
        before = state.index.vectors(record.id, shas)
    out = data_dir / "versions" / "parts-embedder-flipped"
    code = main(["train", "parts", "--model", "embedder", "--out", str(out), *TRAIN_ARGS, "--activate"])
    printed, err = capsys.readouterr()
    assert code == 2 and "error (conflict)" in err and "does not beat the active embedder" in err, err
    assert "candidate is" in err and "ndcg@10" in err and "base (active)" in err
    card = json.loads((out / CARD).read_text())
    assert card["kind"] == "embedder" and card["vision_encodes"] == 0 and "embedder version" in printed
    assert _active_embedder() == "base"
    with opened() as (state, record, shas):
        after = state.index.vectors(record.id, shas)
        assert all(np.array_equal(after[s], before[s]) for s in shas), "a refused version moved no vector"

    _judge_colours(flipped=False)
    out = data_dir / "versions" / "parts-embedder-truth"
    code = main(["train", "parts", "--model", "embedder", "--out", str(out), *TRAIN_ARGS, "--activate"])
    printed, err = capsys.readouterr()
    assert code == 0, err
    assert "activated" in printed and "candidate is" in printed and "better" in printed
    active = _active_embedder()
    assert active != "base" and active in err
    with opened() as (state, record, shas):
        assert_vectors_of(out, state, record, shas, state.index.vectors(record.id, shas))


def test_an_embedder_only_process_trains_and_activates_its_embedder(data_dir: Path) -> None:
    """An embedder version's job and guard need the embedder alone: a process that loads no reranker trains one and
    compares it side by side; a reranker job is refused there before anything is recorded."""
    import time

    from rubricsearch.app.model_versions import activate_version
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import open_state
    from rubricsearch.indexer.catalog import resolve_set
    from rubricsearch.indexer.catalog.tables import JobState
    from rubricsearch.retrieval.errors import BackendUnavailable
    from rubricsearch.retrieval.tuning.settings import TuningSettings

    _judge_colours(flipped=False)
    state = open_state(Settings(), embedder=True)
    try:
        assert state.reranker_ is None
        with state.catalog.read() as session:
            record = resolve_set(session, "parts")
        tuning = TuningSettings(steps=2, batch=8, lr=0.005, seed=2)
        with pytest.raises(BackendUnavailable):
            state.training.start(record, tuning, "reranker")
        job = state.training.start(record, tuning, "embedder")
        deadline = time.monotonic() + 240
        while (job := state.training.get(job.id)).state in (JobState.QUEUED, JobState.RUNNING):
            assert time.monotonic() < deadline
            time.sleep(0.1)
        assert job.state == JobState.SUCCEEDED, job.error
        version_id = job.options["progress"]["version_id"]
        try:
            table = activate_version(state, record, version_id)
        except Conflict as exc:  # the guard ran and refused: which way depends on the version, not the reranker
            table = exc.details["comparison"]
        assert table["candidate"] == version_id and table["vision_encodes"] == 0 and table["metrics"]
    finally:
        state.close()
