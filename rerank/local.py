"""Local (transformers) Qwen3-VL-Reranker, faithful to the official ``Qwen3VLReranker``.

The official class scores one pair per forward and re-encodes every image each time; here pairs are
batched and every image comes from the package store, so a reference image's vision tower runs once.
Scores are sigmoid(h_last · (w_yes − w_no)), computed in float32.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from functools import partial
from typing import Any

import torch

from rubricsearch.rerank.packed_prefix import PackedPrefixes
from rubricsearch.rerank.prefix import batch_bytes, group_tokens, run_shared_prefixes
from rubricsearch.rerank.prompts import KEEP_TAIL, rerank_conversation
from rubricsearch.rerank.protocol import Pair, official_pairs
from rubricsearch.retrieval.errors import InputTooLong, InvalidInput
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES, DEFAULT_MAX_DECODED_PIXELS
from rubricsearch.retrieval.packages import ModelPackages, PackageStore, Usage, VisualPackage, VisualPackages
from rubricsearch.retrieval.qwen.engine.batching import LMScheduler
from rubricsearch.retrieval.qwen.engine.forward import LMInput, download, upload
from rubricsearch.retrieval.qwen.engine.graphed_lm import GraphedLM
from rubricsearch.retrieval.qwen.engine.packed import flash_varlen_works
from rubricsearch.retrieval.qwen.engine.vision import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    PreprocessMode,
    VisionEncoder,
)
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.qwen.model.prompts import Content, Prompt, Tokenizer


class LocalReranker:
    """``score(query, documents, instruction)`` over a loaded checkpoint; see :func:`rerank.load_reranker`."""

    def __init__(
        self,
        loaded: LoadedQwen,
        *,
        packages: VisualPackages | None = None,
        store: PackageStore | None = None,
        vision: VisionEncoder | None = None,
        preprocess: PreprocessMode = "official",
        role: str = "reranker",
        min_pixels: int = DEFAULT_MIN_PIXELS,
        max_pixels: int = DEFAULT_MAX_PIXELS,
        max_length: int = 10240,
        batch_size: int | None = None,
        lm_workers: int | None = None,
        max_batch_tokens: int | None = None,
        image_max_bytes: int = DEFAULT_MAX_BYTES,
        image_max_pixels: int = DEFAULT_MAX_DECODED_PIXELS,
        share_prefix: bool = True,
        prefix_batch_bytes: int | None = None,
        cuda_graphs: bool = False,
        packed: bool = True,
    ) -> None:
        if "yes" not in loaded.lm_rows or "no" not in loaded.lm_rows:
            raise InvalidInput("the reranker needs the LM head rows of 'yes' and 'no'")
        self.loaded = loaded
        self.vision = vision or VisionEncoder(loaded, min_pixels=min_pixels, max_pixels=max_pixels,
                                              preprocess=preprocess, cuda_graphs=cuda_graphs)
        service = packages or VisualPackages(
            store or PackageStore(storage_dtype="float32" if loaded.dtype == torch.float32 else "bfloat16"))
        self._packages = service.register(role, self.vision.fingerprint, self.vision)
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
        # Every forward pass of this model goes through one scheduler, merged with other requests' passes.
        # On a GPU small passes replay CUDA graphs, and shortlists run packed (rerank/packed_prefix.py).
        cuda = loaded.device.type == "cuda"
        self.cuda_graphs = cuda_graphs and cuda
        self.scheduler = LMScheduler(loaded, self.pad_id, max_batch=self.batch_size, max_tokens=self.max_batch_tokens,
                                     graphs=GraphedLM(loaded, self.pad_id) if self.cuda_graphs else None,
                                     workers=lm_workers)
        self._lock = threading.Lock()  # the counters only
        self.share_prefix = share_prefix
        # Transient memory one shared-prefix batch may take (rows per batch follow from it).
        self.prefix_batch_bytes = prefix_batch_bytes or batch_bytes(loaded.device)
        # One function object, so the scheduler merges shared-prefix groups of concurrent requests. Packed
        # passes need FlashAttention's variable-length kernel; the padded pass serves elsewhere (the CPU).
        self._packed = PackedPrefixes(loaded, self.pad_id, max_bytes=self.prefix_batch_bytes,
                                      cuda_graphs=self.cuda_graphs) if packed and flash_varlen_works(loaded) else None
        self._run_groups = self._packed.run if self._packed else partial(
            run_shared_prefixes, loaded, pad_id=self.pad_id, max_batch=self.batch_size,
            max_bytes=self.prefix_batch_bytes)
        self.counters = {"scored_pairs": 0, "lm_tokens": 0, "shared_prefix_pairs": 0}

    @property
    def packages(self) -> ModelPackages:
        return self._packages

    @property
    def stats(self) -> dict[str, int]:
        with self._lock:
            packed = self._packed.stats if self._packed is not None else {}
            return {**self._packages.stats(), **self.counters, **self.scheduler.stats, **packed}

    def pending(self) -> int:
        """Work waiting for the device (admission control reads it)."""
        return self.scheduler.depth()

    def health(self) -> bool:
        return True

    def close(self) -> None:
        """Nothing to release (the weights go with the object)."""

    def score(self, query: Any, documents: Sequence[Any], instruction: str | None = None, *,
              truncate: bool = True, usage: Usage | None = None) -> list[float]:
        return self.score_pairs(official_pairs(query, documents, instruction, max_bytes=self.image_max_bytes,
                                               max_pixels=self.image_max_pixels), truncate=truncate, usage=usage)

    def score_pairs(self, pairs: Sequence[Pair], *, usage: Usage | None = None,
                    truncate: bool = True) -> list[float]:
        if not pairs:
            return []
        images = [img for p in pairs for img in (*p.query.images, *p.document.images)]
        packages = {pkg.image_sha256: pkg for pkg in self._packages.get_or_encode(images, usage=usage)}
        inputs, regular, groups, group_rows = self.plan(pairs, packages, truncate)
        hidden = torch.empty((len(pairs), self.loaded.hidden_size), dtype=torch.float32, device=self.loaded.device)
        costs = [group_tokens(group) for group in groups]
        for ok, states in zip(group_rows, self.scheduler.merged(groups, self._run_groups, costs), strict=True):
            hidden[upload(torch.tensor(ok), hidden.device)] = states
        shared_rows = sum(len(ok) for ok in group_rows)
        if regular:
            hidden[upload(torch.tensor(regular), hidden.device)] = self.scheduler.run([inputs[r] for r in regular])
        scores = download(torch.sigmoid(hidden @ self.weight)).tolist()
        with self._lock:
            self.counters["shared_prefix_pairs"] += shared_rows
            self.counters["scored_pairs"] += len(pairs)
            self.counters["lm_tokens"] += sum(len(x.ids) for x in inputs)
        if usage is not None:
            usage.add_tokens(sum(len(x.ids) for x in inputs))
        return [float(s) for s in scores]

    def plan(self, pairs: Sequence[Pair], packages: dict[str, VisualPackage], truncate: bool = True
             ) -> tuple[list[LMInput], list[int], list[tuple[LMInput, list[LMInput]]], list[list[int]]]:
        """Every pair's token ids, and how :meth:`score_pairs` runs them: the rows that take the plain
        forward, and the shared-prefix groups (prefix, continuations) with their rows. The demo reranker
        (``app/demo``) trains on exactly these inputs."""
        inputs = [self._input(pair, packages, truncate) for pair in pairs]
        regular: list[int] = []
        groups: list[tuple[LMInput, list[LMInput]]] = []
        group_rows: list[list[int]] = []
        for rows in self._groups(pairs).values():
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

    @staticmethod
    def _groups(pairs: Sequence[Pair]) -> dict[tuple[object, ...], list[int]]:
        """Pairs that share query and instruction share the whole prompt up to the document."""
        groups: dict[tuple[object, ...], list[int]] = {}
        for i, p in enumerate(pairs):
            key = (tuple(p.query.texts), tuple(img.sha256 for img in p.query.images), p.instruction)
            groups.setdefault(key, []).append(i)
        return groups

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

    def _input(self, pair: Pair, packages: dict[str, VisualPackage], truncate: bool = True) -> LMInput:
        pair_images = [*pair.query.images, *pair.document.images]
        prompt = self.tokenizer.render(rerank_conversation(pair.query, pair.document, pair.instruction), pair_images)
        pkgs = [packages[img.sha256] for img in pair_images]
        ids = self.tokenizer.ids(prompt, pkgs)
        if len(ids) > self.max_length:
            if not truncate:
                raise InputTooLong(f"query + document are {len(ids)} tokens; the limit is {self.max_length} (ask "
                                   "for truncation to cut them)", tokens=len(ids), limit=self.max_length)
            head = ids[: self.max_length - KEEP_TAIL]
            if self.loaded.image_token_id in ids[len(head):-KEEP_TAIL]:
                raise InvalidInput(
                    f"query + document are {len(ids)} tokens with their images; the limit is {self.max_length}"
                )
            ids = head + ids[-KEEP_TAIL:]
        return LMInput(ids=ids, packages=pkgs)

