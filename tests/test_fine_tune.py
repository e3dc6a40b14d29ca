"""Fine-tuning the reranker from judgments and cached packages (rerank/tuning), on the tiny random-weight checkpoint;
the refusals (bad judgments, packages of another tower, settings out of range, an existing or a half-written
version) are tested for both trainers, the embedder's too.

One training run (a few steps) is shared by the tests that read its version; the error tests stop before any
training. What is promised: the version loads as a reranker, its card says what made it, no reference went
through the vision tower, the tower (so every package) is unchanged, validation references are not trained on,
and bad input changes nothing on disk.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.tuning import CARD, Tuned, TuningSettings, fine_tune_reranker, save_version
from rubricsearch.rerank.tuning import trainer as trainer_module
from rubricsearch.rerank.tuning.cells import example, reference
from rubricsearch.retrieval.errors import BackendUnavailable, Conflict, InsufficientStorage, InvalidInput
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.tuning.embedder import fine_tune_embedder, save_embedder_version
from rubricsearch.retrieval.tuning.judgments import JudgedCell
from tests.fine_tune_worlds import CPU, CRITERIA, SETTINGS, UNPACKAGED, World, world_of

TRAINERS: dict[str, tuple[Callable[..., Any], Callable[..., dict[str, Any]]]] = {
    "reranker": (fine_tune_reranker, save_version), "embedder": (fine_tune_embedder, save_embedder_version)}


@pytest.fixture(scope="module")
def world(tiny_reranker_dir: Path, tiny_reranker_other_tower_dir: Path, make_png: Callable[..., bytes]) -> World:
    return world_of("reranker", tiny_reranker_dir, tiny_reranker_other_tower_dir, make_png, 12)


@dataclass
class Trainer:
    """Either trainer with its world: what the refusals of both are tested on."""

    world: World
    fine_tune: Callable[..., Any]
    save: Callable[..., dict[str, Any]]


@pytest.fixture(scope="module", params=sorted(TRAINERS))
def trainer(request: pytest.FixtureRequest, world: World, tiny_embedding_dir: Path,
            tiny_reranker_other_tower_dir: Path, make_png: Callable[..., bytes]) -> Trainer:
    either = world if request.param == "reranker" else world_of("embedding", tiny_embedding_dir,
                                                                tiny_reranker_other_tower_dir, make_png, 16)
    return Trainer(either, *TRAINERS[request.param])


@pytest.fixture(scope="module")
def trained(world: World, tmp_path_factory: pytest.TempPathFactory) -> tuple[Tuned, Path, dict[str, Any]]:
    tuned = fine_tune_reranker(world.base, [*world.cells, UNPACKAGED], world.store, settings=SETTINGS, local=CPU)
    out = tmp_path_factory.mktemp("versions") / "reranker-v1"
    return tuned, out, save_version(tuned, out)


def test_the_version_loads_as_a_reranker_and_scores_the_bases_packages(world: World, trained: Any) -> None:
    _, out, _ = trained
    pairs = [example(c).pair for c in world.cells[:6]]
    base = load_reranker(world.base, store=world.store, device="cpu")
    version = load_reranker(out, store=world.store, device="cpu")
    usage = Usage()
    before, after = base.score_pairs(pairs, usage=usage), version.score_pairs(pairs, usage=usage)
    assert usage.total() == 0, "the version reads the base's packages: no reference is encoded again"
    assert all(0.0 <= s <= 1.0 for s in after)
    assert max(abs(a - b) for a, b in zip(before, after, strict=True)) > 1e-6, "the merged adapters change scores"


def test_card_records_base_data_settings_metrics_and_time(world: World, trained: Any) -> None:
    _, out, written = trained
    on_disk = json.loads((out / CARD).read_text())
    assert on_disk == written
    assert on_disk["base_model"] == str(world.base.resolve())
    assert on_disk["data"]["judgment_ids"] == sorted(c.judgment_id for c in world.cells)
    assert on_disk["data"]["max_judgment_id"] == UNPACKAGED.judgment_id  # the snapshot: every id given
    assert on_disk["data"]["skipped_without_package"] == 1 and on_disk["data"]["judgments"] == len(world.cells)
    assert {k: on_disk["settings"][k] for k in ("rank", "alpha", "lr", "steps", "seed", "preserve")} == {
        "rank": 8, "alpha": 32, "lr": 1e-3, "steps": 4, "seed": 3, "preserve": SETTINGS.preserve}
    assert "pull" not in on_disk["settings"]  # the embedder's
    for side in ("before", "after"):
        metrics = on_disk["metrics"][side]
        assert metrics["judgments"] == on_disk["data"]["validation_judgments"] > 0
        assert 0.0 <= metrics["auc"] <= 1.0 and metrics["log_loss"] > 0
        assert set(metrics) == {"judgments", "auc", "log_loss", "precision_at_0.5"}
    assert 1 <= on_disk["training"]["steps_run"] <= 4
    assert on_disk["wall_s"] > 0 and on_disk["training"]["dtype"] == "float32"
    assert not list(out.parent.glob(".*partial*")), "no temporary folder is left behind"


def test_training_runs_no_vision_encode(trained: Any) -> None:
    tuned, _, written = trained
    assert tuned.vision_encodes == 0 and written["vision_encodes"] == 0


def test_the_encode_counter_sees_a_trainer_that_runs_the_tower(world: World, monkeypatch: pytest.MonkeyPatch
                                                              ) -> None:
    """A broken copy that re-encodes its references on every step is counted (so the 0 above means 0)."""
    original = trainer_module._Trainer.logits

    def reencoding(self: Any, rows: Any) -> torch.Tensor:
        self.runtime.vision.encode([world.images[e.cell.sha256] for e in rows])
        return original(self, rows)

    monkeypatch.setattr(trainer_module._Trainer, "logits", reencoding)
    tuned = fine_tune_reranker(world.base, world.cells, world.store, settings=replace(SETTINGS, steps=1),
                               local=CPU)
    assert tuned.vision_encodes > 0


def test_the_tower_and_so_every_package_is_unchanged(world: World, trained: Any) -> None:
    _, out, written = trained
    base, version = load_qwen(world.base, device="cpu"), load_qwen(out, device="cpu")
    assert version.tower_hash == base.tower_hash == written["tower_hash"]
    # the language model did change, and the version finds the base's packages under its fingerprint
    changed = [n for n, p in version.model.language_model.named_parameters()
               if not torch.equal(p, dict(base.model.language_model.named_parameters())[n])]
    assert changed
    reranker = load_reranker(out, store=world.store, device="cpu")
    assert reranker.packages.fingerprint is not None
    assert reranker.packages.fingerprint.digest() == written["package_fingerprint"]
    assert len(reranker.packages.find([reference(world.cells[0].sha256)])) == 1


def test_validation_references_are_never_trained_on(trained: Any, world: World) -> None:
    tuned, _, written = trained
    assert not tuned.split.train_references & tuned.split.validation_references
    assert tuned.split.train_references | tuned.split.validation_references == {c.sha256 for c in world.cells}
    assert written["data"]["train_judgments"] + written["data"]["validation_judgments"] == len(world.cells)


@pytest.mark.parametrize(("change", "error"), [
    (lambda w: replace(w, cells=[]), InvalidInput),
    (lambda w: replace(w, cells=[replace(c, holds=True) for c in w.cells]), InvalidInput),
    (lambda w: replace(w, cells=[c for c in w.cells if c.sha256 == w.cells[0].sha256]), InvalidInput),
    (lambda w: replace(w, store=w.other_store), Conflict),
])
def test_bad_judgments_or_packages_are_refused(trainer: Trainer, change: Any, error: type[Exception]) -> None:
    bad = change(trainer.world)
    with pytest.raises(error):
        trainer.fine_tune(bad.base, bad.cells, bad.store, settings=SETTINGS, local=CPU)


@pytest.mark.parametrize("settings", [replace(SETTINGS, rank=0), replace(SETTINGS, lr=0.0), replace(SETTINGS, lr=1.0),
                                      replace(SETTINGS, steps=0), replace(SETTINGS, alpha=0),
                                      replace(SETTINGS, batch=0), replace(SETTINGS, preserve=-0.1)])
def test_out_of_range_settings_are_refused(trainer: Trainer, settings: TuningSettings) -> None:
    with pytest.raises(InvalidInput):
        trainer.fine_tune(trainer.world.base, trainer.world.cells, trainer.world.store, settings=settings,
                          local=CPU)


def test_training_runs_under_the_local_configuration_given(trainer: Trainer) -> None:
    """The trainer's runtime comes from ``local`` (a server passes its model's): fused kernels asked for on a CPU are
    refused, as serving refuses them, before any training."""
    w = trainer.world
    with pytest.raises(BackendUnavailable, match="CUDA"):
        trainer.fine_tune(w.base, w.cells, w.store, settings=SETTINGS, local=replace(CPU, fused_kernels=True))


def test_the_accelerated_engine_trains_exactly_what_the_plain_one_does(world: World,
                                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU a fine-tune runs the accelerated engine (its kernels); its training forward is the plain one's, so
    on a CPU, where no kernel differs, the two engines train the same losses."""
    from rubricsearch.rerank.plugins.accelerated.runtime import AcceleratedScoringRuntime

    built: list[str] = []
    original = AcceleratedScoringRuntime.__init__

    def spy(self: AcceleratedScoringRuntime, *args: Any, **kwargs: Any) -> None:
        built.append(kwargs["role"])
        original(self, *args, **kwargs)

    monkeypatch.setattr(AcceleratedScoringRuntime, "__init__", spy)
    few = replace(SETTINGS, steps=2)
    plain = fine_tune_reranker(world.base, world.cells, world.store, settings=few, local=CPU)
    assert built == []
    fast = fine_tune_reranker(world.base, world.cells, world.store, settings=few,
                              local=replace(CPU, engine="accelerated"))
    assert built == ["reranker"]
    # equal up to float rounding: under a busy CPU the backward's parallel sums may add in another order
    assert fast.losses == pytest.approx(plain.losses, rel=1e-5) and len(plain.losses) == 2


