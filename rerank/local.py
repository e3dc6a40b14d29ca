"""The local torch runtime of Qwen3-VL-Reranker: :class:`~retrieval.runtime.local.LocalRuntime` plus ``score``.

The official class scores one pair per forward and re-encodes every image each time; here pairs are
batched and every image comes from the package store, so a reference image's vision tower runs once.
Scores are sigmoid(h_last · (w_yes − w_no)), computed in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial

import torch

from rubricsearch.rerank.prefix import PaddedRows, RowPasses, batch_bytes, group_tokens, run_shared_prefixes
from rubricsearch.rerank.prompts import rerank_conversation
from rubricsearch.rerank.protocol import Pair, by_query
from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.packages import Usage, VisualPackage, VisualPackages
from rubricsearch.retrieval.qwen.engine.forward import LMInput, download, upload
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.qwen.model.prompts import Content, Prompt
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.core import Truncation
from rubricsearch.retrieval.runtime.local import LocalRuntime

ShortlistPass = Callable[[list[tuple[LMInput, list[LMInput]]]], list[torch.Tensor]]


class LocalScoringRuntime(LocalRuntime):
    """A :class:`~rerank.protocol.ScoringRuntime` over a checkpoint loaded with its ``yes`` and ``no`` LM rows."""

    def __init__(
        self,
        loaded: LoadedQwen,
        config: LocalConfig,
        vision_config: VisionConfig,
        *,
        role: str,
        packages: VisualPackages | None = None,
        vision: VisionEncoder | None = None,
    ) -> None:
        if "yes" not in loaded.lm_rows or "no" not in loaded.lm_rows:
            raise InvalidInput("the reranker needs the LM head rows of 'yes' and 'no'")
        super().__init__(loaded, config, vision_config, role=role, packages=packages, vision=vision)
        self.weight = (loaded.lm_rows["yes"] - loaded.lm_rows["no"]).to(torch.float32)
        self.share_prefix = config.share_prefix
        # Transient memory one shared-prefix batch may take (rows per batch follow from it).
        self.prefix_batch_bytes = config.prefix_batch_bytes or batch_bytes(loaded.device)
        # One function object, so the scheduler merges shared-prefix groups of concurrent requests.
        self._run_groups = self.shortlist_pass(config)
        self.counters["shared_prefix_pairs"] = 0

    def shortlist_pass(self, config: LocalConfig) -> ShortlistPass:
        """How shared-prefix groups run: the padded pass here; the accelerated plug-in packs them."""
        return partial(run_shared_prefixes, self.loaded, pad_id=self.pad_id, max_batch=self.batch_size,
                       max_bytes=self.prefix_batch_bytes)

    def row_passes(self) -> RowPasses:
        """The shortlist's passes with gradients (trainers, evidence maps): padded here; the accelerated plug-in
        packs them where it packs the shortlists."""
        return PaddedRows(self.loaded, self.pad_id)

    def score(self, pairs: Sequence[Pair], *, usage: Usage | None, truncation: Truncation) -> list[float]:
        images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
        packages = {pkg.image_sha256: pkg for pkg in self._packages.get_or_encode(images, usage=usage)}
        inputs, regular, groups, group_rows = self.plan(pairs, packages, truncation)
        hidden = torch.empty((len(pairs), self.loaded.hidden_size), dtype=torch.float32, device=self.loaded.device)
        costs = [group_tokens(group) for group in groups]
        for ok, states in zip(group_rows, self.scheduler.merged(groups, self._run_groups, costs), strict=True):
            hidden[upload(torch.tensor(ok), hidden.device)] = states
        if regular:
            hidden[upload(torch.tensor(regular), hidden.device)] = self.scheduler.run([inputs[r] for r in regular])
        scores = download(torch.sigmoid(hidden @ self.weight)).tolist()
        with self._lock:
            self.counters["shared_prefix_pairs"] += sum(len(ok) for ok in group_rows)
        self.count_tokens(inputs, usage)
        return [float(s) for s in scores]

    def plan(self, pairs: Sequence[Pair], packages: dict[str, VisualPackage], truncation: Truncation
             ) -> tuple[list[LMInput], list[int], list[tuple[LMInput, list[LMInput]]], list[list[int]]]:
        """Every pair's token ids, and how :meth:`score` runs them: the rows that take the plain
        forward, and the shared-prefix groups (prefix, continuations) with their rows. The demo reranker
        (``app/demo``) trains on exactly these inputs."""
        inputs = [self._input(pair, packages, truncation) for pair in pairs]
        regular: list[int] = []
        groups: list[tuple[LMInput, list[LMInput]]] = []
        group_rows: list[list[int]] = []
        for rows in by_query(pairs).values():
            shared = self._shared_prefix(pairs[rows[0]], rows, inputs, packages) if len(rows) >= 2 else None
            if shared is None:
                regular += rows
                continue
            prefix, ok = shared
            regular += [r for r in rows if r not in ok]
            n_ids, n_pkgs = len(prefix.ids), len(prefix.packages)
            groups.append((prefix, [LMInput(ids=inputs[r].ids[n_ids:], packages=inputs[r].packages[n_pkgs:])
                                    for r in ok]))
            group_rows.append(ok)
        return inputs, regular, groups, group_rows

    def _shared_prefix(
        self, first: Pair, rows: list[int], inputs: list[LMInput], packages: dict[str, VisualPackage]
    ) -> tuple[LMInput, list[int]] | None:
        """The common prefix and the rows whose token ids really start with it (token-stable boundary).

        A document that starts with an image begins at a special token, so the boundary is stable; a text
        document may merge with ``<Document>:`` under BPE and then takes the plain path.
        """
        if not self.share_prefix:
            return None
        sentinel = "\x00rubricsearch-document\x00"
        text = self.loaded.processor.apply_chat_template(
            rerank_conversation(first.query, Content(texts=[sentinel]), first.instruction),
            tokenize=False, add_generation_prompt=True,
        )
        prefix_text = text.split(sentinel)[0]
        q_pkgs = [packages[img.sha256] for img in first.query.images]
        ids = self.tokenizer.ids(Prompt(text=prefix_text, images=first.query.images), q_pkgs)
        ok = [r for r in rows if len(inputs[r].ids) > len(ids) and inputs[r].ids[: len(ids)] == ids]
        if len(ok) < 2:
            return None
        return LMInput(ids=ids, packages=q_pkgs), ok

    def _input(self, pair: Pair, packages: dict[str, VisualPackage], truncation: Truncation) -> LMInput:
        pair_images = [*pair.query.images, *pair.document.images]
        prompt = self.tokenizer.render(rerank_conversation(pair.query, pair.document, pair.instruction), pair_images)
        pkgs = [packages[img.sha256] for img in pair_images]
        return LMInput(ids=truncation.pair(self.tokenizer.ids(prompt, pkgs), self.loaded.image_token_id), packages=pkgs)
