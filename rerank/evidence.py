"""Per-criterion visual evidence: where in an image the reranker's judgement of a statement came from.

The reranker's logit of a pair is ``h_last · (w_yes − w_no)`` (:class:`~rerank.local.LocalScoringRuntime`). The
evidence over one image of the pair is one value per merged visual token of that image's cached package,
shaped as the package's merged grid (rows × columns after the 2×2 merge). Every method runs the language model
alone over the cached packages, so the vision tower never runs (``vision_encodes`` counts the tower runs the
package lookup needed: 0 for an ingested reference):

- ``gradient_x_input``: one forward and one backward pass; a token's value is the sum over channels of
  ∂logit/∂x · (x − x̄) over its merged embedding and its deepstack features, x̄ the image's mean token: the
  first-order estimate of the occlusion below. Measured from x = 0 instead, tokens whose features are large
  everywhere (the background's) drown small, decisive parts such as the eyes (docs/performance.md).
- ``integrated_gradients``: the same product with the gradient averaged along the straight path from the mean
  tokens (every token of every image of the pair at x̄) to the pair, :data:`IG_STEPS` intervals whose points are
  rows of one forward and backward pass; the values over every image of the pair (the candidate's maps included)
  add up to the logit's change along the path.
- ``occlusion``: the drop of the logit when a token's embedding and deepstack features are replaced by the
  image's mean token; every token of the image is occluded in batched rows over the shared prompt prefix.
- ``attention``: the share of the last token's attention (whose state the logit reads) on each image token,
  averaged over the heads and the last :data:`ATTENTION_LAYERS` layers; one forward pass. It is unsigned and
  does not involve the yes/no head: it says where the model looked, not which way that weighed.

For the three others a positive value supports "yes" (the statement holds), a negative one "no". The
preprocessing resizes the whole image (no crop) to whole multiples of ``patch × merge`` pixels (``smart_resize``),
so each cell covers a proportional box of the original image (:func:`cell_boxes`).

A search's maps (its hits × criteria) are computed together (:func:`explain_many`): the pairs' rows share
passes up to the runtime's budgets, and each map is the one its pair gives alone. The maps cover the document's
images, and the candidate's only when asked for (``candidate_maps``). The gradient methods run the documents as
rows after their criterion's prompt and candidate, which take no gradient (causal attention: the document's
gradient never flows through them); the candidate's own map needs the gradient through that prefix, so its pairs
run whole (:mod:`rerank.gradients`). Occlusion's rows share the prompt up to the occluded image, as the rerank's
documents share theirs.

Negated criteria ("no forehead stripes") are judged as their positive statement and scored 1 − P(statement)
(:func:`rerank.rubric.judged`); their evidence is that of the positive statement, and says so (``of``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch

from rubricsearch.rerank.gradients import Path, document_gradients, image_runs, whole_pair_gradients
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.prefix import run_shared_prefixes
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import rubric_instructions
from rubricsearch.rerank.task import RERANK_MAX_LENGTH
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import Usage, VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import LMInput, plan_batches, pooled_states
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.core import Truncation
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.search.protocol import Judged

Method = Literal["gradient_x_input", "integrated_gradients", "occlusion", "attention"]
METHODS: tuple[Method, ...] = get_args(Method)
# Chosen on speed and the demo truth together (docs/performance.md, "Per-criterion evidence"): gradient x input
# points at every drawn attribute as often as the target asks, and is the only such method whose cost (a forward
# and an input-gradient backward) can stay within a search's own rerank; occlusion (one LM row per merged token)
# and integrated gradients (a backward per point of the path) cost many times the rerank by their arithmetic.
DEFAULT_METHOD: Method = "gradient_x_input"
# Asked for, occlusion runs one LM row per merged token, each with its own copy of the package (rows x tokens x
# width), so its time and memory grow with the square of the tokens: up to a 448-px image's 256 tokens (a 12-MP
# photo has about 2,350: 84x the rows and copies of a 448-px image).
OCCLUSION_MAX_TOKENS = 256
# Points on integrated gradients' path (trapezoid rule, both ends included: the baseline and the pair itself).
IG_STEPS = 8
# Attention averaged over this many of the last layers (chosen on the demo's `tune` faces, not the held-out ones).
ATTENTION_LAYERS = 2
Role = Literal["document", "query"]
Box = tuple[float, float, float, float]  # left, top, right, bottom in original-image pixels


@dataclass(frozen=True)
class ImageEvidence:
    """The map over one image of the pair: ``values[r][c]`` for the merged cell at row ``r``, column ``c``."""

    sha256: str
    role: Role  # the document (the reference judged) or the query's image (the candidate)
    size: tuple[int, int]  # the original image's width and height
    grid: tuple[int, int]  # merged rows and columns
    boxes: list[list[Box]]
    values: list[list[float]]


@dataclass(frozen=True)
class Evidence:
    """One judgement's evidence: the statement judged, its raw P(yes), and a map per image of the pair."""

    method: Method
    criterion: str
    statement: str
    negated: bool
    instruction: str
    p_yes: float  # the reranker's raw P(statement), before any judgement calibration and negation
    images: list[ImageEvidence]
    vision_encodes: int

    @property
    def of(self) -> Literal["statement", "positive statement"]:
        """What the maps explain: a negated criterion's maps are those of its positive statement."""
        return "positive statement" if self.negated else "statement"


