"""The model core: what every task class does once, whatever runtime runs the model.

:class:`TaskModel` holds a runtime, applies the input limits to official items, keeps the task counters
(merged with the runtime's into ``stats``) and answers health and admission for it. :class:`Truncation`
is the official classes' token-limit rule, applied by the runtime that sees token ids.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Self

from rubricsearch.retrieval.errors import InputTooLong, InvalidInput
from rubricsearch.retrieval.packages import ModelPackages

if TYPE_CHECKING:
    from rubricsearch.retrieval.runtime.config import InputLimits
    from rubricsearch.retrieval.runtime.seam import Runtime

# "<|im_end|>\n<|im_start|>assistant\n" survives a reranker prompt's truncation, as in the official code
KEEP_TAIL = 5


@dataclass(frozen=True)
class Truncation:
    """The token limit of one call, and whether text over it is cut (the official default) or refused."""

    limit: int
    allowed: bool = True

    def text(self, ids: list[int], has_images: bool) -> list[int]:
        """Embedding inputs: the official processor keeps the first ``limit`` tokens; images are never cut."""
        if len(ids) <= self.limit:
            return ids
        if not self.allowed:
            raise InputTooLong(f"input is {len(ids)} tokens; the limit is {self.limit} (ask for truncation to cut "
                               "it)", tokens=len(ids), limit=self.limit)
        if has_images:
            raise InvalidInput(f"input is {len(ids)} tokens with its images; the limit is {self.limit} (lower "
                               "max_pixels or shorten the text)")
        return ids[: self.limit]

    def pair(self, ids: list[int], image_token_id: int) -> list[int]:
        """Reranker prompts: the head up to the limit, then the fixed assistant tail, as the official class cuts."""
        if len(ids) <= self.limit:
            return ids
        if not self.allowed:
            raise InputTooLong(f"query + document are {len(ids)} tokens; the limit is {self.limit} (ask for "
                               "truncation to cut them)", tokens=len(ids), limit=self.limit)
        head = ids[: self.limit - KEEP_TAIL]
        if image_token_id in ids[len(head):-KEEP_TAIL]:
            raise InvalidInput(f"query + document are {len(ids)} tokens with their images; the limit is {self.limit}")
        return head + ids[-KEEP_TAIL:]


class TaskModel:
    """The shared half of the task classes: a runtime, the input limits, and the task's counters."""

    def __init__(self, runtime: Runtime, inputs: InputLimits, max_length: int, counters: tuple[str, ...]) -> None:
        self.runtime = runtime
        self.model_id = runtime.model_id
        self.revision = runtime.revision
        self.max_length = max_length
        self.image_max_bytes = inputs.image_max_bytes
        self.image_max_pixels = inputs.image_max_pixels
        self._lock = threading.Lock()  # the counters only
        self.counters = dict.fromkeys(counters, 0)

    def count(self, key: str, n: int) -> None:
        with self._lock:
            self.counters[key] += n

    @property
    def packages(self) -> ModelPackages:
        return self.runtime.packages

    @property
    def stats(self) -> dict[str, int]:
        _, runtime = self.runtime.load()
        with self._lock:
            return {**runtime, **self.counters}

    def pending(self) -> int:
        """Work waiting for the model's device (admission control refuses new work above a limit)."""
        return self.runtime.load()[0]

    def health(self) -> bool:
        return self.runtime.health()

    def close(self) -> None:
        self.runtime.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
