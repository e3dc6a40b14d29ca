"""Fine-tuning the embedder from a set's judgments and the references' cached packages.

Contrastive (InfoNCE at the public recipe's temperature) over :mod:`retrieval.tuning.contrastive`'s data: a
criterion as search embeds it against the references judged "yes" for it, with its hard negatives and the
batch's other documents as negatives. Training runs the product's embedding forward with gradients: the LM inputs
of :meth:`retrieval.runtime.local.LocalRuntime.prepare` (ingestion's for references, search's for the
criterion) through :func:`retrieval.qwen.engine.forward.pooled_states`, the function inference runs under
``inference_mode``, then the same L2 normalisation. Only LoRA adapters on the language model learn; the vision
tower is untouched, so every package stays valid, and its calls are counted all the same.

One code path for every device: device and dtype are the loaded model's (float32 on a CPU, bfloat16 on a GPU).
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from rubricsearch.retrieval.embedding.task import EMBED_MAX_LENGTH
from rubricsearch.retrieval.errors import Conflict
from rubricsearch.retrieval.packages import PackageStore, VisualPackages
from rubricsearch.retrieval.qwen.engine.forward import plan_batches, pooled_states
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.qwen.model.prompts import EMBED_DEFAULT_INSTRUCTION, Content, finish_instruction
from rubricsearch.retrieval.runtime.config import LocalConfig, ModelConfig, VisionConfig
from rubricsearch.retrieval.runtime.core import Truncation
from rubricsearch.retrieval.runtime.local import LocalRuntime, load_local
from rubricsearch.retrieval.runtime.registry import build_runtime
from rubricsearch.retrieval.tuning.contrastive import (
    AT,
    Criterion,
    Pair,
    Ranking,
    hard_negatives,
    query_instruction,
    ranking,
    split,
)
from rubricsearch.retrieval.tuning.judgments import JudgedCell, check_cells, reference
from rubricsearch.retrieval.tuning.loop import (
    Progress,
    TowerCalls,
    TrainingRecord,
    Validation,
    fit_adapters,
    with_adapters,
)
from rubricsearch.retrieval.tuning.settings import DEFAULTS, TuningSettings
from rubricsearch.retrieval.tuning.version import refuse_existing, save_merged

TEMPERATURE = 0.1  # InfoNCE temperature of the public Qwen3-VL-Embedding recipe (ms-swift)
# Weight of the pull back to the base embedder's vectors, of the step's documents and of ANCHORS queries: a
# fine-tune on one criterion otherwise moves every query it resembles with it, and the rankings of the set's
# other criteria collapse (docs/fine-tuning.md, the table this value was chosen from). Not the reranker's
# ``TuningSettings.preserve`` (a weight of the base's answers, on another loss): the card records it as ``pull``.
PULL = 100.0
# Queries the set's searches may ask, none of them a criterion of the demo truth (whose other criteria measure
# what the pull keeps); ANCHORED of them, drawn per step, are held at their base vectors.
ANCHORS = ("a photo of a car", "a red object", "a wooden table", "a person smiling", "text on a sign", "a dog",
           "a bird in flight", "a tall tree", "calm water", "a brick building", "a close-up", "a dark image",
           "a bright image", "a round shape", "a striped pattern", "green grass", "a metal surface", "a thin crack",
           "a human face", "a small animal", "white background", "two objects", "a blurred photo", "a yellow flower",
           "a square tile", "rust on steel", "a long shadow", "a pink label", "a plastic bottle", "snow")
ANCHORED = 8


def embedding_vectors(runtime: LocalRuntime, contents: Sequence[Content], instructions: Sequence[str | None]
                      ) -> torch.Tensor:
    """float32 ``[N, H]`` L2-normalised embeddings of the contents, in their order, with gradients where autograd
    is on: what :meth:`retrieval.embedding.task.TaskEmbedder.embed_contents` returns for them (``None``: the
    default instruction, as ingestion embeds references)."""
    finished = [finish_instruction(i, EMBED_DEFAULT_INSTRUCTION) for i in instructions]
    inputs = runtime.prepare(contents, finished, None, Truncation(EMBED_MAX_LENGTH))
    parts: list[torch.Tensor] = []
    order: list[int] = []
    for batch in plan_batches(inputs, runtime.batch_size, runtime.max_batch_tokens):
        parts.append(pooled_states(runtime.loaded, [inputs[i] for i in batch], runtime.pad_id).to(torch.float32))
        order += batch
    hidden = torch.cat(parts)
    at = torch.empty(len(order), dtype=torch.long)
    at[torch.tensor(order)] = torch.arange(len(order))
    return F.normalize(hidden[at.to(hidden.device)], p=2, dim=-1)


@dataclass(kw_only=True)
class TunedEmbedder(TrainingRecord):
    """A trained embedder, adapters not yet merged, and what the version card records."""

    loaded: LoadedQwen
    peft_model: Any
    base: Path
    settings: TuningSettings
    pull: float
    train_references: set[str]
    validation_references: set[str]
    train_pairs: int
    validation_queries: int
    before: Ranking
    after: Ranking


def fine_tune_embedder(base: Path, cells: Sequence[JudgedCell], store: PackageStore, *,
                       settings: TuningSettings | None = None, vision: VisionConfig | None = None,
                       local: LocalConfig | None = None, progress: Callable[[Progress], None] | None = None,
                       pull: float = PULL) -> TunedEmbedder:
    """Train LoRA adapters on the language model of the embedding checkpoint ``base`` from judged cells, reading
    each reference's package from ``store`` under the checkpoint's tower (and ``vision``'s preprocessing, which
    must be the serving one's to find them) and under ``local``, the serving model's local runtime configuration
    (device, dtype, engine). Raises :class:`InvalidInput` for bad settings or judgments that cannot train or be
    measured, :class:`Conflict` when no judged reference has a package for this tower.
    ``pull``: the weight of the pull back to the base's vectors (:data:`PULL`)."""
    settings = settings or DEFAULTS["embedder"]
    vision = vision or VisionConfig()
    settings.check()
    check_cells(cells)
    started = time.monotonic()
    local = local or LocalConfig()
    loaded = load_local(base, local)
    # the engine the model serves with: on a GPU the accelerated one, whose fused kernels have backward passes
    runtime: LocalRuntime = build_runtime("embedding", loaded, ModelConfig(vision=vision, local=local),
                                          packages=VisualPackages(store), vision=None)
    try:
        found = runtime.packages.find([reference(s) for s in {c.sha256 for c in cells}])
        usable = [c for c in cells if c.sha256 in found]
        if not usable:
            raise Conflict("no judged reference has a package for this embedder's vision tower: index the set (or "
                           "run the package backfill) with this model first",
                           fingerprint=runtime.vision.fingerprint.short, references=len({c.sha256 for c in cells}))
        data = split(usable, settings.seed)
        train_refs, held, train, validation, pairs = (data.train_references, data.validation_references, data.train,
                                                      data.validation, data.pairs)
        torch.manual_seed(settings.seed)
        peft_model = with_adapters(loaded.model, settings)
        counter = TowerCalls(loaded.model.visual)
        try:
            trainer = _Trainer(runtime, train, sorted(train_refs), validation, sorted(held), settings, pull)
            before = trainer.evaluate()
            # at an equal nDCG@10 (ranks move in steps) the lower held-out InfoNCE wins unless the anchor
            # queries moved by more: the other criteria's rankings go with them
            check = Validation(trainer.evaluate, lambda r: r.ndcg, f"ndcg@{AT}", higher=True,
                               tie=lambda r: r.loss + pull * r.drift)
            fitted = fit_adapters(loaded.model, settings, pairs, random.Random(settings.seed), trainer.loss,
                                  validation=check, before=before, progress=progress)
        finally:
            counter.close()
    finally:
        runtime.close()
    return TunedEmbedder(loaded=loaded, peft_model=peft_model, base=base, settings=settings, pull=pull,
                         train_references=train_refs, validation_references=held, train_pairs=len(pairs),
                         validation_queries=len(validation), before=before, after=fitted.best,
                         losses=fitted.losses, best_step=fitted.best_step,
                         vision_encodes=counter.calls, wall_s=time.monotonic() - started,
                         skipped_without_package=len(cells) - len(usable),
                         fingerprint=runtime.vision.fingerprint.digest(),
                         judgment_ids=sorted(c.judgment_id for c in usable),
                         max_judgment_id=max(c.judgment_id for c in cells))


class _Trainer:
    def __init__(self, runtime: LocalRuntime, train: list[Criterion], train_refs: list[str],
                 validation: list[Criterion], validation_refs: list[str], settings: TuningSettings,
                 pull: float) -> None:
        self.runtime, self.train, self.validation = runtime, train, validation
        self.validation_refs, self.chunk, self.pull = validation_refs, 4 * settings.batch, pull
        self.rng = random.Random(settings.seed + 1)  # the hard negative of each pair
        with torch.no_grad():  # the adapters start at zero: these are the base embedder's vectors
            base = self.references(train_refs)
            scores = self.queries(train) @ base.T
            self.anchors = self.queries_of(ANCHORS)
        self.base = dict(zip(train_refs, base, strict=True))
        self.negatives = hard_negatives(train, scores.cpu().numpy(), train_refs)

    def queries(self, side: Sequence[Criterion]) -> torch.Tensor:
        return self.queries_of([c.text for c in side])

    def queries_of(self, texts: Sequence[str]) -> torch.Tensor:
        return self._chunked([Content(texts=[t]) for t in texts], [query_instruction(t) for t in texts])

    def references(self, shas: Sequence[str]) -> torch.Tensor:
        return self._chunked([Content(images=[reference(s)]) for s in shas], [None] * len(shas))

    def _chunked(self, contents: list[Content], instructions: list[str | None]) -> torch.Tensor:
        return torch.cat([embedding_vectors(self.runtime, contents[i:i + self.chunk], instructions[i:i + self.chunk])
                          for i in range(0, len(contents), self.chunk)])

    def evaluate(self) -> Ranking:
        """The held-out ranking, and how far every anchor query moved from its base vector."""
        self.runtime.loaded.model.eval()
        with torch.no_grad():
            scores = self.queries(self.validation) @ self.references(self.validation_refs).T
            drift = float((self.queries_of(ANCHORS) - self.anchors).pow(2).sum(-1).mean())
        return replace(ranking(self.validation, scores.cpu().numpy(), self.validation_refs, TEMPERATURE),
                       drift=drift)

    def loss(self, batch: list[Pair]) -> torch.Tensor:
        """InfoNCE of each pair's query over the batch's documents (every positive and one hard negative per
        pair); documents judged "yes" for a query, other than its own positive, are masked out of its softmax.
        Plus ``pull`` times the mean squared distance from the base's vectors of the documents' and of
        :data:`ANCHORED` anchor queries'."""
        docs = list(dict.fromkeys([p.positive for p in batch] + [self.rng.choice(self.negatives[p.query])
                                                                 for p in batch if self.negatives[p.query]]))
        asked = list(dict.fromkeys(p.query for p in batch))  # each criterion embedded once per step
        queries = self.queries([self.train[i] for i in asked])[[asked.index(p.query) for p in batch]]
        vectors = self.references(docs)
        logits = queries @ vectors.T / TEMPERATURE
        target = torch.tensor([docs.index(p.positive) for p in batch], device=logits.device)
        mask = torch.tensor([[d in self.train[p.query].yes and d != p.positive for d in docs] for p in batch],
                            device=logits.device)
        drift = (vectors - torch.stack([self.base[d] for d in docs])).pow(2).sum(-1).mean()
        if self.pull:
            drawn = self.rng.sample(range(len(ANCHORS)), ANCHORED)
            drift = drift + (self.queries_of([ANCHORS[i] for i in drawn]) - self.anchors[drawn]).pow(2).sum(-1).mean()
        return F.cross_entropy(logits.masked_fill(mask, float("-inf")), target) + self.pull * drift


def card(tuned: TunedEmbedder, about: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """``about``: where the judgments came from (the set), recorded with the data snapshot."""
    return tuned.card(
        kind="embedder", base=tuned.base, loaded=tuned.loaded,
        method="LoRA on the language model's linear layers, merged; vision tower unchanged",
        data={**(about or {}), "train_references": len(tuned.train_references),
              "validation_references": len(tuned.validation_references), "train_pairs": tuned.train_pairs,
              "validation_queries": tuned.validation_queries},
        settings={**tuned.settings.to_json("embedder"), "temperature": TEMPERATURE, "pull": tuned.pull,
                  "anchors": len(ANCHORS),
                  "loss": "InfoNCE + pull x the squared distance of the documents' and anchors' vectors from the "
                          "base's"},
        held_out="each criterion ranks the validation references judged for it (split by reference)",
        before=tuned.before.to_json(), after=tuned.after.to_json())


def save_embedder_version(tuned: TunedEmbedder, out: Path, about: Mapping[str, Any] | None = None
                          ) -> dict[str, Any]:
    """Merge, save the checkpoint and its card into the new folder ``out`` (atomically); returns the card."""
    refuse_existing(out)
    written = card(tuned, about)
    save_merged(tuned.peft_model, tuned.base, tuned.loaded.tower_hash, out, written)
    return written
