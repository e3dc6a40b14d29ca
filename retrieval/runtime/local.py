"""The plain local torch runtime: a loaded Qwen3-VL checkpoint, its vision tower on the package stage, and one
scheduler for every LM pass, faithful to the official classes' forward. It runs wherever torch does (the CPU
included) and is the reference the accelerated plug-in (:mod:`retrieval.plugins.accelerated`) layers on.

Differences from the official classes are deliberate and output-neutral: images go through the package
stage (vision tower at most once per image, tower and settings), inputs are batched by length (merged
with other requests' passes), and the same image used by several items in one call is encoded once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from rubricsearch.retrieval.packages import ModelPackages, PackageStore, StorageDtype, Usage, VisualPackages
from rubricsearch.retrieval.qwen.engine.batching import GraphPasses, LMPass, LMScheduler
from rubricsearch.retrieval.qwen.engine.forward import LMInput, download, last_hidden_states
from rubricsearch.retrieval.qwen.engine.vision import PreprocessMode, VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen, load_qwen
from rubricsearch.retrieval.qwen.model.prompts import Content, Tokenizer, embed_conversation
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.core import Truncation


class LocalRuntime:
    """The :class:`~retrieval.runtime.seam.Runtime` over a :class:`LoadedQwen` in this process."""

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
        self.loaded = loaded
        cuda = loaded.device.type == "cuda"
        self.cuda_graphs = self.replays_graphs(config) and cuda
        self.vision = vision or self.vision_encoder(loaded, config, vision_config)
        service = packages or VisualPackages(PackageStore(storage_dtype=_storage_dtype(loaded.dtype)))
        self._own_store = service.store if packages is None else None  # a shared one is closed by its owner
        self._packages = service.register(role, self.vision.fingerprint, self.vision)
        self.model_id = loaded.model_id
        self.revision = loaded.revision
        self.dimension = loaded.hidden_size
        self.batch_size = config.batch_size or (64 if cuda else 16)
        self.max_batch_tokens = config.max_batch_tokens or (65536 if cuda else 16384)
        self.tokenizer = Tokenizer(loaded.processor, loaded.image_token_id)
        self.pad_id = int(loaded.processor.tokenizer.pad_token_id or 0)
        self.scheduler = LMScheduler(loaded, self.pad_id, max_batch=self.batch_size, max_tokens=self.max_batch_tokens,
                                     lm_pass=self.lm_pass(), graphs=self.lm_graphs(config),
                                     workers=config.lm_workers)
        self._lock = threading.Lock()  # the counters only
        self.counters = {"lm_tokens": 0}

    # Where the accelerated plug-in hooks in; the plain runtime runs every pass eagerly and padded.
    def replays_graphs(self, config: LocalConfig) -> bool:
        return False

    def vision_encoder(self, loaded: LoadedQwen, config: LocalConfig, vision_config: VisionConfig) -> VisionEncoder:
        return VisionEncoder(loaded, min_pixels=vision_config.min_pixels, max_pixels=vision_config.max_pixels,
                             preprocess=vision_config.preprocess)

    def lm_pass(self) -> LMPass:
        return last_hidden_states

    def lm_graphs(self, config: LocalConfig) -> GraphPasses | None:
        return None

    @property
    def packages(self) -> ModelPackages:
        return self._packages

    def load(self) -> tuple[int, dict[str, int]]:
        with self._lock:
            return self.scheduler.depth(), {**self._packages.stats(), **self.counters, **self.scheduler.stats}

    def health(self) -> bool:
        return True

    def close(self) -> None:
        """Stop and join this runtime's threads: the LM workers, the tower's preprocessing pool and the writers of
        a package store it made itself (the weights go with the object). A shared tower's pool restarts on use."""
        self.scheduler.close()
        self.vision.close()
        if self._own_store is not None:
            self._own_store.close()

    def count_tokens(self, inputs: Sequence[LMInput], usage: Usage | None) -> None:
        tokens = sum(len(x.ids) for x in inputs)
        with self._lock:
            self.counters["lm_tokens"] += tokens
        if usage is not None:
            usage.add_tokens(tokens)

    def embed(self, contents: Sequence[Content], instructions: Sequence[str], *, usage: Usage | None,
              truncation: Truncation) -> np.ndarray:
        inputs = self.prepare(contents, instructions, usage, truncation)
        hidden = self.scheduler.run(inputs)
        vectors = download(torch.nn.functional.normalize(hidden, p=2, dim=-1)).numpy().astype(np.float32)
        self.count_tokens(inputs, usage)
        return vectors

    def prepare(self, contents: Sequence[Content], instructions: Sequence[str], usage: Usage | None,
                truncation: Truncation) -> list[LMInput]:
        """The LM inputs of finished-instruction contents, their packages found or encoded; the embedder's
        fine-tune (:mod:`retrieval.tuning.embedder`) trains on exactly these."""
        all_images = [img for c in contents for img in c.images]
        packages = iter(self._packages.get_or_encode(all_images, usage=usage))
        inputs = []
        for content, instruction in zip(contents, instructions, strict=True):
            prompt = self.tokenizer.render(embed_conversation(content, instruction, instruction), content.images)
            pkgs = [next(packages) for _ in content.images]
            ids = truncation.text(self.tokenizer.ids(prompt, pkgs), has_images=bool(pkgs))
            inputs.append(LMInput(ids=ids, packages=pkgs))
        return inputs


def _storage_dtype(dtype: torch.dtype) -> StorageDtype:
    """Packages keep the model's float32 or bfloat16; other dtypes store float32 (lossless for them)."""
    return "bfloat16" if dtype == torch.bfloat16 else "float32"


def load_local(path_or_id: str | Path, config: LocalConfig, *, lm_rows: tuple[str, ...] = ()) -> LoadedQwen:
    """The checkpoint as the local configuration asks for it (device, dtype, attention); the accelerated
    runtime compiles it or switches its kernels where the configuration asks."""
    return load_qwen(path_or_id, device=config.device, dtype=config.dtype,
                     attn_implementation=config.attn_implementation, revision=config.revision, lm_rows=lm_rows)


def local_engine(config: LocalConfig, loaded: LoadedQwen, preprocess: PreprocessMode = "official",
                 ) -> Literal["local", "accelerated"]:
    """The registry name of the local runtime ``config`` asks for. ``auto`` is the accelerated one on a GPU, and
    wherever the configuration asks for what only it does (compiled blocks, fused kernels forced on: refused
    where they cannot run; ``gpu-nvjpeg`` preprocessing); the plain runtime ignores the compile, kernel and graph
    settings."""
    if config.engine == "auto":
        wanted = (loaded.device.type == "cuda" or config.compile or config.fused_kernels is True
                  or preprocess != "official")
        return "accelerated" if wanted else "local"
    return config.engine
