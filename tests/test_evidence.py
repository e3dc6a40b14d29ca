"""Per-criterion evidence (rerank/evidence.py) on a tiny random checkpoint: the maps' shape and boxes, the score
they explain, what gradient × input and occlusion measure, negation, and no vision-tower run for cached packages."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.evidence import METHODS, cell_boxes, criterion_pair, explain, explain_many
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.task import RERANK_MAX_LENGTH, TaskReranker
from rubricsearch.retrieval.images import ImageLike, image_handle
from rubricsearch.retrieval.qwen.engine.forward import LMInput, pooled_states
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.core import Truncation
from tests.conftest import noise_png

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def reranker(tiny_reranker_dir: Path) -> Iterator[TaskReranker]:
    model = load_reranker(tiny_reranker_dir, device="cpu", dtype="float32", fused_kernels=False)
    yield model
    model.close()


@pytest.fixture(scope="module")
def images() -> dict[str, ImageLike]:
    return {"reference": image_handle(noise_png(96, 64, 1)), "candidate": image_handle(noise_png(64, 64, 2))}


def runtime_of(reranker: TaskReranker) -> LocalScoringRuntime:
    assert isinstance(reranker.runtime, LocalScoringRuntime)
    return reranker.runtime


class Rewired:
    """A runtime's shortlist passes (:class:`rerank.prefix.RowPasses`) with their prefixes or states rewired: the
    deliberately broken copies below."""

    def __init__(self, inner: Any, prefixes: Callable[[list[Any]], list[Any]] = lambda p: p,
                 states: Callable[[torch.Tensor], torch.Tensor] = lambda s: s) -> None:
        self.inner, self.loaded, self._prefixes, self._states = inner, inner.loaded, prefixes, states

    def prefixes(self, prefixes: Any) -> Any:
        return self.inner.prefixes(self._prefixes(list(prefixes)))

    def rows(self, cache: Any, rows: Any) -> torch.Tensor:
        return self._states(self.inner.rows(cache, rows))

    def gradients(self, prefixes: Any, rows: Any, weight: torch.Tensor, **budget: int) -> Any:
        logits, grads = self.inner.gradients(self._prefixes(list(prefixes)), rows, weight, **budget)
        return self._states(logits[:, None])[:, 0], grads


def use_passes(monkeypatch: pytest.MonkeyPatch, runtime: LocalScoringRuntime, kind: str, **rewired: Any) -> None:
    """Point ``runtime``'s passes with gradients at the padded or the packed implementation (the GPU's, whose
    attention on a CPU is the reference loop), rewired when asked."""
    from rubricsearch.rerank.plugins.accelerated.packed_rows import PackedRows
    from rubricsearch.rerank.prefix import PaddedRows

    inner = PackedRows(runtime.loaded) if kind == "packed" else PaddedRows(runtime.loaded, runtime.pad_id)
    monkeypatch.setattr(runtime, "row_passes", lambda: Rewired(inner, **rewired) if rewired else inner)


def sizes(images: dict[str, ImageLike]) -> dict[str, tuple[int, int]]:
    return {img.sha256: img.image.size for img in images.values()}


def test_cell_boxes_scale_the_merged_grid_back_to_the_original_image() -> None:
    # a 1000 x 500 photo resized to 28 x 14 patches of 16 px (448 x 224), merge 2: 7 rows, 14 columns
    boxes = cell_boxes((1, 14, 28), 16, 2, (1000, 500))
    assert len(boxes) == 7 and all(len(row) == 14 for row in boxes)
    assert boxes[0][0] == pytest.approx((0, 0, 1000 / 14, 500 / 7))
    assert boxes[6][13] == pytest.approx((1000 * 13 / 14, 500 * 6 / 7, 1000, 500))
    assert boxes[2][5] == pytest.approx((1000 * 5 / 14, 500 * 2 / 7, 1000 * 6 / 14, 500 * 3 / 7))


@pytest.mark.parametrize("method", METHODS)
def test_maps_cover_every_image_of_the_pair_without_running_the_tower(
        reranker: TaskReranker, images: dict[str, ImageLike], method: Any,
        count_tower: Callable[[Any], Any]) -> None:
    runtime = runtime_of(reranker)
    reference, candidate = images["reference"], images["candidate"]
    runtime.packages.get_or_encode([reference, candidate])  # cached, as ingestion and the search leave them
    counter = count_tower(runtime.loaded.model.visual)
    before = reranker.stats["vision_encodes"]
    evidence = explain(runtime, "triangular ears", Content(images=[reference]), sizes(images), candidate=candidate,
                       method=method, candidate_maps=True)
    assert counter.calls == 0 and evidence.vision_encodes == 0 and reranker.stats["vision_encodes"] == before
    pair, _ = criterion_pair("triangular ears", Content(images=[reference]), candidate)
    assert evidence.p_yes == pytest.approx(reranker.score_pairs([pair])[0], abs=1e-5)
    assert evidence.method == method and evidence.of == "statement" and evidence.instruction == pair.instruction
    query, document = evidence.images
    assert (query.role, query.sha256, document.role, document.sha256) == (
        "query", candidate.sha256, "document", reference.sha256)
    for image, (width, height) in ((query, (64, 64)), (document, (96, 64))):
        pkg = runtime.packages.find([reference, candidate])[image.sha256]
        rows, cols = pkg.grid_thw[1] // 2, pkg.grid_thw[2] // 2
        assert image.grid == (rows, cols) and image.size == (width, height)
        assert len(image.values) == rows and all(len(r) == cols for r in image.values)
        assert image.boxes[-1][-1][2:] == pytest.approx((width, height))
        assert any(v != 0 for r in image.values for v in r)


def test_a_package_missing_from_the_cache_is_encoded_and_counted(
        reranker: TaskReranker, count_tower: Callable[[Any], Any]) -> None:
    fresh = image_handle(noise_png(64, 64, 77))
    counter = count_tower(runtime_of(reranker).loaded.model.visual)
    evidence = explain(runtime_of(reranker), "round ears", Content(images=[fresh]), {fresh.sha256: (64, 64)})
    assert counter.calls == 1 and evidence.vision_encodes == 1


def test_a_searchs_maps_encode_a_missing_image_once_and_count_it_on_the_first_answer_that_needs_it(
        reranker: TaskReranker, images: dict[str, ImageLike], count_tower: Callable[[Any], Any]) -> None:
    """A search's evidence repeats each hit over its criteria: the image missing from the cache is encoded once,
    and only the first of its answers counts the encode (each answer counts the tower runs it caused)."""
    runtime = runtime_of(reranker)
    reference, fresh = images["reference"], image_handle(noise_png(64, 64, 78))
    runtime.packages.get_or_encode([reference])
    counter = count_tower(runtime.loaded.model.visual)
    asks = [(criterion, Content(images=[img])) for img in (reference, fresh)
            for criterion in ("round ears", "dark forehead stripes")]
    found = explain_many(runtime, asks, {**sizes(images), fresh.sha256: (64, 64)}, method="gradient_x_input")
    assert counter.calls == 1 and [e.vision_encodes for e in found] == [0, 0, 1, 0]
    assert [e.images[0].sha256 for e in found] == [reference.sha256] * 2 + [fresh.sha256] * 2


def test_gradient_x_input_sums_to_the_logit_change_of_scaling_the_image_about_its_mean(
        reranker: TaskReranker, images: dict[str, ImageLike]) -> None:
    """Σ ∂logit/∂x · (x − x̄) is the logit's derivative along the tokens' deviation from their mean x̄: scaling the
    reference's deviations by 1 + ε moves the logit by ε times the map's sum (a map of another image, or of the
    wrong tensors, would not)."""
    runtime = runtime_of(reranker)
    reference = images["reference"]
    doc = Content(images=[reference])
    evidence = explain(runtime, "dark forehead stripes", doc, sizes(images), method="gradient_x_input")
    total = sum(v for row in evidence.images[0].values for v in row)
    pair, _ = criterion_pair("dark forehead stripes", doc)
    pkg = runtime.packages.find([reference])[reference.sha256]
    inputs, *_ = runtime.plan([pair], {reference.sha256: pkg}, Truncation(RERANK_MAX_LENGTH))

    def logit(scale: float) -> float:
        embeds, deep = pkg.embeds.mean(0), pkg.deepstack.mean(1, keepdim=True)
        scaled = replace(pkg, embeds=embeds + (pkg.embeds - embeds) * scale,
                         deepstack=deep + (pkg.deepstack - deep) * scale)
        with torch.no_grad():
            hidden = pooled_states(runtime.loaded, [LMInput(ids=inputs[0].ids, packages=[scaled])], runtime.pad_id)
        return float(hidden[0].to(torch.float32) @ runtime.weight)

    eps = 1e-3
    assert (logit(1 + eps) - logit(1 - eps)) / (2 * eps) == pytest.approx(total, rel=0.05, abs=1e-6)


def test_occlusion_is_the_logit_drop_of_the_mean_token(reranker: TaskReranker, images: dict[str, ImageLike]) -> None:
    runtime = runtime_of(reranker)
    reference = images["reference"]
    doc = Content(images=[reference])
    evidence = explain(runtime, "green eyes", doc, sizes(images), method="occlusion")
    pair, _ = criterion_pair("green eyes", doc)
    pkg = runtime.packages.find([reference])[reference.sha256]
    inputs, *_ = runtime.plan([pair], {reference.sha256: pkg}, Truncation(RERANK_MAX_LENGTH))
    assert min(evidence.images[0].grid) >= 2
    token = 1  # row 0, column 1: off the diagonal, so a transposed map reads row 1, column 0, a shifted one another
    embeds, deepstack = pkg.embeds.clone(), pkg.deepstack.clone()
    embeds[token], deepstack[:, token] = pkg.embeds.mean(0), pkg.deepstack.mean(1)
    with torch.no_grad():
        states = pooled_states(runtime.loaded, [LMInput(inputs[0].ids, [pkg]),
                                                LMInput(inputs[0].ids, [replace(pkg, embeds=embeds,
                                                                                deepstack=deepstack)])],
                               runtime.pad_id).to(torch.float32) @ runtime.weight
    assert evidence.images[0].values[0][1] == pytest.approx(float(states[0] - states[1]), abs=1e-4)


def test_a_negated_criterion_explains_its_positive_statement(
        reranker: TaskReranker, images: dict[str, ImageLike]) -> None:
    runtime = runtime_of(reranker)
    doc = Content(images=[images["reference"]])
    negated = explain(runtime, "no forehead stripes", doc, sizes(images))
    positive = explain(runtime, "forehead stripes", doc, sizes(images))
    assert (negated.of, negated.statement, negated.negated) == ("positive statement", "forehead stripes", True)
    assert negated.images[0].values == positive.images[0].values
    assert negated.p_yes == pytest.approx(positive.p_yes)


@pytest.mark.parametrize("side,over_max", [(64, False), (576, True)])
def test_occlusion_is_bounded_by_the_images_tokens(reranker: TaskReranker, side: int, over_max: bool) -> None:
    """Occlusion copies the package once per token: asked for, it is refused over OCCLUSION_MAX_TOKENS with nothing
    run; unasked, the default method explains any size."""
    from rubricsearch.rerank.evidence import DEFAULT_METHOD, OCCLUSION_MAX_TOKENS
    from rubricsearch.retrieval.errors import InvalidInput

    image = image_handle(noise_png(side, side, 300 + side))
    runtime = runtime_of(reranker)
    tokens = runtime.packages.get_or_encode([image])[0].tokens
    assert (tokens > OCCLUSION_MAX_TOKENS) == over_max
    unasked = explain(runtime, "round ears", Content(images=[image]), {image.sha256: (side, side)})
    assert unasked.method == DEFAULT_METHOD
    if over_max:
        with pytest.raises(InvalidInput, match="gradient_x_input"):
            explain(runtime, "round ears", Content(images=[image]), {image.sha256: (side, side)}, method="occlusion")
    else:
        assert explain(runtime, "round ears", Content(images=[image]), {image.sha256: (side, side)},
                       method="occlusion").method == "occlusion"


BATCH_CRITERIA = ["round ears", "no forehead stripes", "dark forehead stripes and green eyes"]


def _mismatches(together: list[Any], alone: list[Any]) -> list[str]:
    out = []
    for k, (t, a) in enumerate(zip(together, alone, strict=True)):
        if t.p_yes != pytest.approx(a.p_yes, abs=1e-5):
            out.append(f"pair {k}: p_yes {t.p_yes} != {a.p_yes}")
        for ti, ai in zip(t.images, a.images, strict=True):
            if (ti.sha256, ti.role, ti.grid) != (ai.sha256, ai.role, ai.grid):
                out.append(f"pair {k}: image {ti.sha256[:8]} != {ai.sha256[:8]}")
            elif not torch.allclose(torch.tensor(ti.values), torch.tensor(ai.values), rtol=1e-3, atol=1e-5):
                out.append(f"pair {k}: the {ti.role}'s map differs")
    return out


def _mixed_rows(monkeypatch: pytest.MonkeyPatch, method: str, runtime: LocalScoringRuntime, passes: str) -> None:
    """A broken copy: each row (occlusion: each group) of a batched pass gets its neighbour's result."""
    import rubricsearch.rerank.evidence as evidence
    import rubricsearch.rerank.gradients as gradients

    if method == "occlusion":
        real_groups = evidence.run_shared_prefixes

        def rolled(*a: Any, **kw: Any) -> list[torch.Tensor]:
            out = real_groups(*a, **kw)
            alike: dict[tuple[int, ...], list[int]] = {}
            for g, states in enumerate(out):
                alike.setdefault(tuple(states.shape), []).append(g)
            mixed = list(out)
            for same in alike.values():
                for g, h in zip(same, same[1:] + same[:1], strict=True):
                    mixed[g] = out[h]
            return mixed

        monkeypatch.setattr(evidence, "run_shared_prefixes", rolled)
    else:
        for module, name in ((evidence, "pooled_states"), (gradients, "pooled_states")):
            real = getattr(module, name)
            monkeypatch.setattr(module, name, lambda *a, real=real, **kw: real(*a, **kw).roll(1, 0))
        use_passes(monkeypatch, runtime, passes, states=lambda s: s.roll(1, 0))


