"""Training the demo embedder: InfoNCE with instructions, as in the Qwen3-VL-Embedding technical report.

Queries are what search sends (``retrieval/search/service.py``): the candidate image (if any) followed by
the rubric text, under the recall instruction of ``retrieval/search/instructions.py``; documents are
reference images under the default instruction, as ingestion embeds them. Each query has one positive (a
training face it is relevant to), one hard negative (a face that misses by exactly one attribute) and every
other document of the batch as negatives, except those the ground truth marks relevant (false negatives
are masked, as the report masks them). The loss is also taken on a truncated prefix of the vectors
(Matryoshka), so ``dimensions`` works as it does with the real model.

Before the contrastive steps the vision tower is pre-trained to classify the faces' attributes (a throwaway
linear head on its pooled tokens, 960 training faces), as a real tower is pre-trained before the embedder
is built on it. Contrastive steps alone leave the tiny tower blind to ears, forehead stripes and eye colour
(a linear probe on held-out faces reads all three far better after the pre-training: docs/performance.md,
"Measurements behind the code"; ``bench/tower_probe.py`` probes a tower today), and the reranker, which keeps
this tower, cannot learn what the tower does not show.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Face
from rubricsearch.app.demo.rubrics import KINDS, Query, QueryKind, sample_query
from rubricsearch.app.demo.training import ImageBank, Trainee, adamw_one_cycle, content, pooled_tokens, train
from rubricsearch.retrieval.qwen.engine.forward import LMInput
from rubricsearch.retrieval.qwen.model.prompts import EMBED_DEFAULT_INSTRUCTION, embed_conversation
from rubricsearch.retrieval.search.instructions import Rubric, build

log = logging.getLogger("rubricsearch.demo")


@dataclass(frozen=True)
class EmbedderRecipe:
    steps: int = 60
    batch: int = 32
    pool: int = 16
    lr: float = 1e-3
    temperature: float = 0.05
    mix: tuple[float, ...] = (0.35, 0.2, 0.2, 0.25)  # KINDS order
    matryoshka: tuple[int, ...] = (64,)
    tower_steps: int = 200  # attribute pre-training of the vision tower before the contrastive steps
    tower_batch: int = 48
    tower_images: int = 960  # training faces the tower sees (the contrastive steps use the first train_images)
    tower_lr: float = 2e-3


class AttributeHead(torch.nn.Module):
    """A linear classifier of every attribute from a package's tokens (mean- and max-pooled), trained with the
    embedder and then discarded. A contrastive loss alone teaches the tiny tower the attributes that separate
    most faces (fur, species) and leaves ears, stripes and eye colour barely decodable; this term makes the
    tower encode every attribute a rubric can name, for the embedder and for the reranker that keeps it."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(2 * width, sum(len(VALUES[a]) for a in ATTRIBUTES))

    def loss(self, tokens: list[torch.Tensor], faces: list[Face]) -> torch.Tensor:
        pooled = torch.stack([pooled_tokens(t) for t in tokens])
        logits = torch.split(self.linear(pooled), [len(VALUES[a]) for a in ATTRIBUTES], dim=-1)
        return torch.stack([F.cross_entropy(lg, torch.tensor([VALUES[a].index(f.value(a)) for f in faces]))
                            for a, lg in zip(ATTRIBUTES, logits, strict=True)]).mean()


def query_instruction(query: Query) -> str:
    """The recall instruction search builds for this query."""
    rubric = Rubric.parse(None, query.texts)
    return build(rubric, query.candidate is not None).query


def misses_by_one(query: Query, face: Face) -> bool:
    if query.criteria:
        return sum(not c.holds(face) for c in query.criteria) == 1
    assert query.candidate is not None
    return sum(face.value(a) != query.candidate.value(a) for a in ATTRIBUTES) == 1


