"""vLLM's ``/rerank`` for Qwen3-VL-Reranker, on the shared vLLM client.

With vLLM's classifier conversion and rerank/templates/qwen3_vl_reranker.jinja the server renders the
official reranker prompt (docs/vllm-notes.md); each side's images come first, then its text (joined
here, so several texts concatenate without a separator as in the official code).
"""

from __future__ import annotations

from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.remote.vllm_client import Part, VLLMClient, text_part

RerankInput = str | dict[str, Any]


def rerank_input(images: Sequence[Part] = (), texts: Sequence[str] = ()) -> RerankInput:
    """One query or document for ``/rerank``: its image parts, then its texts concatenated.

    A plain string when there is no image (vLLM then needs no multimodal parsing); "NULL" when empty.
    """
    text = "".join(texts)
    if not images:
        return text or "NULL"
    parts = list(images)
    if text:
        parts.append(text_part(text))
    return {"content": parts}


class VLLMRerankClient(VLLMClient):
    """:class:`VLLMClient` plus ``/rerank``."""

    def rerank(
        self, query: RerankInput, documents: Sequence[RerankInput], instruction: str | None = None
    ) -> list[float]:
        """Relevance in [0, 1] (= sigmoid(logit_yes - logit_no)) of each document, in input order.

        ``instruction=None`` lets the template use the official default instruction. Documents go
        ``max_batch`` at a time, up to ``max_concurrency`` requests at once.
        """
        if not documents:
            return []
        chunks = [list(documents[i : i + self.max_batch]) for i in range(0, len(documents), self.max_batch)]

        def run(docs: list[RerankInput]) -> list[float]:
            body: dict[str, Any] = {"model": self.model, "query": query, "documents": docs}
            if instruction:
                body["instruction"] = instruction
            results = self.request("POST", "/rerank", body)["results"]
            if len(results) != len(docs):
                raise BackendUnavailable(f"vLLM returned {len(results)} scores for {len(docs)} documents")
            # a score vLLM could not encode as a number (null) is NaN: a package key the server refused
            return [float("nan") if r["relevance_score"] is None else float(r["relevance_score"])
                    for r in sorted(results, key=lambda r: int(r["index"]))]

        if len(chunks) == 1:
            return run(chunks[0])
        with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(chunks))) as pool:
            return [s for part in pool.map(run, chunks) for s in part]
