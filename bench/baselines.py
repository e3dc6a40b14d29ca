"""Baselines the benchmarks measure rubricsearch against, side by side in one run.

``Official`` repeats the official classes' computation (QwenLM/Qwen3-VL-Embedding's ``Qwen3VLEmbedder.process``
and ``Qwen3VLReranker.process``): chat template, ``qwen_vl_utils`` resize, processor and a full model forward
per call, no caches. ``ingest_baselines`` times ingestion-like embedding of a file list three ways: the
official class path (decode + everything, 16 images per call), the raw transformers pieces (processor +
forward on already decoded and resized images, one large batch: the naive path's GPU-side ceiling), and the
FLOP limit. ``GpuUtil`` samples NVML utilisation while a block runs.
"""

from __future__ import annotations

import io
import threading
import time
from typing import Any

import torch
from PIL import Image

from tests.reference_qwen import official_embed_conversation, official_rerank_conversation

OFFICIAL_MIN_PIXELS, OFFICIAL_MAX_PIXELS = 4096, 1843200


class Official:
    """The official classes' computation: preprocessing + full model forward per call, no caches."""

    def __init__(self, loaded: Any) -> None:
        self.model = loaded.model
        self.processor = loaded.processor
        self.device = loaded.device
        self.w = (loaded.lm_rows["yes"] - loaded.lm_rows["no"]).float() if loaded.lm_rows else None

    def _inputs(self, conversations: list[Any], padding_side: str, resized: list[Any] | None = None) -> Any:
        from qwen_vl_utils import process_vision_info

        self.processor.tokenizer.padding_side = padding_side
        text = self.processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
        images = resized
        if images is None:
            images, _, _ = process_vision_info(conversations, image_patch_size=16, return_video_metadata=True,
                                               return_video_kwargs=True)
        inputs = self.processor(text=text, images=images, videos=None, padding=True, do_resize=False,
                                return_tensors="pt")
        return {k: v.to(self.device) for k, v in inputs.items()}

    @torch.inference_mode()
    def embed(self, items: list[dict[str, Any]], resized: list[Any] | None = None) -> torch.Tensor:
        convs = [official_embed_conversation(i, OFFICIAL_MIN_PIXELS, OFFICIAL_MAX_PIXELS) for i in items]
        inputs = self._inputs(convs, "right", resized)
        hidden = self.model(**inputs).last_hidden_state
        last = inputs["attention_mask"].sum(1) - 1
        return torch.nn.functional.normalize(hidden[torch.arange(hidden.shape[0]), last].float(), dim=-1)

    @torch.inference_mode()
    def rerank(self, query: dict[str, Any], docs: list[dict[str, Any]], instruction: str) -> list[float]:
        assert self.w is not None, "load the checkpoint with lm_rows=('yes', 'no') to rerank"
        scores = []
        for doc in docs:  # one pair per forward, as Qwen3VLReranker.process does
            conv = official_rerank_conversation(query, doc, instruction, OFFICIAL_MIN_PIXELS, OFFICIAL_MAX_PIXELS)
            h = self.model(**self._inputs([conv], "left")).last_hidden_state[:, -1].float()
            scores.append(torch.sigmoid(h @ self.w).item())
        return scores


def _decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def ingest_baselines(loaded: Any, files: list[tuple[str, bytes]], raw_batch: int,
                     official_batch: int = 16) -> dict[str, float]:
    """Images/s of the official class path and of the raw transformers pieces on ``files``."""
    from qwen_vl_utils import fetch_image

    official = Official(loaded)
    sync = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)

    def run_official(chunk: list[tuple[str, bytes]]) -> None:
        official.embed([{"image": _decode(data)} for _, data in chunk])

    def resize(data: bytes) -> Any:
        return fetch_image({"image": _decode(data), "min_pixels": OFFICIAL_MIN_PIXELS,
                            "max_pixels": OFFICIAL_MAX_PIXELS}, image_patch_size=16)

    run_official(files[:official_batch])  # warm-up
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(files), official_batch):
        run_official(files[i:i + official_batch])
    sync()
    official_s = time.perf_counter() - t0

    resized = [resize(data) for _, data in files]  # outside the timed region: the GPU-side ceiling
    items = [{"image": im} for im in resized]
    official.embed(items[:raw_batch], resized[:raw_batch])
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(files), raw_batch):
        official.embed(items[i:i + raw_batch], resized[i:i + raw_batch])
    sync()
    raw_s = time.perf_counter() - t0
    return {"official_images_per_s": len(files) / official_s, "raw_images_per_s": len(files) / raw_s,
            "official_batch": official_batch, "raw_batch": raw_batch}


def side_by_side(embedder: Any, files: list[tuple[str, bytes]], ours: float, limit: float | None,
                 util: float | None, out: dict[str, Any]) -> list[str]:
    """rubricsearch vs the official class path vs the raw transformers pieces vs the FLOP limit."""
    big = max(len(data) for _, data in files) > 2_000_000
    base = ingest_baselines(embedder.loaded, files, raw_batch=4 if big else 64)
    out["baselines"] = {**base, "ours_images_per_s": ours, "flop_limit_images_per_s": limit, "gpu_util": util}
    rows = [("rubricsearch (whole job: decode ... catalog)", ours),
            (f"official class path ({base['official_batch']} images per call)", base["official_images_per_s"]),
            (f"raw transformers pieces (batch {base['raw_batch']}, decoded + resized beforehand)",
             base["raw_images_per_s"])]
    if limit:
        rows.append(("FLOP limit (bf16 matmul peak)", limit))
    lines = ["  -- side by side, same files --", f"  {'path':<64} {'images/s':>9} {'ours is':>8}"]
    for name, rate in rows:
        lines.append(f"  {name:<64} {rate:>9.1f} {ours / rate:>7.2f}x")
    return lines


class GpuUtil:
    """Samples NVML GPU utilisation (share of time a kernel ran) every 50 ms while active."""

    def __init__(self) -> None:
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        try:
            import pynvml

            pynvml.nvmlInit()
            self._nvml: Any = pynvml
            self._handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        except Exception:
            self._nvml = None

    def __enter__(self) -> GpuUtil:
        if self._nvml is not None:
            self._stop.clear()
            self.samples = []
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self.samples.append(int(self._nvml.nvmlDeviceGetUtilizationRates(self._handle).gpu))

    def __exit__(self, *exc: object) -> None:
        if self._thread is not None:
            self._stop.set()
            self._thread.join()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