def cell_boxes(grid_thw: tuple[int, int, int], patch: int, merge: int, size: tuple[int, int]) -> list[list[Box]]:
    """The box of the original image (``size`` = width, height) each merged cell covers: the resize maps the whole
    image onto ``grid_h · patch`` × ``grid_w · patch`` pixels, so a cell scales back by the same ratios."""
    _, h, w = grid_thw
    rows, cols = h // merge, w // merge
    sx, sy = size[0] / (w * patch), size[1] / (h * patch)
    step = patch * merge
    return [[(c * step * sx, r * step * sy, (c + 1) * step * sx, (r + 1) * step * sy) for c in range(cols)]
            for r in range(rows)]


def criterion_pair(criterion: str, document: Content, candidate: ImageLike | None = None) -> tuple[Pair, Judged]:
    """The pair search judges for one criterion (:meth:`rerank.rubric.RubricReranker.score`): its positive
    statement as the query, with the candidate image when there is one, under the per-criterion instruction."""
    instr = rubric_instructions(Rubric.parse(None, [criterion]), candidate is not None)
    judged = instr.judged[0]
    query = Content(texts=[judged.statement], images=[candidate] if candidate is not None else [])
    return Pair(query, document, instr.per_criterion[0]), judged


def explain(runtime: LocalScoringRuntime, criterion: str, document: Content, sizes: Mapping[str, tuple[int, int]],
            *, candidate: ImageLike | None = None, method: Method | None = None, candidate_maps: bool = False
            ) -> Evidence:
    """The evidence of one criterion judged on ``document`` (a reference, judged against the candidate when
    given): a map over each of the document's images, and over the candidate too with ``candidate_maps``.
    ``sizes`` gives each image's original width and height by sha256."""
    return explain_many(runtime, [(criterion, document)], sizes, candidate=candidate, method=method,
                        candidate_maps=candidate_maps)[0]


