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
  rows of one forward and backward pass; the values add up to the logit's change along the path.
- ``occlusion``: the drop of the logit when a token's embedding and deepstack features are replaced by the
  image's mean token; every token of the image is occluded in batched rows over the shared prompt prefix.
- ``attention``: the share of the last token's attention (whose state the logit reads) on each image token,
  averaged over the heads and the last :data:`ATTENTION_LAYERS` layers; one forward pass. It is unsigned and
  does not involve the yes/no head: it says where the model looked, not which way that weighed.

For the three others a positive value supports "yes" (the statement holds), a negative one "no". The
preprocessing resizes the whole image (no crop) to whole multiples of ``patch × merge`` pixels (``smart_resize``),
so each cell covers a proportional box of the original image (:func:`cell_boxes`).

Negated criteria ("no forehead stripes") are judged as their positive statement and scored 1 − P(statement)
(:func:`rerank.rubric.judged`); their evidence is that of the positive statement, and says so (``of``).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any, Literal, get_args

import torch

from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.prefix import run_shared_prefixes
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import rubric_instructions
from rubricsearch.rerank.task import RERANK_MAX_LENGTH
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import ImageLike
from rubricsearch.retrieval.packages import Usage, VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import LMInput, pooled_states
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.core import Truncation
from rubricsearch.retrieval.search.instructions import Rubric
from rubricsearch.retrieval.search.protocol import Judged

Method = Literal["gradient_x_input", "integrated_gradients", "occlusion", "attention"]
METHODS: tuple[Method, ...] = get_args(Method)
# Chosen on the demo truth (bench/evidence_quality.py; docs/performance.md, "Per-criterion evidence"): of the four
# methods only occlusion and gradient x input pointed at every drawn attribute as often as the target asks, and
# occlusion more often, above a random-weight reranker's maps on every attribute; integrated gradients was as
# accurate on average but missed the target on one attribute at several times occlusion's cost on small images.
DEFAULT_METHOD: Method = "occlusion"
# Occlusion runs one LM row per merged token, each with its own copy of the package (rows x tokens x width), so
# its time and memory grow with the square of the tokens. Unasked, it is used up to a 224-px image's 64 tokens
# (the demo's are 16) and gradient x input beyond; asked for, up to a 448-px image's 256 tokens (a 12-MP photo
# has about 2,350: 84x the rows and copies of a 448-px image).
OCCLUSION_DEFAULT_TOKENS = 64
OCCLUSION_MAX_TOKENS = 256
# Points on integrated gradients' path (trapezoid rule, both ends included: the baseline and the pair itself).
IG_STEPS = 8
# Attention averaged over this many of the last layers (chosen on the demo's `tune` faces, not the held-out ones).
ATTENTION_LAYERS = 2
# A backward pass keeps every layer's activations: its rows take this fraction of the forward's token budget.
GRADIENT_TOKEN_SHARE = 4
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
            *, candidate: ImageLike | None = None, method: Method | None = None) -> Evidence:
    """The evidence of one criterion judged on ``document`` (a reference, and the candidate when given): a map
    over every image of the pair. ``sizes`` gives each image's original width and height by sha256. Without a
    ``method``, :data:`DEFAULT_METHOD` where every image is small enough for it, else ``gradient_x_input``."""
    if method is not None and method not in METHODS:
        raise InvalidInput(f"unknown evidence method {method!r}; one of {', '.join(METHODS)}")
    pair, judged = criterion_pair(criterion, document, candidate)
    usage = Usage()
    images = [*pair.query.images, *pair.document.images]
    by_sha = {pkg.image_sha256: pkg for pkg in runtime.packages.get_or_encode(images, usage=usage)}
    inputs, *_ = runtime.plan([pair], by_sha, Truncation(RERANK_MAX_LENGTH))
    item = inputs[0]
    largest = max((pkg.tokens for pkg in item.packages), default=0)
    if method is None:
        method = DEFAULT_METHOD if largest <= OCCLUSION_DEFAULT_TOKENS else "gradient_x_input"
    if method == "occlusion" and largest > OCCLUSION_MAX_TOKENS:
        raise InvalidInput(f"occlusion explains images of at most {OCCLUSION_MAX_TOKENS} merged tokens (one LM row "
                           f"and one package copy per token); this pair has an image of {largest}: ask for "
                           "gradient_x_input", tokens=largest)
    logit, per_token = _COMPUTE[method](runtime, item)
    query_role: list[Role] = ["query"]
    document_role: list[Role] = ["document"]
    roles = query_role * len(pair.query.images) + document_role * len(pair.document.images)
    maps = []
    for img, role, pkg, values in zip(images, roles, item.packages, per_token, strict=True):
        size = sizes.get(img.sha256)
        if size is None:
            raise InvalidInput(f"the original size of image {img.sha256[:12]} is unknown")
        maps.append(image_map(img.sha256, role, pkg, values, size))
    return Evidence(method=method, criterion=judged.criterion, statement=judged.statement, negated=judged.negated,
                    instruction=pair.instruction or "", p_yes=float(torch.sigmoid(torch.tensor(logit))),
                    images=maps, vision_encodes=usage.total())


