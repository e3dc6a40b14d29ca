"""What both demo-model trainers share: the base checkpoint, the generated images, the forward pass, and how a
training stage runs the shared loop (:func:`retrieval.tuning.loop.fit`).

The forward is the inference forward. Images go through the official preprocessing
(:class:`~retrieval.qwen.engine.vision.VisionEncoder`), the vision tower runs with gradients and its output becomes
:class:`~retrieval.packages.VisualPackage` objects, prompts are rendered by the same functions the local
backends use (chat template, image pads expanded from the packages) and the language model runs through
:func:`retrieval.qwen.engine.forward.pooled_states`, the very function inference calls (under ``inference_mode``).
So a demo model learns exactly what it is later asked.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch

from rubricsearch.app.demo.faces import DEFAULT_SIZE, Face, Split, draw_face, faces, png_bytes
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.packages import VisualPackage
from rubricsearch.retrieval.plugins.accelerated.tower_attention import GROUPED_ATTENTION, register
from rubricsearch.retrieval.qwen.engine.forward import LMInput, pooled_states
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.checkpoint import Kind, make_test_model
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.qwen.model.prompts import Content, Prompt, Tokenizer, render
from rubricsearch.retrieval.tuning.loop import Optimizing, Progress, fit

Batch = TypeVar("Batch")


@dataclass
class ImageBank:
    """Generated faces of one split, decoded from PNG bytes as the app decodes uploads, and preprocessed once."""

    faces: list[Face]
    images: list[ImageLike]
    pixels: list[torch.Tensor]
    grids: list[tuple[int, int, int]]
    seed: int = 0
    by_key: dict[tuple[str, ...], list[int]] = field(default_factory=dict)

    @classmethod
    def build(cls, encoder: VisionEncoder, split: Split, count: int, *, seed: int, size: int = DEFAULT_SIZE,
              ) -> ImageBank:
        chosen = faces(split, count, seed=seed)
        images: list[ImageLike] = [decode_image(png_bytes(draw_face(f, size=size, seed=seed))) for f in chosen]
        pixels, grids = [], []
        for img in images:
            p, g = encoder.preprocess([img])
            pixels.append(p)
            grids.append((int(g[0, 0]), int(g[0, 1]), int(g[0, 2])))
        bank = cls(chosen, images, pixels, grids, seed)
        for i, face in enumerate(chosen):
            bank.by_key.setdefault(face.key, []).append(i)
        return bank

    def pick(self, rng: random.Random, accept: Any, *, avoid: int | None = None) -> int | None:
        """A random index whose face ``accept`` takes (None if there is none)."""
        options = [i for i, f in enumerate(self.faces) if i != avoid and accept(f)]
        return rng.choice(options) if options else None


class Trainee:
    """A checkpoint being trained: the full ``Qwen3VLForConditionalGeneration`` and its inference-side view."""

    def __init__(self, path: Path, *, threads: int | None = None) -> None:
        from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

        if threads:
            torch.set_num_threads(threads)
        self.path = path
        self.processor = AutoProcessor.from_pretrained(str(path))
        self.full = Qwen3VLForConditionalGeneration.from_pretrained(str(path), dtype=torch.float32)
        self.full.train()
        model = self.full.model
        # tower_hash only names the packages' fingerprint here; nothing is stored under it
        self.loaded = LoadedQwen(model=model, processor=self.processor, model_id=str(path), revision="training",
                                 device=torch.device("cpu"), dtype=torch.float32, tower_hash="training")
        self.encoder = VisionEncoder(self.loaded, preprocess_threads=1)
        register()  # the accelerated engine's grouped attention: one call for all images of a batch (packages)
        self.tokenizer = Tokenizer(self.processor, self.loaded.image_token_id)
        self.pad_id = int(self.processor.tokenizer.pad_token_id or 0)

    def packages(self, bank: ImageBank, indices: Sequence[int]) -> dict[int, VisualPackage]:
        """One tower pass (with gradients) over the distinct images; packages as the package stage makes them."""
        unique = list(dict.fromkeys(indices))
        visual = self.loaded.model.visual
        grids = [bank.grids[i] for i in unique]
        config = visual.config
        previous = config._attn_implementation
        config._attn_implementation = GROUPED_ATTENTION  # all images of a batch in one attention call
        try:
            out = visual(torch.cat([bank.pixels[i] for i in unique]), grid_thw=torch.tensor(grids),
                         return_dict=True, max_seqlen=max(h * w for _, h, w in grids))
        finally:
            config._attn_implementation = previous
        merge = int(visual.spatial_merge_size) ** 2
        sizes = [t * h * w // merge for t, h, w in grids]
        embeds = torch.split(out.pooler_output, sizes)
        levels = [torch.split(f, sizes) for f in out.deepstack_features]
        return {i: VisualPackage(image_sha256=bank.images[i].sha256, fingerprint=self.encoder.fingerprint,
                                 grid_thw=grids[k], embeds=embeds[k], deepstack=torch.stack([lv[k] for lv in levels]))
                for k, i in enumerate(unique)}

    def lm_input(self, conversation: list[dict[str, Any]], images: Sequence[ImageLike],
                 packages: Sequence[VisualPackage]) -> LMInput:
        """Token ids exactly as the local backends make them (rendered template, pads expanded)."""
        prompt: Prompt = render(self.processor, conversation, images)
        return LMInput(ids=self.tokenizer.ids(prompt, packages), packages=list(packages))

    def states(self, inputs: Sequence[LMInput]) -> torch.Tensor:
        """``[N, H]`` last-token hidden states through the inference forward, with gradients."""
        return pooled_states(self.loaded, inputs, self.pad_id)

    def save(self, out: Path, card: dict[str, Any]) -> None:
        """Hugging Face format (safetensors, config, tokenizer, processor, chat template) plus the demo card."""
        import json
        import shutil

        self.full.eval()
        out.mkdir(parents=True, exist_ok=True)
        self.full.save_pretrained(str(out), safe_serialization=True)
        for name in self.path.iterdir():
            if name.is_file() and not (out / name.name).exists():
                shutil.copy2(name, out / name.name)
        (out / "rubricsearch_test_model.json").unlink(missing_ok=True)
        (out / DEMO_CARD).write_text(json.dumps(card, indent=2, sort_keys=True))


DEMO_CARD = "rubricsearch_demo_model.json"


def pooled_tokens(tokens: torch.Tensor) -> torch.Tensor:
    """A package's visual tokens as one attribute feature, mean- and max-pooled: what the tower pre-training's head
    learns from and what the tower probe reads, so the probe measures what the pre-training taught."""
    return torch.cat([tokens.mean(0), tokens.amax(0)])


def content(image: ImageLike | None, texts: Sequence[str]) -> Content:
    return Content(texts=[t for t in texts if t], images=[image] if image is not None else [])


@dataclass(frozen=True)
class Arch:
    """The demo models' size: between the ``tiny`` and ``small`` test configurations."""

    vision_hidden: int = 64
    vision_depth: int = 3
    vision_heads: int = 2
    text_hidden: int = 128
    text_layers: int = 3
    text_heads: int = 4
    text_intermediate: int = 256

    def apply(self, config: Any) -> None:
        v, t = config.vision_config, config.text_config
        v.hidden_size, v.depth, v.num_heads, v.intermediate_size = (self.vision_hidden, self.vision_depth,
                                                                     self.vision_heads, 2 * self.vision_hidden)
        v.out_hidden_size = self.text_hidden
        v.deepstack_visual_indexes = list(range(min(self.vision_depth - 1, 2)))
        t.hidden_size, t.num_hidden_layers, t.intermediate_size = (self.text_hidden, self.text_layers,
                                                                   self.text_intermediate)
        t.num_attention_heads, t.num_key_value_heads = self.text_heads, max(1, self.text_heads // 2)
        t.head_dim = 32


def base_checkpoint(out: Path, kind: Kind, *, arch: Arch, seed: int) -> Path:
    """A fresh random-weight checkpoint with the test checkpoints' tokenizer, processor and chat template
    (written by :func:`~retrieval.qwen.model.checkpoint.make_test_model`), at the demo models' size."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    path = make_test_model(out, kind, size="tiny", seed=seed)
    config = AutoConfig.from_pretrained(str(path))
    arch.apply(config)
    torch.manual_seed(seed)
    Qwen3VLForConditionalGeneration(config).save_pretrained(str(path), safe_serialization=True)
    return path


def seed_everything(seed: int) -> random.Random:
    torch.manual_seed(seed)
    torch.use_deterministic_algorithms(True, warn_only=True)
    return random.Random(seed)


def one_cycle(opt: torch.optim.Optimizer, max_lr: float, steps: int, warmup: float,
              ) -> torch.optim.lr_scheduler.OneCycleLR:
    """torch's one-cycle schedule over ``steps``: the first ``warmup`` of them (a share) rise to ``max_lr``, the rest
    anneal. OneCycleLR ends its warm-up phase at step ``warmup * steps - 1`` and divides by that end, so a warm-up
    of exactly one step (0.1 of 10 steps) would divide by zero: such a warm-up is none, the schedule starting near
    its peak, as torch already does with a warm-up shorter than one step. Any other plan gets torch's schedule."""
    pct_start = 0.0 if warmup * steps == 1 else warmup
    return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=max_lr, total_steps=steps, pct_start=pct_start)


