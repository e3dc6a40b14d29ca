"""Training the demo reranker: yes/no cross-entropy on the product's reranker prompt.

Every pair is built as :class:`rerank.rubric.RubricReranker` builds it at search time: one judgement per
criterion (the criterion's positive statement as query, the candidate image kept, under the per-criterion
instruction; the label says whether the statement holds, so "no forehead stripes" teaches "forehead stripes"),
and for a candidate alone the overall judgement, rendered by :func:`rerank.prompts.rerank_conversation`. The
score trained is the one :class:`rerank.local.LocalScoringRuntime` computes, ``h_last · (w_yes − w_no)`` (the
two-way softmax over the ``yes`` and ``no`` logits), and the forward is the product's, the one the set fine-tune
trains through (:mod:`rerank.tuning.forward`: token ids and shared-prefix groups from
:meth:`rerank.local.LocalScoringRuntime.plan`, states from :func:`rerank.prefix.shared_prefix_states`, the body of
the shortlist forward), so what the model learns is what search asks. Sharing the prefix (system prompt,
instruction, query) between a query's documents also makes a pair several times cheaper to train (docs/demo.md).
The steps run the shared training loop (:func:`retrieval.tuning.loop.fit`) on freshly sampled judgements.

The reranker starts from the trained demo embedder (its vision tower and language model; the LM head from
the tied input embeddings, as the real checkpoints share them) and keeps the tower frozen: the tower is then
identical to the embedder's, one package per reference image serves both models, and the packages are
computed once instead of at every step. Documents per query: up to a third relevant faces, up to a third
that miss by exactly one attribute (hard negatives), the rest random.
"""

from __future__ import annotations

import itertools
import logging
import random
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from rubricsearch.app.demo.absent import absent_statement
from rubricsearch.app.demo.faces import ATTRIBUTES, VALUES, Criterion
from rubricsearch.app.demo.rubrics import KINDS, Query, QueryKind, sample_query
from rubricsearch.app.demo.train_embedder import misses_by_one
from rubricsearch.app.demo.training import ImageBank, Trainee, adamw_one_cycle, content, train
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.rubric import rubric_instructions
from rubricsearch.rerank.tuning.forward import run_states
from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.search.instructions import Rubric

log = logging.getLogger("rubricsearch.demo")

@dataclass(frozen=True)
class RerankerRecipe:
    steps: int = 1000
    queries: int = 3  # rubric groups per step
    documents: int = 10  # per rubric: judged overall and on every criterion
    lr: float = 1e-3
    warmup: float = 0.05
    mix: tuple[float, ...] = (0.3, 0.25, 0.15, 0.3)  # KINDS order
    # single-criterion groups per step: one criterion judged on balanced documents (half meet it)
    criteria: int = 5
    criterion_documents: int = 24
    attributes: tuple[float, ...] = (1.0, 0.5, 1.0, 0.5, 1.0)  # ATTRIBUTES order: how often each is asked
    negated: float = 0.0  # share of single criteria that name an absence
    with_candidate: float = 0.0  # share asked as a candidate's criterion (candidate image in the query)
    absent: float = 0.15  # share of single criteria that no face meets ("a bicycle"): all judged "no"
    absent_mixed: float = 0.4  # share of those that borrow a word of the criteria ("crimson fur", "ginger kettle")


