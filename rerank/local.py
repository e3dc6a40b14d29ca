"""Local (transformers) Qwen3-VL-Reranker, faithful to the official ``Qwen3VLReranker``.

The official class scores one pair per forward and re-encodes every image each time; here pairs are
batched and every image comes from the package store, so a reference image's vision tower runs once.
Scores are sigmoid(h_last · (w_yes − w_no)), computed in float32.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import torch

from rerank.protocol import Pair
from retrieval.errors import InvalidInput
from retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from retrieval.inputs import RERANK_KEYS, parse_content
from retrieval.packages import PackageStore
from retrieval.qwen.forward import LMInput, run_batched
from retrieval.qwen.loading import LoadedQwen
from retrieval.qwen.prompts import Tokenizer, render, rerank_conversation
from retrieval.qwen.vision import DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, VisionEncoder

KEEP_TAIL = 5  # "<|im_end|>\n<|im_start|>assistant\n" survives truncation, as in the official code


class LocalReranker:
    """``score(query, documents, instruction)`` over a loaded checkpoint; see :func:`rerank.load_reranker`."""

    def __init__(
        self,
        loaded: LoadedQwen,
        *,
        store: PackageStore | None = None,
        vision: VisionEncoder | None = None,
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_length: int = 10240,
        batch_size: int | None = None,
        max_batch_tokens: int | None = None,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
    ) -> None:
        if "yes" not in loaded.lm_rows or "no" not in loaded.lm_rows:
            raise InvalidInput("the reranker needs the LM head rows of 'yes' and 'no'")
        self.loaded = loaded
        self.vision = vision or VisionEncoder(
            loaded, store or PackageStore(storage_dtype="float32" if loaded.dtype == torch.float32 else "bfloat16"),
            min_pixels=min_pixels, max_pixels=max_pixels,
        )
        self.model_id = loaded.model_id
        self.revision = loaded.revision
        self.weight = (loaded.lm_rows["yes"] - loaded.lm_rows["no"]).to(torch.float32)
        self.max_length = max_length
        self.batch_size = batch_size or (64 if loaded.device.type == "cuda" else 16)
        self.max_batch_tokens = max_batch_tokens or (65536 if loaded.device.type == "cuda" else 16384)
        self.image_max_bytes = image_max_bytes
        self.image_max_pixels = image_max_pixels
        self.tokenizer = Tokenizer(loaded.processor, loaded.image_token_id)
        self.pad_id = int(loaded.processor.tokenizer.pad_token_id or 0)
        self._lock = threading.Lock()
        self.counters = {"scored_pairs": 0, "lm_tokens": 0}

    @property
    def stats(self) -> dict[str, int]:
        return {**self.vision.stats(), **self.counters}

    def health(self) -> bool:
        return True

    def score(self, query: Any, documents: Sequence[Any], instruction: str | None = None) -> list[float]:
        if isinstance(query, tuple) and len(query) == 2:  # official (instruction, text) form
            instruction, query = query
        if instruction is not None and not isinstance(instruction, str):
            raise InvalidInput("'instruction' must be a string")
        limits = {"max_bytes": self.image_max_bytes, "max_pixels": self.image_max_pixels}
        q = parse_content(query, allowed=RERANK_KEYS, **limits)
        docs = [parse_content(d, allowed=RERANK_KEYS, **limits) for d in documents]
        return self.score_pairs([Pair(q, d, instruction) for d in docs])

    def score_pairs(self, pairs: Sequence[Pair]) -> list[float]:
        if not pairs:
            return []
        with self._lock:
            inputs = self._prepare(pairs)
            hidden = run_batched(self.loaded, inputs, self.pad_id,
                                 max_batch=self.batch_size, max_tokens=self.max_batch_tokens)
            scores = torch.sigmoid(hidden @ self.weight).tolist()
            self.counters["scored_pairs"] += len(pairs)
            self.counters["lm_tokens"] += sum(len(x.ids) for x in inputs)
        return [float(s) for s in scores]

    def _prepare(self, pairs: Sequence[Pair]) -> list[LMInput]:
        images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
        packages = iter(self.vision.packages(images))
        inputs = []
        for pair in pairs:
            pair_images = [*pair.query.images, *pair.document.images]
            prompt = render(self.loaded.processor, rerank_conversation(pair.query, pair.document, pair.instruction),
                            pair_images)
            pkgs = [next(packages) for _ in pair_images]
            ids = self.tokenizer.ids(prompt, pkgs)
            if len(ids) > self.max_length:
                head = ids[: self.max_length - KEEP_TAIL]
                if self.loaded.image_token_id in ids[len(head):-KEEP_TAIL]:
                    raise InvalidInput(
                        f"query + document are {len(ids)} tokens with their images; the limit is {self.max_length}"
                    )
                ids = head + ids[-KEEP_TAIL:]
            inputs.append(LMInput(ids=ids, packages=pkgs))
        return inputs