def explain_many(runtime: LocalScoringRuntime, asks: Sequence[tuple[str, Content]],
                 sizes: Mapping[str, tuple[int, int]], *, candidate: ImageLike | None = None,
                 method: Method | None = None, candidate_maps: bool = False) -> list[Evidence]:
    """The evidence of every (criterion, document) of ``asks`` (one search's hits × criteria), each as
    :func:`explain` gives it alone, computed together: the pairs' rows share forward (and backward) passes as far
    as the runtime's budgets allow. Without a ``method``, :data:`DEFAULT_METHOD`. The candidate's maps, asked for
    with ``candidate_maps``, cost the gradient methods a backward through each whole pair besides the documents'
    (module docstring)."""
    if method is not None and method not in METHODS:
        raise InvalidInput(f"unknown evidence method {method!r}; one of {', '.join(METHODS)}")
    chosen: Method = method or DEFAULT_METHOD
    judged_pairs = [criterion_pair(criterion, document, candidate) for criterion, document in asks]
    pairs = [pair for pair, _ in judged_pairs]
    pair_images = [[*pair.query.images, *pair.document.images] for pair in pairs]
    unsized = [img.sha256 for images in pair_images for img in images if img.sha256 not in sizes]
    if unsized:
        raise InvalidInput(f"the original size of image {unsized[0][:12]} is unknown")
    # the pairs repeat the candidate and each hit (one pair per criterion): every image is looked up once, together,
    # and an answer counts the tower runs of the images it was the first to need
    by_sha = runtime.packages.find({img.sha256: img for images in pair_images for img in images}.values())
    encodes: list[int] = []
    for images in pair_images:
        usage = Usage()
        missing = [img for img in images if img.sha256 not in by_sha]
        if missing:
            by_sha |= {pkg.image_sha256: pkg for pkg in runtime.packages.get_or_encode(missing, usage=usage)}
        encodes.append(usage.total())
    inputs, *_ = runtime.plan(pairs, by_sha, Truncation(RERANK_MAX_LENGTH))
    queries = 1 if candidate is not None else 0
    shown = 0 if candidate_maps else queries
    largest = max((pkg.tokens for item in inputs for pkg in item.packages[shown:]), default=0)
    if chosen == "occlusion" and largest > OCCLUSION_MAX_TOKENS:
        raise InvalidInput(f"occlusion explains images of at most {OCCLUSION_MAX_TOKENS} merged tokens (one LM row "
                           f"and one package copy per token); this pair has an image of {largest}: ask for "
                           "gradient_x_input", tokens=largest)
    if any(len(item.packages) <= queries for item in inputs):
        raise InvalidInput("the document has no image to explain")
    computed = _COMPUTE[chosen](runtime, inputs, queries, candidate_maps)
    out = []
    for (pair, judged), images, item, (logit, per_token), vision_encodes in zip(
            judged_pairs, pair_images, inputs, computed, encodes, strict=True):
        query_role: list[Role] = ["query"]
        document_role: list[Role] = ["document"]
        roles = query_role * (queries - shown) + document_role * len(pair.document.images)
        maps = [image_map(img.sha256, role, pkg, values, sizes[img.sha256])
                for img, role, pkg, values in zip(images[shown:], roles, item.packages[shown:], per_token,
                                                  strict=True)]
        out.append(Evidence(method=chosen, criterion=judged.criterion, statement=judged.statement,
                            negated=judged.negated, instruction=pair.instruction or "",
                            p_yes=float(torch.sigmoid(torch.tensor(logit))), images=maps,
                            vision_encodes=vision_encodes))
    return out