def _documents(bank: ImageBank, q: Query, avoid: int | None, count: int, rng: random.Random) -> list[int]:
    """Up to a third relevant faces, up to a third near misses (one attribute off), the rest random."""
    relevant = [i for i, f in enumerate(bank.faces) if i != avoid and q.relevant(f)]
    near = [i for i, f in enumerate(bank.faces) if i != avoid and misses_by_one(q, f)]
    picked = rng.sample(relevant, min(len(relevant), count // 3)) + rng.sample(near, min(len(near), count // 3))
    rest = [i for i in range(len(bank.faces)) if i != avoid and i not in picked]
    return picked + rng.sample(rest, count - len(picked))


def single_criterion(bank: ImageBank, recipe: RerankerRecipe, rng: random.Random) -> tuple[list[Pair], list[bool]]:
    """One criterion on documents of which half meet it: the per-criterion judgement alone, with the
    attributes asked as often as ``recipe.attributes`` says (the rubric groups' documents are chosen for the
    whole rubric, so a hard attribute rarely gets a balanced set there)."""
    if rng.random() < recipe.absent:
        return _absent(bank, recipe, rng)
    attribute = rng.choices(ATTRIBUTES, weights=recipe.attributes)[0]
    criterion = Criterion(attribute, rng.choice(VALUES[attribute]), rng.random() < recipe.negated)
    if attribute == "stripes" and criterion.negated:  # "no forehead stripes" has one form: the plain value
        criterion = Criterion(attribute, "plain" if criterion.value == "stripes" else "stripes")
    ci = None
    if rng.random() < recipe.with_candidate:
        ci = bank.pick(rng, criterion.holds)
    meets = [i for i, f in enumerate(bank.faces) if i != ci and criterion.holds(f)]
    misses = [i for i, f in enumerate(bank.faces) if i != ci and not criterion.holds(f)]
    half = recipe.criterion_documents // 2
    docs = rng.sample(meets, min(half, len(meets))) + rng.sample(misses, min(half, len(misses)))
    instr = rubric_instructions(Rubric.parse(None, [criterion.text]), ci is not None)
    query = Content(texts=[instr.judged[0].statement], images=[bank.images[ci]] if ci is not None else [])
    return ([Pair(query, content(bank.images[d], []), instr.per_criterion[0]) for d in docs],
            [criterion.holds(bank.faces[d]) != instr.judged[0].negated for d in docs])


def _absent(bank: ImageBank, recipe: RerankerRecipe, rng: random.Random) -> tuple[list[Pair], list[bool]]:
    """A statement no face meets (:mod:`app.demo.absent`), judged on random faces: all "no" (a rubric about
    something the set lacks must find no match)."""
    statement = absent_statement(rng, recipe.absent_mixed)
    instr = rubric_instructions(Rubric.parse(None, [statement]), False)
    docs = rng.sample(range(len(bank.faces)), recipe.criterion_documents)
    query = Content(texts=[instr.judged[0].statement])
    return [Pair(query, content(bank.images[d], []), instr.per_criterion[0]) for d in docs], [False] * len(docs)


def judgements(bank: ImageBank, recipe: RerankerRecipe, rng: random.Random) -> tuple[list[Pair], list[bool]]:
    """One step's pairs and labels as :meth:`rerank.rubric.RubricReranker.score` asks them at search time: per
    query, one judgement per criterion's positive statement (labelled by whether the statement holds), or, for a
    candidate alone, the overall judgement."""
    pairs: list[Pair] = []
    labels: list[bool] = []
    for _ in range(recipe.queries):
        kind: QueryKind = rng.choices(KINDS, weights=recipe.mix)[0]
        q = sample_query(rng, kind, bank.faces)
        ci = bank.faces.index(q.candidate) if q.candidate is not None else None
        instr = rubric_instructions(Rubric.parse(None, q.texts), ci is not None)
        image = [bank.images[ci]] if ci is not None else []
        docs = _documents(bank, q, ci, recipe.documents, rng)
        if instr.overall is not None:  # a candidate alone: the candidate itself is among its documents
            docs = ([ci] if ci is not None else []) + docs[:-1]
            pairs += [Pair(Content(images=image), content(bank.images[d], []), instr.overall) for d in docs]
            labels += [q.relevant(bank.faces[d]) for d in docs]
        for criterion, j, instruction in zip(q.criteria, instr.judged, instr.per_criterion, strict=True):
            crit_query = Content(texts=[j.statement], images=image)
            pairs += [Pair(crit_query, content(bank.images[d], []), instruction) for d in docs]
            labels += [criterion.holds(bank.faces[d]) != j.negated for d in docs]
    for _ in range(recipe.criteria):
        more, more_labels = single_criterion(bank, recipe, rng)
        pairs += more
        labels += more_labels
    return pairs, labels


def yes_no_rows(trainee: Trainee) -> list[int]:
    """Token ids of ``yes`` and ``no``: the LM-head rows :func:`rerank.factory.load_reranker` keeps."""
    vocab = trainee.processor.tokenizer.get_vocab()
    return [int(vocab["yes"]), int(vocab["no"])]


def _planner(trainee: Trainee) -> LocalScoringRuntime:
    """The product's reranker over the trainee (its prompts, token ids and shared-prefix groups)."""
    head = trainee.full.get_output_embeddings().weight.detach()
    yes, no = yes_no_rows(trainee)
    loaded = replace(trainee.loaded, lm_rows={"yes": head[yes].clone(), "no": head[no].clone()})
    return LocalScoringRuntime(loaded, LocalConfig(), VisionConfig(), role="reranker", vision=trainee.encoder)


def train_reranker(trainee: Trainee, bank: ImageBank, packages: dict[int, VisualPackage], recipe: RerankerRecipe,
                   rng: random.Random) -> list[float]:
    """Train the language model and LM head in place (the tower stays frozen); returns the loss per step."""
    head = trainee.full.get_output_embeddings()
    rows = torch.tensor(yes_no_rows(trainee))
    by_sha = {bank.images[i].sha256: pkg for i, pkg in packages.items()}
    planner = _planner(trainee)
    params = [p for n, p in trainee.full.named_parameters() if p.requires_grad and ".visual." not in f".{n}"]

    def loss_of(step: tuple[list[Pair], list[bool]]) -> torch.Tensor:
        # every group and all plain rows in one pass each, and the loss over the rows in the order they ran: the
        # head's gradient sums over rows, another order is another trajectory (like another seed), and the demo's
        # quality floors were measured on the models this order trains
        pairs, labels = step
        hidden, order = run_states(planner, pairs, by_sha, max_batch=4096, max_bytes=1 << 40)
        logits = hidden @ head.weight[rows].T  # [N, 2]: the yes and no logits
        return F.cross_entropy(logits, torch.tensor([0 if labels[r] else 1 for r in order]))

    batches = (judgements(bank, recipe, rng) for _ in itertools.count())
    return train(trainee.full, recipe.steps, adamw_one_cycle(params, recipe.lr, recipe.steps, recipe.warmup),
                 batches, loss_of, "reranker")


def frozen_packages(trainee: Trainee, bank: ImageBank, chunk: int = 64) -> dict[int, VisualPackage]:
    """Every bank image's package from the frozen tower, computed once (no gradients)."""
    for p in trainee.full.model.visual.parameters():
        p.requires_grad_(False)
    out: dict[int, VisualPackage] = {}
    with torch.no_grad():
        for start in range(0, len(bank.faces), chunk):
            out.update(trainee.packages(bank, range(start, min(start + chunk, len(bank.faces)))))
    return out


def init_from_embedder(reranker: Trainee, embedder: Trainee) -> None:
    """The embedder's tower and LM; the LM head from its (tied) input embeddings."""
    reranker.full.model.load_state_dict(embedder.full.model.state_dict())
    with torch.no_grad():
        reranker.full.get_output_embeddings().weight.copy_(embedder.full.model.language_model.embed_tokens.weight)