@pytest.mark.parametrize(("method", "passes"), [*((m, "padded") for m in METHODS), ("gradient_x_input", "packed"),
                                                 ("integrated_gradients", "packed")])
@pytest.mark.parametrize("with_candidate", [False, True])
def test_batched_maps_are_each_pairs_own(reranker: TaskReranker, images: dict[str, ImageLike], method: Any,
                                         passes: str, with_candidate: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """A search's hits × criteria explained together give each pair the maps and P(yes) it gets alone (references
    of different sizes, so the rows are padded; with the candidate's maps too when there is one), through either
    implementation of the shortlist's passes; a copy that hands rows their neighbour's result fails."""
    from rubricsearch.rerank.evidence import explain_many

    runtime = runtime_of(reranker)
    use_passes(monkeypatch, runtime, passes)
    references = [images["reference"], image_handle(noise_png(64, 96, 5)), image_handle(noise_png(64, 64, 6))]
    candidate = images["candidate"] if with_candidate else None
    known = {img.sha256: img.image.size for img in (*references, images["candidate"])}
    asks = [(c, Content(images=[r])) for r in references for c in BATCH_CRITERIA]
    together = explain_many(runtime, asks, known, candidate=candidate, method=method, candidate_maps=with_candidate)
    alone = [explain(runtime, c, d, known, candidate=candidate, method=method, candidate_maps=with_candidate)
             for c, d in asks]
    assert {len(e.images) for e in together} == {2 if with_candidate else 1}
    assert [e.statement for e in together] == [e.statement for e in alone]
    assert len({e.p_yes for e in alone}) == len(alone)  # the pairs differ: a mix-up would show
    assert _mismatches(together, alone) == []
    _mixed_rows(monkeypatch, method, runtime, passes)
    assert _mismatches(explain_many(runtime, asks, known, candidate=candidate, method=method,
                                    candidate_maps=with_candidate), alone) != []


@pytest.mark.parametrize("passes", ["padded", "packed"])
@pytest.mark.parametrize("method", ["gradient_x_input", "integrated_gradients"])
@pytest.mark.parametrize("with_candidate", [False, True])
def test_reference_maps_after_the_prefix_are_the_whole_pairs(
        reranker: TaskReranker, images: dict[str, ImageLike], method: Any, with_candidate: bool, passes: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The reference maps run after each criterion's prefix, which takes no gradient: they equal the maps of the
    same method through the whole pairs (every image on the path, the reference's gradient through every token),
    with the candidate's own maps beside them, through either implementation of the shortlist's passes. Rows run
    after the prefix of another criterion (or another point of the path) fail."""
    import rubricsearch.rerank.gradients as gradients
    from rubricsearch.rerank.evidence import GRADIENT_PATHS, explain_many

    runtime = runtime_of(reranker)
    use_passes(monkeypatch, runtime, passes)
    references = [images["reference"], image_handle(noise_png(64, 96, 5))]
    candidate = images["candidate"] if with_candidate else None
    known = {img.sha256: img.image.size for img in (*references, images["candidate"])}
    asks = [(c, Content(images=[r])) for r in references for c in BATCH_CRITERIA]
    pairs = [criterion_pair(c, d, candidate)[0] for c, d in asks]
    packages = {p.image_sha256: p for p in runtime.packages.get_or_encode([*references, images["candidate"]])}
    inputs, *_ = runtime.plan(pairs, packages, Truncation(RERANK_MAX_LENGTH))
    whole = gradients.whole_pair_gradients(runtime, inputs, len(inputs[0].packages), GRADIENT_PATHS[method])

    def mismatches() -> list[str]:
        out = []
        found = explain_many(runtime, asks, known, candidate=candidate, method=method, candidate_maps=with_candidate)
        for k, (e, (logit, maps)) in enumerate(zip(found, whole, strict=True)):
            if e.p_yes != pytest.approx(float(torch.sigmoid(torch.tensor(logit))), abs=1e-5):
                out.append(f"pair {k}: p_yes")
            for image, values in zip(e.images, maps, strict=True):
                if not torch.allclose(torch.tensor(image.values).flatten(), values, rtol=1e-3, atol=1e-5):
                    out.append(f"pair {k}: the {image.role}'s map differs")
        return out

    assert mismatches() == []
    use_passes(monkeypatch, runtime, passes, prefixes=lambda p: [*p[1:], *p[:1]])
    assert [m for m in mismatches() if "document" in m] != []


def _logit(runtime: LocalScoringRuntime, ids: list[int], packages: list[Any]) -> float:
    with torch.no_grad():
        hidden = pooled_states(runtime.loaded, [LMInput(ids=ids, packages=packages)], runtime.pad_id)
    return float(hidden[0].to(torch.float32) @ runtime.weight)


def test_integrated_gradients_sum_to_the_logit_change_from_the_mean_tokens(
        reranker: TaskReranker, images: dict[str, ImageLike]) -> None:
    """Completeness: over every image of the pair, the values sum to the logit of the pair minus that of the pair
    whose images are all their mean token (the path's start). A map of the wrong path, image or gradient would
    not add up."""
    runtime = runtime_of(reranker)
    reference, candidate = images["reference"], images["candidate"]
    doc = Content(images=[reference])
    evidence = explain(runtime, "round ears", doc, sizes(images), candidate=candidate, method="integrated_gradients",
                       candidate_maps=True)
    total = sum(v for image in evidence.images for row in image.values for v in row)
    pair, _ = criterion_pair("round ears", doc, candidate)
    packages = runtime.packages.find([reference, candidate])
    (item,), *_ = runtime.plan([pair], packages, Truncation(RERANK_MAX_LENGTH))
    flat = [replace(p, embeds=p.embeds.mean(0, keepdim=True).expand_as(p.embeds).clone(),
                    deepstack=p.deepstack.mean(1, keepdim=True).expand_as(p.deepstack).clone())
            for p in item.packages]
    change = _logit(runtime, item.ids, item.packages) - _logit(runtime, item.ids, flat)
    assert abs(change) > 1e-4
    assert total == pytest.approx(change, rel=0.05)


def test_attention_is_the_last_tokens_eager_attention_on_the_image(
        reranker: TaskReranker, images: dict[str, ImageLike]) -> None:
    """The map is what transformers' eager attention returns (``output_attentions``) for the last token, averaged
    over heads and the last ATTENTION_LAYERS layers, read at each image's tokens in the grid's order."""
    from rubricsearch.rerank.evidence import ATTENTION_LAYERS
    from rubricsearch.retrieval.qwen.engine.forward import mm_kwargs, mrope_positions

    runtime = runtime_of(reranker)
    reference, candidate = images["reference"], images["candidate"]
    doc = Content(images=[reference])
    evidence = explain(runtime, "green eyes", doc, sizes(images), candidate=candidate, method="attention",
                       candidate_maps=True)
    pair, _ = criterion_pair("green eyes", doc, candidate)
    (item,), *_ = runtime.plan([pair], runtime.packages.find([reference, candidate]), Truncation(RERANK_MAX_LENGTH))
    model = runtime.loaded.model
    ids = torch.tensor([item.ids])
    image_type = (ids == runtime.loaded.image_token_id).to(torch.int32)
    positions = mrope_positions(ids, torch.ones_like(ids), [p.grid_thw for p in item.packages],
                                runtime.loaded.image_token_id, 2)
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            out = model(input_ids=ids, position_ids=positions, use_cache=False, output_attentions=True,
                        **mm_kwargs(runtime.loaded, item.packages, image_type))
    finally:
        model.set_attn_implementation("sdpa")
    last = torch.stack(out.attentions[-ATTENTION_LAYERS:])[:, 0, :, -1].mean(dim=(0, 1))
    where = torch.nonzero(ids[0] == runtime.loaded.image_token_id).flatten()
    expected = torch.cat([v for image in evidence.images for row in image.values for v in [torch.tensor(row)]])
    assert torch.allclose(expected, last[where], atol=1e-5)
    assert all(v >= 0 for v in expected.tolist()) and float(expected.sum()) < 1
