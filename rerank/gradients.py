"""The gradient methods' passes (:mod:`rerank.evidence`): Σ over channels of (x − x̄) · Σₖ wₖ ∂logit/∂x at the
points x̄ + αₖ(x − x̄) of a straight path, over a package's embeddings and deepstack features, x̄ each image's mean
token; every image of the pair moves along the path together. Gradient × input is the path's last point alone.

The reranker's prompt runs the candidate (the query's images and statement) before the document, and the
attention is causal: the keys and values of the prompt up to the document do not depend on the document's tokens.
So the logit's gradient with respect to a reference's tokens never flows through that prefix, and the reference
maps (:func:`document_gradients`) run each distinct prefix once, without gradients (one per criterion, and per
point of the path when the prefix holds the candidate, which moves along it), then the documents as continuation
rows with gradients on their own packages only, through the runtime's shortlist passes
(:meth:`rerank.local.LocalScoringRuntime.row_passes`, ``gradients``: packed on a GPU, as the rerank runs its
shortlist, and one CUDA-graph replay where small enough). The
candidate's own map needs the gradient through the prefix, which a prefix shared by several rows would sum over
them: :func:`whole_pair_gradients` runs each pair whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch

from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.qwen.engine.forward import LMInput, plan_batches, pooled_states

# A backward pass keeps every layer's activations: its rows take this fraction of the forward's token budget.
GRADIENT_TOKEN_SHARE = 4

Path = tuple[Sequence[float], Sequence[float]]  # the points' alphas (ending at 1: the pair itself), their weights
Deviation = tuple[torch.Tensor, torch.Tensor]  # x − x̄ of a package's embeddings and deepstack features
PerPair = list[tuple[float, list[torch.Tensor]]]  # per pair: its logit, and per explained package ``[tokens]``


def deviation(pkg: VisualPackage) -> Deviation:
    embeds, deepstack = pkg.embeds.to(torch.float32), pkg.deepstack.to(torch.float32)
    return embeds - embeds.mean(dim=0), deepstack - deepstack.mean(dim=1, keepdim=True)


def deviations(items: Sequence[LMInput]) -> list[list[Deviation]]:
    """Per item, each package's :func:`deviation`, computed once per image: a search's pairs repeat their
    candidate and each hit's reference (one pair per criterion)."""
    seen: dict[str, Deviation] = {}
    for pkg in (pkg for item in items for pkg in item.packages):
        if pkg.image_sha256 not in seen:
            seen[pkg.image_sha256] = deviation(pkg)
    return [[seen[pkg.image_sha256] for pkg in item.packages] for item in items]


def on_path(pkg: VisualPackage, dev: Deviation, alpha: float, grad: bool = False) -> VisualPackage:
    """The package at x̄ + α(x − x̄), its tensors leaves that take a gradient when ``grad``; the path's end
    without a gradient is the package itself."""
    if alpha == 1.0 and not grad:
        return pkg
    embeds = (pkg.embeds.to(torch.float32).mean(dim=0, keepdim=True) + alpha * dev[0]).requires_grad_(grad)
    deepstack = (pkg.deepstack.to(torch.float32).mean(dim=1, keepdim=True) + alpha * dev[1]).requires_grad_(grad)
    return replace(pkg, embeds=embeds, deepstack=deepstack)


def _product(dev: Deviation, grads: Sequence[torch.Tensor]) -> torch.Tensor:
    """Per token, Σ over channels of (x − x̄) · ∂logit/∂x, the embeddings' and every deepstack level's."""
    return (dev[0] * grads[0]).sum(dim=-1) + (dev[1] * grads[1]).sum(dim=(0, 2))


def _add(maps: list[torch.Tensor | None], devs: Sequence[Deviation], grads: Sequence[torch.Tensor],
         weight: float) -> None:
    """Add a point's weighted products to a pair's maps (its gradients two per package: embeddings, deepstack)."""
    for n, dev in enumerate(devs):
        term = _product(dev, grads[2 * n:2 * n + 2]) * weight
        before = maps[n]
        maps[n] = term if before is None else before + term


def _on_host(logits: list[float], maps: list[list[torch.Tensor | None]]) -> PerPair:
    """The pairs' maps moved to the host in one copy (each a view of it): a copy per map would wait on the
    device once per map."""
    flat = [m for per_pair in maps for m in per_pair if m is not None]
    assert len(flat) == sum(map(len, maps)), "every pair's rows ran at every point of the path"
    parts = iter(torch.cat(flat).cpu().split([m.numel() for m in flat]) if flat else [])
    return [(logit, [next(parts) for _ in per_pair]) for logit, per_pair in zip(logits, maps, strict=True)]