def adamw_one_cycle(params: list[torch.nn.Parameter], lr: float, steps: int, warmup: float) -> Optimizing:
    """The demo models' optimiser: AdamW with weight decay 0.01 under :func:`one_cycle`."""
    opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
    return Optimizing(params, opt, one_cycle(opt, lr, steps, warmup))


class StepLog:
    """A training stage's progress line, logged after every tenth step (the first, the 11th, ...) and the last:
    ``what [bar] percent step n/steps loss`` and the time spent and left, the line
    :class:`app.demo.progress.Tracker` reads."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.started = time.monotonic()

    def __call__(self, p: Progress) -> None:
        if (p.step - 1) % 10 and p.step != p.steps:
            return
        elapsed = time.monotonic() - self.started
        done = p.step / p.steps
        bar = "#" * round(20 * done) + "." * (20 - round(20 * done))
        logging.getLogger("rubricsearch.demo").info(
            "%s [%s] %3.0f%% step %d/%d loss %.3f (%.0f s, about %.0f s left)", self.what, bar, 100 * done, p.step,
            p.steps, p.loss, elapsed, elapsed / p.step * (p.steps - p.step))


def train(model: torch.nn.Module, steps: int, optimizing: Optimizing, batches: Iterator[Batch],
          loss_of: Callable[[Batch], torch.Tensor], what: str) -> list[float]:
    """A demo training stage through the shared loop (:func:`retrieval.tuning.loop.fit`): ``steps`` freshly
    sampled batches, no validation (the final weights are kept), progress logged as ``what``; returns the loss
    per step."""
    return fit(model, steps, optimizing, batches, loss_of, validation=None, before=None,
               progress=StepLog(what)).losses