def _batch(bank: ImageBank, recipe: EmbedderRecipe, rng: random.Random
           ) -> tuple[list[Query], list[int | None], list[int], list[int]]:
    """Queries, their candidate images, a document pool, and each query's positive (an index into the pool).

    The pool starts as random training faces (shared negatives); a query whose relevant faces are all
    missing from it brings one in, and one face that misses it by exactly one attribute (a hard negative)."""
    pool = rng.sample(range(len(bank.faces)), recipe.pool)
    queries: list[Query] = []
    cands: list[int | None] = []
    positive: list[int] = []
    while len(queries) < recipe.batch:
        kind: QueryKind = rng.choices(KINDS, weights=recipe.mix)[0]
        q = sample_query(rng, kind, bank.faces)
        ci = bank.faces.index(q.candidate) if q.candidate is not None else None
        hits = [k for k, i in enumerate(pool) if i != ci and q.relevant(bank.faces[i])]
        if not hits:
            p = bank.pick(rng, q.relevant, avoid=ci)
            if p is None:
                continue
            pool.append(p)
            hits = [len(pool) - 1]
        if not any(misses_by_one(q, bank.faces[i]) for i in pool):
            n = bank.pick(rng, lambda f, q=q: misses_by_one(q, f))
            if n is not None:
                pool.append(n)
        queries.append(q)
        cands.append(ci)
        positive.append(rng.choice(hits))
    return queries, cands, pool, positive


def pretrain_tower(trainee: Trainee, bank: ImageBank, recipe: EmbedderRecipe, rng: random.Random) -> list[float]:
    """Supervised pre-training of the vision tower (and its merger) on the faces' attributes, as a real tower
    is pre-trained before the embedder is; returns the loss per step."""
    head = AttributeHead(int(trainee.full.model.visual.merger.linear_fc2.out_features))
    params = list(trainee.full.model.visual.parameters()) + list(head.parameters())

    def loss_of(batch: list[int]) -> torch.Tensor:
        pk = trainee.packages(bank, batch)
        return head.loss([pk[i].embeds for i in batch], [bank.faces[i] for i in batch])

    batches = (rng.sample(range(len(bank.faces)), recipe.tower_batch) for _ in itertools.count())
    return train(trainee.full, recipe.tower_steps, adamw_one_cycle(params, recipe.tower_lr, recipe.tower_steps, 0.1),
                 batches, loss_of, "vision tower")


def train_embedder(trainee: Trainee, bank: ImageBank, recipe: EmbedderRecipe, rng: random.Random) -> list[float]:
    """Train in place; returns the loss per step."""
    pretrain_tower(trainee, ImageBank.build(trainee.encoder, "train", max(recipe.tower_images, len(bank.faces)),
                                            seed=bank.seed), recipe, rng)
    params = [p for p in trainee.full.model.parameters() if p.requires_grad]

    def loss_of(batch: tuple[list[Query], list[int | None], list[int], list[int]]) -> torch.Tensor:
        queries, cands, pool, positive = batch
        pk = trainee.packages(bank, [i for i in cands if i is not None] + pool)
        q_inputs = []
        for q, ci in zip(queries, cands, strict=True):
            c = content(bank.images[ci] if ci is not None else None, ["; ".join(q.texts)] if q.texts else [])
            conv = embed_conversation(c, query_instruction(q), EMBED_DEFAULT_INSTRUCTION)
            q_inputs.append(trainee.lm_input(conv, c.images, [pk[ci]] if ci is not None else []))
        d_inputs: list[LMInput] = []
        for i in pool:
            c = content(bank.images[i], [])
            d_inputs.append(trainee.lm_input(embed_conversation(c, None, EMBED_DEFAULT_INSTRUCTION), c.images, [pk[i]]))
        qs, ds = trainee.states(q_inputs), trainee.states(d_inputs)
        # ground truth: the documents a query may not be pushed away from (false negatives are masked)
        mask = torch.tensor([[q.relevant(bank.faces[i]) for i in pool] for q in queries])
        target = torch.tensor(positive)
        mask[torch.arange(len(queries)), target] = False
        loss = torch.zeros(())
        for dim in (None, *recipe.matryoshka):
            qv = F.normalize(qs[:, :dim] if dim else qs, dim=-1)
            dv = F.normalize(ds[:, :dim] if dim else ds, dim=-1)
            logits = (qv @ dv.T / recipe.temperature).masked_fill(mask, float("-inf"))
            loss = loss + F.cross_entropy(logits, target)
        return loss / (1 + len(recipe.matryoshka))

    batches = (_batch(bank, recipe, rng) for _ in itertools.count())
    return train(trainee.full, recipe.steps, adamw_one_cycle(params, recipe.lr, recipe.steps, 0.1), batches, loss_of,
                 "embedder")
