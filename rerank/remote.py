"""The vLLM runtime of Qwen3-VL-Reranker (yes/no classifier conversion): :class:`~retrieval.remote.runtime.VLLMRuntime`
plus ``score``.

The server runs ``--runner pooling`` with the ``Qwen3VLForSequenceClassification`` overrides and
rerank/templates/qwen3_vl_reranker.jinja (docs/vllm-notes.md); ``/rerank`` then returns
sigmoid(logit_yes - logit_no) of the official prompt, as the local backend computes it.

Images follow the embedder's rule (:class:`retrieval.remote.images.RemoteImages`): packages of this
checkpoint's tower go as validated ``image_embeds``, other images raw. vLLM refuses a pair whose query
and document mix the two forms, so a pair is all-packages or all-raw (a pair without images joins the
packages call); pairs are grouped by (query, instruction, form) into one ``/rerank`` call each, and the
calls run concurrently.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rubricsearch.rerank.protocol import Pair, by_query
from rubricsearch.rerank.vllm_client import RerankInput, VLLMRerankClient, rerank_input
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.packages import Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.remote.images import part_bytes, refused_key
from rubricsearch.retrieval.remote.runtime import VLLMRuntime
from rubricsearch.retrieval.remote.vllm_client import Part, budget_chunks
from rubricsearch.retrieval.runtime.config import VLLMConfig
from rubricsearch.retrieval.runtime.core import Truncation

GroupKey = tuple[tuple[str, ...], tuple[str, ...], str | None, bool]


class VLLMScoringRuntime(VLLMRuntime):
    """A :class:`~rerank.protocol.ScoringRuntime` through a vLLM ``/rerank`` server."""

    client: VLLMRerankClient

    def _connect(self, model_path_or_id: str, config: VLLMConfig) -> VLLMRerankClient:
        return VLLMRerankClient.connect(config.base_url, config.served_model or str(model_path_or_id),
                                        api_key=config.api_key, connect_timeout=config.connect_timeout,
                                        read_timeout=config.read_timeout, max_retries=config.max_retries,
                                        max_concurrency=config.max_concurrency, max_batch=config.max_batch)

    def _probe(self, part: Part) -> Any:
        return self.client.rerank("probe", [rerank_input([part], [])], None)[0]

    def _width(self) -> int:
        """Scores need no width: the checkpoint's hidden size where it is here, else 0 (no probe request)."""
        return int((self.images.config.get("text_config") or {}).get("hidden_size") or 0)

    def score(self, pairs: Sequence[Pair], *, usage: Usage | None, truncation: Truncation) -> list[float]:
        """The server renders the prompt and applies its own token limit (``truncation`` is the local runtime's)."""
        embeds = self.images.embeds((img for p in pairs for img in (*p.query.images, *p.document.images)), usage)
        groups: dict[GroupKey, list[int]] = {}
        for key, rows in by_query(pairs).items():
            forms = {r: self._form(pairs[r], embeds) for r in rows}
            neutral = any(f is True for f in forms.values())  # image-free pairs join the packages call
            for r in rows:
                use = neutral if forms[r] is None else bool(forms[r])
                groups.setdefault((*key, use), []).append(r)
        raw_cache: dict[str, Part] = {}
        calls: list[tuple[RerankInput, list[RerankInput], str | None, list[int]]] = []
        for (_, _, instruction, use), rows in groups.items():
            query = self._side(pairs[rows[0]].query, embeds, use, raw_cache)
            docs = [self._side(pairs[r].document, embeds, use, raw_cache) for r in rows]
            budget = self.max_request_bytes - input_bytes(query)
            for chunk in budget_chunks([input_bytes(d) for d in docs], budget, self.client.max_batch):
                calls.append((query, docs[chunk.start:chunk.stop], instruction, rows[chunk.start:chunk.stop]))
        scores: list[float] = [0.0] * len(pairs)

        def ask(query: RerankInput, docs: list[RerankInput], instruction: str | None) -> list[float]:
            try:
                return self.client.rerank(query, docs, instruction)
            except InvalidInput as exc:  # /rerank cannot write NaN into JSON: it says so with a 400
                if not refused_key(exc):
                    raise
                return [math.nan] * len(docs)

        def run(call: tuple[RerankInput, list[RerankInput], str | None, list[int]]) -> None:
            query, docs, instruction, rows = call
            got = ask(query, docs, instruction)
            if not all(map(math.isfinite, got)):  # the server refused a key (its file changed after the check)
                self.images.server_refused((img for r in rows for img in (*pairs[r].query.images,
                                                                           *pairs[r].document.images)), embeds, usage)
                query = self._side(pairs[rows[0]].query, embeds, False, raw_cache)
                got = ask(query, [self._side(pairs[r].document, embeds, False, raw_cache) for r in rows], instruction)
                if not all(map(math.isfinite, got)):
                    raise BackendUnavailable("the vLLM reranker returned non-finite scores for raw images: a NaN it "
                                             "served for a refused package key stays in its state; restart it")
            for r, s in zip(rows, got, strict=True):
                scores[r] = s

        if len(calls) == 1:
            run(calls[0])
        else:
            with ThreadPoolExecutor(max_workers=min(self.client.max_concurrency, len(calls))) as pool:
                list(pool.map(run, calls))
        self.count_requests(len(calls))
        return scores

    def _form(self, pair: Pair, embeds: dict[str, Part]) -> bool | None:
        """True: all the pair's images go as packages; False: all raw; None: the pair has no image."""
        images = [*pair.query.images, *pair.document.images]
        return self.images.all_embedded(images, embeds) if images else None

    def _side(self, content: Content, embeds: dict[str, Part], use: bool, cache: dict[str, Part]) -> RerankInput:
        return rerank_input(self.images.parts(content.images, embeds, use, cache), content.texts)


def input_bytes(side: RerankInput) -> int:
    """Approximate request bytes of one query or document."""
    if isinstance(side, str):
        return len(side) + 32
    return sum(part_bytes(p) for p in side["content"])