def image_map(sha256: str, role: Role, pkg: VisualPackage, values: torch.Tensor, size: tuple[int, int]
              ) -> ImageEvidence:
    """Per-token values of one package laid out on its merged grid (frames of a video summed)."""
    t, h, w = pkg.grid_thw
    merge = pkg.fingerprint.merge_size
    grid = values.reshape(t, h // merge, w // merge).sum(dim=0)
    return ImageEvidence(sha256=sha256, role=role, size=size, grid=(h // merge, w // merge),
                         boxes=cell_boxes(pkg.grid_thw, pkg.fingerprint.patch_size, merge, size),
                         values=grid.tolist())


def path_gradients(runtime: LocalScoringRuntime, item: LMInput, alphas: Sequence[float], weights: Sequence[float]
                   ) -> tuple[float, list[torch.Tensor]]:
    """The pair's logit, and per package ``[tokens]``: Σ over channels of (x − x̄) · Σₖ wₖ ∂logit/∂x at
    x̄ + αₖ(x − x̄), over the embeddings and the deepstack features, x̄ each image's mean token (all images of the
    pair move along the path together). ``alphas`` must end at 1 (the pair itself, whose logit is returned).
    The points of the path are rows of one forward and backward pass, as many as fit the runtime's budget."""
    deviations = [(pkg.embeds.to(torch.float32) - pkg.embeds.to(torch.float32).mean(dim=0),
                   pkg.deepstack.to(torch.float32) - pkg.deepstack.to(torch.float32).mean(dim=1, keepdim=True))
                  for pkg in item.packages]
    totals = [(torch.zeros_like(e), torch.zeros_like(d)) for e, d in deviations]
    per_pass = max(1, min(runtime.batch_size, runtime.max_batch_tokens // GRADIENT_TOKEN_SHARE // len(item.ids)))
    logits: list[torch.Tensor] = []
    for first in range(0, len(alphas), per_pass):
        chunk = alphas[first:first + per_pass]
        leaves = [(_on_path(pkg.embeds, dev_e, chunk, 0), _on_path(pkg.deepstack, dev_d, chunk, 1))
                  for pkg, (dev_e, dev_d) in zip(item.packages, deviations, strict=True)]
        rows = [LMInput(ids=item.ids, packages=[replace(pkg, embeds=e[k], deepstack=d[k])
                                                for pkg, (e, d) in zip(item.packages, leaves, strict=True)])
                for k in range(len(chunk))]
        with torch.inference_mode(False), torch.enable_grad():
            hidden = pooled_states(runtime.loaded, rows, runtime.pad_id)
            row_logits = hidden.to(torch.float32) @ runtime.weight.to(hidden.device)
            grads = torch.autograd.grad(row_logits.sum(), [t for pair in leaves for t in pair])
        logits.append(row_logits.detach().cpu())
        for i, (total_e, total_d) in enumerate(totals):
            w = torch.tensor(weights[first:first + per_pass], dtype=torch.float32, device=total_e.device)
            total_e += torch.einsum("k,ktc->tc", w, grads[2 * i].to(total_e.device))
            total_d += torch.einsum("k,kltc->ltc", w, grads[2 * i + 1].to(total_d.device))
    out = [((dev_e * total_e).sum(dim=-1) + (dev_d * total_d).sum(dim=(0, 2))).cpu()
           for (dev_e, dev_d), (total_e, total_d) in zip(deviations, totals, strict=True)]
    return float(torch.cat(logits)[-1]), out


def _on_path(tensor: torch.Tensor, deviation: torch.Tensor, alphas: Sequence[float], token_dim: int) -> torch.Tensor:
    """``[len(alphas), *tensor.shape]``: the image's mean token plus α times each token's deviation, a leaf."""
    mean = tensor.to(torch.float32).mean(dim=token_dim, keepdim=True)
    scale = torch.tensor(alphas, dtype=torch.float32, device=tensor.device).reshape(-1, *([1] * tensor.dim()))
    return (mean + scale * deviation).requires_grad_(True)


def attention(runtime: LocalScoringRuntime, item: LMInput) -> tuple[float, list[torch.Tensor]]:
    """The pair's logit, and per package ``[tokens]``: the share of the last token's attention on each image token,
    averaged over the heads and the last :data:`ATTENTION_LAYERS` layers. The forward pass is the scoring one (its
    attention kernel returns no weights); hooks on those layers' attention recompute the last token's query row
    from the layer's own projections, norms and rotary embedding, and softmax it over the keys as transformers'
    eager attention does (one row, so no padding to mask)."""
    from transformers.models.qwen3_vl.modeling_qwen3_vl import apply_rotary_pos_emb, repeat_kv

    layers = runtime.loaded.model.language_model.layers[-ATTENTION_LAYERS:]
    caller = threading.get_ident()  # the hooks see only this pass, not a search running beside it
    rows: list[torch.Tensor] = []

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        if threading.get_ident() != caller:
            return
        hidden = kwargs["hidden_states"]
        shape = (*hidden.shape[:-1], -1, module.head_dim)
        query = module.q_norm(module.q_proj(hidden).view(shape)).transpose(1, 2)
        key = module.k_norm(module.k_proj(hidden).view(shape)).transpose(1, 2)
        query, key = apply_rotary_pos_emb(query, key, *kwargs["position_embeddings"])
        scores = query[:, :, -1:] @ repeat_kv(key, module.num_key_value_groups).transpose(2, 3) * module.scaling
        rows.append(torch.softmax(scores.to(torch.float32), dim=-1)[0, :, 0].mean(dim=0).cpu())

    handles = [layer.self_attn.register_forward_hook(hook, with_kwargs=True) for layer in layers]
    try:
        with torch.inference_mode():
            hidden = pooled_states(runtime.loaded, [item], runtime.pad_id)
    finally:
        for handle in handles:
            handle.remove()
    shares = torch.stack(rows).mean(dim=0)
    starts = _image_runs(item.ids, runtime.loaded.image_token_id)
    out = [shares[start:start + pkg.tokens] for pkg, start in zip(item.packages, starts, strict=True)]
    return float(hidden[0].to(torch.float32) @ runtime.weight.to(hidden.device)), out


def occlusion(runtime: LocalScoringRuntime, item: LMInput) -> tuple[float, list[torch.Tensor]]:
    """The pair's logit, and per package ``[tokens]``: the logit's drop with one token replaced by the image's mean
    token. Rows share the prompt up to the occluded image's tokens (one prefix pass per image)."""
    weight = runtime.weight
    starts = _image_runs(item.ids, runtime.loaded.image_token_id)
    logit: float | None = None
    out: list[torch.Tensor] = []
    for k, (pkg, start) in enumerate(zip(item.packages, starts, strict=True)):
        prefix = LMInput(ids=item.ids[:start], packages=item.packages[:k])
        rest_ids, after = item.ids[start:], item.packages[k + 1:]
        rows = [LMInput(ids=rest_ids, packages=[pkg, *after])]
        rows += [LMInput(ids=rest_ids, packages=[_occluded(pkg, i), *after]) for i in range(pkg.tokens)]
        states = run_shared_prefixes(runtime.loaded, [(prefix, rows)], runtime.pad_id, max_batch=runtime.batch_size,
                                     max_bytes=runtime.prefix_batch_bytes)[0]
        logits = (states @ weight.to(states.device)).cpu()
        logit = float(logits[0]) if logit is None else logit
        out.append(logits[0] - logits[1:])
    if logit is None:
        raise InvalidInput("the pair has no image to explain")
    return logit, out


def gradient_x_input(runtime: LocalScoringRuntime, item: LMInput) -> tuple[float, list[torch.Tensor]]:
    """(x − x̄) · ∂logit/∂x at the pair itself: one forward and one backward pass."""
    return path_gradients(runtime, item, (1.0,), (1.0,))


def integrated_gradients(runtime: LocalScoringRuntime, item: LMInput) -> tuple[float, list[torch.Tensor]]:
    """(x − x̄) · the mean gradient on the straight path from the mean tokens to the pair: the values sum to the
    logit's change from the all-mean images to the pair, up to the trapezoid rule's error."""
    alphas = [k / IG_STEPS for k in range(IG_STEPS + 1)]
    weights = [(0.5 if k in (0, IG_STEPS) else 1.0) / IG_STEPS for k in range(IG_STEPS + 1)]
    return path_gradients(runtime, item, alphas, weights)


_COMPUTE: dict[Method, Callable[[LocalScoringRuntime, LMInput], tuple[float, list[torch.Tensor]]]] = {
    "gradient_x_input": gradient_x_input, "integrated_gradients": integrated_gradients, "occlusion": occlusion,
    "attention": attention}


def _occluded(pkg: VisualPackage, token: int) -> VisualPackage:
    embeds, deepstack = pkg.embeds.clone(), pkg.deepstack.clone()
    embeds[token] = pkg.embeds.mean(dim=0)
    deepstack[:, token] = pkg.deepstack.mean(dim=1)
    return replace(pkg, embeds=embeds, deepstack=deepstack)


def _image_runs(ids: Sequence[int], image_token_id: int) -> list[int]:
    """Where each run of image tokens starts (one run per image, in the packages' order)."""
    return [i for i, t in enumerate(ids) if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]
