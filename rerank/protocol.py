"""What the product needs of a reranker (:class:`Reranker`), and what a reranker needs of its runtime
(:class:`ScoringRuntime`: the runtime seam plus ``score``)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable

from rubricsearch.retrieval.errors import InvalidInput
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.inputs import RERANK_KEYS, parse_content
from rubricsearch.retrieval.packages import ModelPackages, Usage
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.runtime.core import Truncation
from rubricsearch.retrieval.runtime.seam import Runtime


@dataclass
class Pair:
    """One judgement: does ``document`` meet ``query`` under ``instruction``?"""

    query: Content
    document: Content
    instruction: str | None = None


def official_pairs(
    query: Any,
    documents: Sequence[Any],
    instruction: str | None = None,
    *,
    max_bytes: int = DEFAULT_MAX_BYTES,
    max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
) -> list[Pair]:
    """``Qwen3VLReranker.process`` inputs (query may be the official ``(instruction, text)`` tuple) -> pairs."""
    if isinstance(query, tuple) and len(query) == 2:
        instruction, query = query
    if instruction is not None and not isinstance(instruction, str):
        raise InvalidInput("'instruction' must be a string")
    q = parse_content(query, allowed=RERANK_KEYS, max_bytes=max_bytes, max_pixels=max_pixels)
    docs = [parse_content(d, allowed=RERANK_KEYS, max_bytes=max_bytes, max_pixels=max_pixels) for d in documents]
    return [Pair(q, d, instruction) for d in docs]


QueryKey = tuple[tuple[str, ...], tuple[str, ...], str | None]


def by_query(pairs: Sequence[Pair]) -> dict[QueryKey, list[int]]:
    """Rows of the pairs that share query and instruction: they share the whole prompt up to the document."""
    groups: dict[QueryKey, list[int]] = {}
    for i, p in enumerate(pairs):
        groups.setdefault((tuple(p.query.texts), tuple(img.sha256 for img in p.query.images), p.instruction),
                          []).append(i)
    return groups


@runtime_checkable
class Reranker(Protocol):
    """Qwen3-VL-Reranker relevance: sigmoid(logit_yes - logit_no) of the official prompt, in [0, 1]."""

    model_id: str
    revision: str

    @property
    def packages(self) -> ModelPackages:
        """This model's view of the package stage: its tower's fingerprint, and whether it runs here."""
        ...

    def score(self, query: Any, documents: Sequence[Any], instruction: str | None = None, *,
              truncate: bool = True, usage: Usage | None = None) -> list[float]:
        """Official-shaped inputs (``{"text"?, "image"?}`` dicts or strings); one score per document."""
        ...

    def score_pairs(self, pairs: Sequence[Pair], *, usage: Usage | None = None,
                    truncate: bool = True) -> list[float]:
        """Parsed pairs, scored in batches (criteria breakdowns use this with many instructions);
        ``usage`` collects the vision encodes. Over the token limit a pair is cut as the official class
        cuts it, or, with ``truncate=False``, refused (:class:`~retrieval.errors.InputTooLong`)."""
        ...

    @property
    def stats(self) -> dict[str, int]:
        """At least ``vision_encodes``, ``package_hits``, ``package_misses`` and ``scored_pairs``."""
        ...

    def health(self) -> bool: ...

    def pending(self) -> int:
        """Inputs queued for the model's device (admission control refuses new work above a limit)."""
        ...

    def close(self) -> None: ...


@runtime_checkable
class ScoringRuntime(Runtime, Protocol):
    """A :class:`~retrieval.runtime.seam.Runtime` of a reranker checkpoint: it also scores prepared pairs."""

    def score(self, pairs: Sequence[Pair], *, usage: Usage | None, truncation: Truncation) -> list[float]:
        """Parsed pairs -> sigmoid(logit_yes - logit_no) of the official prompt, one per pair, in order."""
        ...
