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

from bench.common import engine, setting
from tests.reference_qwen import official_embed_conversation, official_rerank_conversation

OFFICIAL_MIN_PIXELS, OFFICIAL_MAX_PIXELS = 4096, 1843200
# A baseline call slower than this (the official classes on 12-MP photos: 10-40 s a search) is timed by its first
# run alone, printed as "1 run, no warm-up": its warm-up costs are noise at that length, and a warm-up plus repeats
# of it would not fit the GPU report's 10-minute call.
SLOW_S = 2.0
COLD = "1 run, no warm-up"


class Official:
    """The official classes' computation: preprocessing + full model forward per call, no caches."""

    def __init__(self, loaded: Any, min_pixels: int = OFFICIAL_MIN_PIXELS, max_pixels: int = OFFICIAL_MAX_PIXELS,
                 ) -> None:
        self.min_pixels, self.max_pixels = min_pixels, max_pixels  # the official defaults unless the run changed ours
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
        convs = [official_embed_conversation(i, self.min_pixels, self.max_pixels) for i in items]
        inputs = self._inputs(convs, "right", resized)
        hidden = self.model(**inputs).last_hidden_state
        last = inputs["attention_mask"].sum(1) - 1
        return torch.nn.functional.normalize(hidden[torch.arange(hidden.shape[0]), last].float(), dim=-1)

    @torch.inference_mode()
    def rerank(self, query: dict[str, Any], docs: list[dict[str, Any]], instruction: str) -> list[float]:
        assert self.w is not None, "load the checkpoint with lm_rows=('yes', 'no') to rerank"
        scores = []
        for doc in docs:  # one pair per forward, as Qwen3VLReranker.process does
            conv = official_rerank_conversation(query, doc, instruction, self.min_pixels, self.max_pixels)
            h = self.model(**self._inputs([conv], "left")).last_hidden_state[:, -1].float()
            scores.append(torch.sigmoid(h @ self.w).item())
        return scores


def _decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image.convert("RGB")


def ingest_baselines(loaded: Any, files: list[tuple[str, bytes]], raw_batch: int, official_batch: int = 16,
                     min_pixels: int = OFFICIAL_MIN_PIXELS, max_pixels: int = OFFICIAL_MAX_PIXELS) -> dict[str, Any]:
    """Images/s of the official class path and of the raw transformers pieces on ``files``. An official call
    slower than :data:`SLOW_S` is not a warm-up but the first of two timed calls (``official_images`` of them)."""
    from qwen_vl_utils import fetch_image

    official = Official(loaded, min_pixels, max_pixels)
    sync = torch.cuda.synchronize if loaded.device.type == "cuda" else (lambda: None)

    def run_official(chunk: list[tuple[str, bytes]]) -> float:
        sync()
        t0 = time.perf_counter()
        official.embed([{"image": _decode(data)} for _, data in chunk])
        sync()
        return time.perf_counter() - t0

    def resize(data: bytes) -> Any:
        return fetch_image({"image": _decode(data), "min_pixels": min_pixels, "max_pixels": max_pixels},
                           image_patch_size=16)

    first = run_official(files[:official_batch])
    cold = first > SLOW_S
    timed = files[:2 * official_batch] if cold else files
    official_s = first if cold else 0.0
    for i in range(official_batch if cold else 0, len(timed), official_batch):
        official_s += run_official(timed[i:i + official_batch])

    resized = _resize_all(resize, [data for _, data in files])  # outside the timed region: the GPU-side ceiling
    items = [{"image": im} for im in resized]
    official.embed(items[:raw_batch], resized[:raw_batch])
    sync()
    t0 = time.perf_counter()
    for i in range(0, len(files), raw_batch):
        official.embed(items[i:i + raw_batch], resized[i:i + raw_batch])
    sync()
    raw_s = time.perf_counter() - t0
    return {"official_images_per_s": len(timed) / official_s, "raw_images_per_s": len(files) / raw_s,
            "official_batch": official_batch, "raw_batch": raw_batch, "official_images": len(timed),
            "official_cold": cold}