def test_an_existing_version_is_never_overwritten_and_a_failed_save_leaves_nothing(
        trainer: Trainer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from rubricsearch.retrieval.tuning import version

    w = trainer.world
    tuned = trainer.fine_tune(w.base, w.cells, w.store, settings=replace(SETTINGS, steps=1), local=CPU)
    out = tmp_path / "v1"
    trainer.save(tuned, out)
    before = sorted(p.name for p in out.iterdir())
    with pytest.raises(Conflict):
        trainer.save(tuned, out)
    assert sorted(p.name for p in out.iterdir()) == before

    def full_disk(*args: Any, **kwargs: Any) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(version, "_write", full_disk)
    fresh = out.parent / "v2"
    with pytest.raises(InsufficientStorage):
        trainer.save(tuned, fresh)
    assert not fresh.exists() and not list(out.parent.glob(".*partial*"))


def test_the_training_forward_is_the_shortlist_forward(world: World) -> None:
    """The states trained on give exactly the scores search gets, on both of the shortlist's paths: the rows that
    share a criterion's prefix and a criterion asked of one reference alone (the plain forward)."""
    from rubricsearch.rerank.tuning.forward import last_token_states
    from rubricsearch.retrieval.runtime.core import Truncation

    reranker = load_reranker(world.base, store=world.store, device="cpu")
    runtime = reranker.runtime
    first = [c for c in world.cells if c.criterion == CRITERIA[0]][:3]
    pairs = [example(c).pair for c in (replace(first[0], criterion="a green circle"), *first)]
    packages = runtime.packages.find([p.document.images[0] for p in pairs])
    _, regular, groups, _ = runtime.plan(pairs, packages, Truncation(10240))
    assert regular == [0] and len(groups) == 1  # the plain row first: the states must come back in pair order
    states = last_token_states(runtime, pairs, packages)
    assert states.requires_grad
    trained = torch.sigmoid(states @ runtime.weight).tolist()
    assert trained == pytest.approx(reranker.score_pairs(pairs), abs=1e-5)


def test_the_version_is_laid_out_as_the_base(world: World, trained: Any) -> None:
    """Every loader that takes the base takes the version (vLLM reads the weights by name): the same files, the same
    architecture and the same tensor names, shapes and dtypes, plus the card."""
    from safetensors import safe_open

    _, out, _ = trained

    def tensors(folder: Path) -> dict[str, tuple[tuple[int, ...], str]]:
        found = {}
        for file in folder.glob("*.safetensors"):
            with safe_open(str(file), "pt") as f:
                for name in f.keys():  # noqa: SIM118 (a safetensors file iterates no keys)
                    t = f.get_slice(name)
                    found[name] = (tuple(t.get_shape()), t.get_dtype())
        return found

    assert {p.name for p in out.iterdir()} == {p.name for p in world.base.iterdir()} | {CARD}
    assert json.loads((out / "config.json").read_text())["architectures"] == json.loads(
        (world.base / "config.json").read_text())["architectures"]
    assert tensors(out) == tensors(world.base)


def test_the_cells_kept_at_the_base_are_exactly_the_unjudged_ones() -> None:
    """``preserve`` asks each training reference every criterion the set judges elsewhere but not on it, by its
    positive statement (a judged "no blue stripes" is "blue stripes" asked), and nothing the set judged."""
    a, b, c = ("a" * 64, "b" * 64, "c" * 64)
    cells = [JudgedCell(1, c, "blue stripes", True), JudgedCell(2, a, "a red square", True),
             JudgedCell(3, a, "no blue stripes", False), JudgedCell(4, b, "a red square", False)]
    kept = {(e.cell.sha256, e.pair.query.texts[0]) for e in trainer_module.unjudged([example(x) for x in cells])}
    assert kept == {(b, "blue stripes"), (c, "a red square")}


def test_each_answer_kept_at_the_base_is_asked_of_a_judged_rows_own_reference(
        world: World, monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's rows kept at the base's answers (``preserve``) are the batch's own references asked another of the
    set's criteria, one per judged row whose reference has such a cell: what a taught criterion can leak into."""
    steps: list[tuple[list[Any], list[Any]]] = []
    real = trainer_module._Trainer.loss

    def loss(self: Any, batch: list[Any]) -> torch.Tensor:
        calls: list[list[Any]] = []
        logits = self.logits
        self.logits = lambda rows: calls.append(list(rows)) or logits(rows)
        try:
            return real(self, batch)
        finally:
            self.logits = logits
            steps.append((batch, calls[0][len(batch):]))

    monkeypatch.setattr(trainer_module._Trainer, "loss", loss)
    cells = [c for c in world.cells if c.criterion == CRITERIA[0] or c.sha256 < "8"]  # some judged on one criterion
    fine_tune_reranker(world.base, cells, world.store, settings=replace(SETTINGS, preserve=0.3), local=CPU)
    judged = {(c.sha256, c.criterion) for c in cells}
    assert steps and any(kept for _, kept in steps)
    for batch, kept in steps:
        open_cells = [e for e in batch if any((e.cell.sha256, c) not in judged for c in CRITERIA)]
        assert len(kept) == len(open_cells)
        assert sorted(e.cell.sha256 for e in kept) == sorted(e.cell.sha256 for e in open_cells)
        assert all((e.cell.sha256, e.cell.criterion) not in judged for e in kept)