def document_gradients(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int, path: Path) -> PerPair:
    """Per pair, its logit and the map of each document package (those after the first ``queries``, the query's
    images): the prefix up to the document runs without gradients, once per distinct prefix and point of the
    path, and each (pair, point) is a continuation row whose document packages take the gradient. Rows of all pairs
    share forward and backward passes (:meth:`rerank.prefix.RowPasses.gradients`)."""
    alphas, weights = path
    splits = [_document_start(item, queries, runtime.loaded.image_token_id) for item in items]
    devs = deviations(items)
    maps: list[list[torch.Tensor | None]] = [[None] * (len(item.packages) - queries) for item in items]
    logits = [0.0] * len(items)
    keys: dict[tuple[object, ...], int] = {}  # a prefix's ids, its images and (when it has images) the point
    prefixes: list[tuple[LMInput, int, int]] = []  # (prefix as the pair has it, that pair, the point)
    rows: list[tuple[int, int, int]] = []  # (pair, point, prefix)
    for i, (item, split) in enumerate(zip(items, splits, strict=True)):
        for k, alpha in enumerate(alphas):
            key = (tuple(item.ids[:split]), *(p.image_sha256 for p in item.packages[:queries]),
                   alpha if queries else None)
            if key not in keys:
                keys[key] = len(prefixes)
                prefixes.append((LMInput(ids=item.ids[:split], packages=item.packages[:queries]), i, k))
            rows.append((i, k, keys[key]))
    budget = max(1, runtime.max_batch_tokens // GRADIENT_TOKEN_SHARE)
    passes = runtime.row_passes()
    for chunk in plan_batches([p for p, _, _ in prefixes], runtime.batch_size, runtime.max_batch_tokens):
        local = {g: n for n, g in enumerate(chunk)}
        on_its_point = [LMInput(ids=prefix.ids, packages=[on_path(pkg, dev, alphas[k]) for pkg, dev
                                                          in zip(prefix.packages, devs[i][:queries], strict=True)])
                        for prefix, i, k in (prefixes[g] for g in chunk)]
        mine = [r for r in rows if r[2] in local]
        row_logits, grads = passes.gradients(on_its_point, [
            (local[g], LMInput(ids=items[i].ids[splits[i]:], packages=[
                on_path(pkg, dev, alphas[k]) for pkg, dev in zip(items[i].packages[queries:], devs[i][queries:],
                                                                 strict=True)]))
            for i, k, g in mine], runtime.weight, max_batch=runtime.batch_size, max_tokens=budget)
        for (i, k, _), value, row_grads in zip(mine, row_logits.tolist(), grads, strict=True):
            if k == len(alphas) - 1:
                logits[i] = value
            _add(maps[i], devs[i][queries:], [g for pair in row_grads for g in pair], weights[k])
    return _on_host(logits, maps)


def whole_pair_gradients(runtime: LocalScoringRuntime, items: Sequence[LMInput], queries: int, path: Path
                         ) -> PerPair:
    """Per pair, its logit and the map of each of its first ``queries`` packages (the candidate's): every
    (pair, point of the path) is a whole row (the packages after them on the path too, without a gradient), rows
    of all pairs sharing forward and backward passes within the runtime's budget."""
    alphas, weights = path
    devs = deviations(items)
    maps: list[list[torch.Tensor | None]] = [[None] * queries for _ in items]
    logits = [0.0] * len(items)
    rows = [(i, k) for i in range(len(items)) for k in range(len(alphas))]
    budget = max(1, runtime.max_batch_tokens // GRADIENT_TOKEN_SHARE)
    for batch in plan_batches([items[i] for i, _ in rows], runtime.batch_size, budget):
        with torch.inference_mode(False), torch.enable_grad():
            lm_rows = [LMInput(ids=items[rows[r][0]].ids, packages=[
                on_path(pkg, dev, alphas[rows[r][1]], grad=n < queries)
                for n, (pkg, dev) in enumerate(zip(items[rows[r][0]].packages, devs[rows[r][0]], strict=True))])
                for r in batch]
            hidden = pooled_states(runtime.loaded, lm_rows, runtime.pad_id)
            row_logits = hidden.to(torch.float32) @ runtime.weight.to(hidden.device)
            grads = torch.autograd.grad(row_logits.sum(), [t for row in lm_rows for p in row.packages[:queries]
                                                           for t in (p.embeds, p.deepstack)])
        for n, (r, value) in enumerate(zip(batch, row_logits.detach().cpu().tolist(), strict=True)):
            i, k = rows[r]
            if k == len(alphas) - 1:
                logits[i] = value
            _add(maps[i], devs[i][:queries], grads[2 * queries * n:2 * queries * (n + 1)], weights[k])
    return _on_host(logits, maps)


def _document_start(item: LMInput, queries: int, image_token_id: int) -> int:
    """Where the document's first image starts in ``item.ids`` (after the query's ``queries`` images)."""
    return image_runs(item.ids, image_token_id)[queries]


def image_runs(ids: Sequence[int], image_token_id: int) -> list[int]:
    """Where each run of image tokens starts (one run per image, in the packages' order)."""
    return [i for i, t in enumerate(ids) if t == image_token_id and (i == 0 or ids[i - 1] != image_token_id)]