class FirstCallTimer:
    """Ms of one call of a path after one warm-up per path, or of the path's first call alone where that took longer
    than :data:`SLOW_S` (then it is not run again)."""

    def __init__(self, sync: Any) -> None:
        self.sync = sync
        self.warm: set[Any] = set()

    def once(self, run: Any) -> float:
        self.sync()
        t0 = time.perf_counter()
        run()
        self.sync()
        return (time.perf_counter() - t0) * 1000

    def __call__(self, run: Any, path: Any) -> tuple[float, bool]:
        """(ms, whether it is the path's cold first call)."""
        if path not in self.warm:
            self.warm.add(path)
            first = self.once(run)
            if first > SLOW_S * 1000:
                return first, True
        return self.once(run), False


def _resize_all(resize: Any, images: list[Any]) -> list[Any]:
    """The official resize of each image, in threads (PIL works without the GIL): untimed preparation, which one
    thread made the longest part of the photo baselines."""
    import os
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(min(16, os.cpu_count() or 1)) as pool:
        return list(pool.map(resize, images))


def grid_of(vision: Any, data: bytes) -> tuple[int, int, int]:
    """The patch grid the tower sees for an image file (its header's size through the official resize)."""
    from qwen_vl_utils.vision_process import smart_resize

    from rubricsearch.retrieval.images import inspect_image

    info = inspect_image(data)
    h, w = smart_resize(info.height, info.width, factor=32, min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    return 1, h // 16, w // 16


def flop_limit(embedder: Any, images: list[bytes], wall: float) -> tuple[float, float]:
    """Images/s at the GPU's bf16 matrix-product peak for these images' tower and LM passes (the FLOP limit),
    and the model FLOP utilisation of a run that took ``wall`` seconds over them."""
    from bench.flops import PEAK_TFLOPS, lm_flops, vision_flops

    grids = [grid_of(engine(embedder).vision, data) for data in images]
    model = engine(embedder).loaded.model
    total = vision_flops(model.visual, grids) + lm_flops(
        model.language_model, model.config.text_config, [t * h * w // 4 + 14 for t, h, w in grids])
    peak = PEAK_TFLOPS * 1e12
    return len(images) * peak / total, total / wall / peak


def side_by_side(embedder: Any, files: list[tuple[str, bytes]], ours: float, limit: float | None,
                 util: float | None, out: dict[str, Any]) -> list[str]:
    """rubricsearch vs the official class path vs the raw transformers pieces vs the FLOP limit."""
    big = max(len(data) for _, data in files) > 2_000_000
    vision = engine(embedder).vision
    base = ingest_baselines(engine(embedder).loaded, files, raw_batch=4 if big else 64,
                            min_pixels=vision.min_pixels, max_pixels=vision.max_pixels)
    out["baselines"] = {**base, "ours_images_per_s": ours, "flop_limit_images_per_s": limit, "gpu_util": util}
    cold = f", {base['official_images']} images, {COLD}" if base["official_cold"] else ""
    rows = [("rubricsearch (whole job: decode ... catalog)", ours),
            (f"official class path ({base['official_batch']} images per call{cold})", base["official_images_per_s"]),
            (f"raw transformers pieces (batch {base['raw_batch']}, decoded + resized beforehand)",
             base["raw_images_per_s"])]
    if limit:
        rows.append(("FLOP limit (bf16 matmul peak)", limit))
    lines = ["  -- side by side, same files --", f"  {'path':<64} {'images/s':>9} {'ours is':>8}"]
    for name, rate in rows:
        lines.append(f"  {name:<64} {rate:>9.1f} {ours / rate:>7.2f}x")
    return lines


INSTRUCTION = "Judge whether the reference image matches the candidate by the criterion."


def search_baselines(state: Any, set_id: str, refs: list[bytes], candidates: list[bytes], top_k: int,
                     criteria: list[str], rubric: str, ours: dict[str, dict[str, float]], gpu: bool,
                     ) -> tuple[list[str], dict[str, Any]]:
    """Ms of the searches with a candidate through the official class path (the candidate embedded with the
    rubric, then one reranker forward per shortlisted pair and criterion, every image decoded and resized in its
    call) and the raw transformers pieces (the same calls on images decoded and resized beforehand), beside ours
    and the FLOP limit of our own work (the candidate's tower, its LM pass, the shortlist's LM passes). Each path
    is timed once after one warm-up, or by its first call alone where that is slower than :data:`SLOW_S`."""
    from qwen_vl_utils import fetch_image

    from bench.flops import PEAK_TFLOPS, lm_flops, vision_flops

    max_pixels = setting(state.settings, "models.max_pixels")
    min_pixels = OFFICIAL_MIN_PIXELS  # the product's floor is the official one
    emb = Official(engine(state.embedder).loaded, min_pixels, max_pixels)
    rr = Official(engine(state.reranker).loaded, min_pixels, max_pixels)
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    docs = refs[:top_k]

    def resize(data: bytes) -> Any:
        return fetch_image({"image": _decode(data), "min_pixels": min_pixels, "max_pixels": max_pixels},
                           image_patch_size=16)

    def search(cand: Any, doc_images: list[Any], texts: list[str], prepared: bool) -> None:
        query = cand if prepared else _decode(cand)
        emb.embed([{"image": query, "text": " ".join(texts)}], [query] if prepared else None)
        for text in texts:
            rr.rerank({"image": query, "text": text},
                      [{"image": d if prepared else _decode(d)} for d in doc_images], INSTRUCTION)

    timed_ms = FirstCallTimer(sync)
    resized_docs = _resize_all(resize, docs)
    cand, resized_cand = candidates[0], resize(candidates[0])
    vision, model = engine(state.embedder).vision, engine(state.embedder).loaded.model
    cgrid = grid_of(vision, cand)
    q_tokens, d_tokens = cgrid[1] * cgrid[2] // 4, [grid_of(vision, d)[1] * grid_of(vision, d)[2] // 4 for d in docs]
    out: dict[str, Any] = {}
    lines = ["  -- side by side, median ms per search --",
             f"  {'case':<26} {'ours':>8} {'official class path':>20} {'raw pieces':>11} {'FLOP limit':>11}"]
    for name, texts in (("rubric + candidate", [rubric]), ("3 criteria + candidate", criteria)):
        official, official_cold = timed_ms(lambda texts=texts: search(cand, docs, texts, False), False)
        raw, raw_cold = timed_ms(lambda texts=texts: search(resized_cand, resized_docs, texts, True), True)
        lm_lengths = [q_tokens + 30] + [q_tokens + 60 for _ in texts] + [d + 20 for d in d_tokens for _ in texts]
        flops = vision_flops(model.visual, [cgrid]) + lm_flops(model.language_model, model.config.text_config,
                                                                 lm_lengths)
        limit = flops / (PEAK_TFLOPS * 1e12) * 1000
        mine = ours[name]["total"]
        out[name] = {"ours_ms": mine, "official_ms": official, "raw_ms": raw, "flop_limit_ms": limit,
                     "official_cold": official_cold, "raw_cold": raw_cold}
        lines.append(f"  {name:<26} {mine:>8.1f} {official:>10.1f}{'*' if official_cold else ' '} "
                     f"({official / mine:4.1f}x) {raw:>10.1f}{'*' if raw_cold else ' '} {limit:>11.2f}")
    lines.append("  (official / raw: our search's work as the official classes do it, one pair per forward; "
                 f"FLOP limit: our passes' matrix products at the bf16 peak; *: {COLD}, a call over {SLOW_S:.0f} s)")
    return lines, out


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