def image_map(sha256: str, role: Role, pkg: VisualPackage, values: torch.Tensor, size: tuple[int, int]
              ) -> ImageEvidence:
    """Per-token values of one package laid out on its merged grid (frames of a video summed)."""
    t, h, w = pkg.grid_thw
    merge = pkg.fingerprint.merge_size
    grid = values.reshape(t, h // merge, w // merge).sum(dim=0)
    return ImageEvidence(sha256=sha256, role=role, size=size, grid=(h // merge, w // merge),
                         boxes=cell_boxes(pkg.grid_thw, pkg.fingerprint.patch_size, merge, size),
                         values=grid.tolist())


# Per pair: its logit, and per package mapped ``[tokens]``: the query's (the candidate's) only when asked for, then
# the document's. Each method takes the pairs, how many of their packages are the query's, and whether to map them.
Computed = list[tuple[float, list[torch.Tensor]]]


def attention(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int, candidate_maps: bool
              ) -> Computed:
    """Per pair, its logit, and per package mapped ``[tokens]``: the share of the last token's attention on each image
    token, averaged over the heads and the last :data:`ATTENTION_LAYERS` layers. The forward passes are the scoring
    ones, the pairs right-padded into batches (their attention kernel returns no weights); hooks on those layers'
    attention recompute each row's last-token query from the layer's own projections, norms and rotary embedding,
    and softmax it over that row's keys as transformers' eager attention does (padding, right of it, left out)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb, repeat_kv

    layers = runtime.loaded.model.language_model.layers[-ATTENTION_LAYERS:]
    caller = threading.get_ident()  # the hooks see only this pass, not a search running beside it
    shares: list[torch.Tensor] = []
    last: list[torch.Tensor] = []  # the current batch's last real token per row

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if threading.get_ident() != caller:
            return
        hidden = kwargs["hidden_states"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        query = module.q_norm(module.q_proj(hidden).view(shape)).transpose(1, 2)
        key = module.k_norm(module.k_proj(hidden).view(shape)).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *kwargs["position_embeddings"])
        ends = last[0].to(hidden.device)
        rows = torch.arange(hidden.shape[0], device=hidden.device)
        own = query[rows, :, ends].unsqueeze(2)  # [B, heads, 1, D]
        scores = (own @ repeat_kv(key, module.num_key_value_groups).transpose(2, 3) * module.scaling)[:, :, 0]
        keys = torch.arange(scores.shape[-1], device=hidden.device)
        scores = scores.to(torch.float32).masked_fill((keys[None, :] > ends[:, None])[:, None], float("-inf"))
        shares.append(torch.softmax(scores, dim=-1).mean(dim=1).cpu())

    out: Computed = [(0.0, [])] * len(items)
    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        for batch in plan_batches(items, runtime.batch_size, runtime.max_batch_tokens):
            shares.clear()
            last[:] = [torch.tensor([len(items[i].ids) - 1 for i in batch])]
            with torch.inference_mode():
                hidden = pooled_states(runtime.loaded, [items[i] for i in batch], runtime.pad_id)
            logits = (hidden.to(torch.float32) @ runtime.weight.to(hidden.device)).cpu().tolist()
            mean = torch.stack(shares).mean(dim=0)
            for row, (i, logit) in enumerate(zip(batch, logits, strict=True)):
                starts = image_runs(items[i].ids, runtime.loaded.image_token_id)
                shown = 0 if candidate_maps else queries
                out[i] = (logit, [mean[row, start:start + pkg.tokens] for pkg, start in
                                  zip(items[i].packages[shown:], starts[shown:], strict=True)])
    finally:
        for handle in handles:
            handle.remove()
    return out


def occlusion(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int, candidate_maps: bool
              ) -> Computed:
    """Per pair, its logit, and per package mapped ``[tokens]``: the logit's drop with one token replaced by the image's
    mean token. A group per (pair, image): its rows share the prompt up to the occluded image's tokens; the groups
    of all pairs run together (:func:`rerank.prefix.run_shared_prefixes`), as many at once as keep the package
    copies within the runtime's shared-prefix batch memory."""
    weight = runtime.weight
    groups: list[tuple[int, LMInput, list[LMInput]]] = []  # (pair, prefix, rows: the pair, then one per token)
    for i, item in enumerate(items):
        starts = image_runs(item.ids, runtime.loaded.image_token_id)
        for k, (pkg, start) in enumerate(zip(item.packages, starts, strict=True)):
            if k < queries and not candidate_maps:
                continue
            rest_ids, after = item.ids[start:], item.packages[k + 1:]
            rows = [LMInput(ids=rest_ids, packages=[pkg, *after])]
            rows += [LMInput(ids=rest_ids, packages=[_occluded(pkg, t), *after]) for t in range(pkg.tokens)]
            groups.append((i, LMInput(ids=item.ids[:start], packages=item.packages[:k]), rows))
    logits: list[float | None] = [None] * len(items)
    maps: list[list[torch.Tensor]] = [[] for _ in items]
    for chunk in _by_bytes(groups, runtime.prefix_batch_bytes):
        states = run_shared_prefixes(runtime.loaded, [(prefix, rows) for _, prefix, rows in chunk], runtime.pad_id,
                                     max_batch=runtime.batch_size, max_bytes=runtime.prefix_batch_bytes)
        for (i, _, _), group_states in zip(chunk, states, strict=True):
            values = (group_states @ weight.to(group_states.device)).cpu()
            logits[i] = float(values[0]) if logits[i] is None else logits[i]
            maps[i].append(values[0] - values[1:])
    return [(float(logit or 0.0), per_image) for logit, per_image in zip(logits, maps, strict=True)]


def _by_bytes(groups: list[tuple[int, LMInput, list[LMInput]]], max_bytes: int
              ) -> list[list[tuple[int, LMInput, list[LMInput]]]]:
    """Consecutive groups whose rows' occluded package copies stay within ``max_bytes`` (at least one group)."""
    chunks: list[list[tuple[int, LMInput, list[LMInput]]]] = []
    used = 0
    for group in groups:
        pkg = group[2][0].packages[0]
        size = len(group[2]) * (pkg.embeds.numel() * pkg.embeds.element_size()
                                + pkg.deepstack.numel() * pkg.deepstack.element_size())
        if not chunks or used + size > max_bytes:
            chunks.append([])
            used = 0
        chunks[-1].append(group)
        used += size
    return chunks


# The gradient methods' paths (:mod:`rerank.gradients`): gradient x input is the pair itself; integrated gradients
# the trapezoid rule over IG_STEPS intervals from the mean tokens (both ends included).
GRADIENT_PATHS: dict[Method, Path] = {
    "gradient_x_input": ((1.0,), (1.0,)),
    "integrated_gradients": ([k / IG_STEPS for k in range(IG_STEPS + 1)],
                             [(0.5 if k in (0, IG_STEPS) else 1.0) / IG_STEPS for k in range(IG_STEPS + 1)])}


def gradient_x_input(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int, candidate_maps: bool
                     ) -> Computed:
    """(x − x̄) · ∂logit/∂x at the pair itself: one forward and one input-gradient backward of the documents'
    rows after their criterion's prefix (:mod:`rerank.gradients`)."""
    return _gradients(runtime, items, queries, candidate_maps, GRADIENT_PATHS["gradient_x_input"])


def integrated_gradients(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int,
                         candidate_maps: bool) -> Computed:
    """(x − x̄) · the mean gradient on the straight path from the mean tokens to the pair: the values sum to the
    logit's change from the all-mean images to the pair, up to the trapezoid rule's error."""
    return _gradients(runtime, items, queries, candidate_maps, GRADIENT_PATHS["integrated_gradients"])


def _gradients(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int, candidate_maps: bool,
               path: Path) -> Computed:
    """The documents' maps after their prefix; the candidate's, when asked for, from the whole pairs."""
    documents = document_gradients(runtime, items, queries, path)
    if not (candidate_maps and queries):
        return documents
    candidates = whole_pair_gradients(runtime, items, queries, path)
    return [(logit, [*candidate, *document])
            for (logit, document), (_, candidate) in zip(documents, candidates, strict=True)]


_COMPUTE: dict[Method, Callable[[LocalScoringRuntime, Sequence[LMInput], int, bool], Computed]] = {
    "gradient_x_input": gradient_x_input, "integrated_gradients": integrated_gradients, "occlusion": occlusion,
    "attention": attention}


def _occluded(pkg: VisualPackage, token: int) -> VisualPackage:
    embeds, deepstack = pkg.embeds.clone(), pkg.deepstack.clone()
    embeds[token] = pkg.embeds.mean(dim=0)
    deepstack[:, token] = pkg.deepstack.mean(dim=1)
    return replace(pkg, embeds=embeds, deepstack=deepstack)
