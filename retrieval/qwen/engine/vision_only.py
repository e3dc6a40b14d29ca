"""A vision-only worker: just the vision tower (+ processor) of a Qwen3-VL checkpoint.

A vLLM deployment runs the language model remotely, but visual packages are still made (and keyed)
here, so the same image is never encoded twice across backends. Loading only the ``model.visual.*``
tensors (read with safetensors ``safe_open``, nothing else is materialised) needs a fraction of the
full model's memory. The tower is built by transformers from the checkpoint's ``vision_config`` with
the same dtype and attention implementation as :func:`retrieval.qwen.model.loading.load_qwen`, so its
:func:`tower_hash` (and therefore the package :class:`Fingerprint`) is the one a local backend computes
for that checkpoint: packages made here are found by local backends and vice versa.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Literal

import torch

from rubricsearch.retrieval.errors import BackendUnavailable
from rubricsearch.retrieval.packages import Fingerprint
from rubricsearch.retrieval.qwen.engine.vision import (
    DEFAULT_MAX_PIXELS,
    DEFAULT_MIN_PIXELS,
    PreprocessMode,
    VisionEncoder,
    tower_fingerprint,
)
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen, _revision, resolve_device, resolve_dtype, tower_hash

# Where checkpoints keep the tower: Qwen3-VL writes ``model.visual.``; Qwen2-VL-style exports ``visual.``.
VISUAL_PREFIXES = ("model.visual.", "visual.")


def checkpoint_dir(path_or_id: str | Path, revision: str | None = None) -> Path:
    """A local directory for a path, or for a hub id already in the Hugging Face cache (never downloads)."""
    path = Path(path_or_id)
    if path.is_dir():
        return path
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(str(path_or_id), revision=revision, local_files_only=True))
    except Exception as exc:  # not cached, or not a valid repo id
        raise BackendUnavailable(
            f"checkpoint {str(path_or_id)!r} is not a local directory nor in the Hugging Face cache: {exc}"
        ) from exc


def _shards(root: Path) -> list[Path]:
    """The safetensors files that hold the tower (the index's weight map when sharded)."""
    index = root / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        names = {f for k, f in weight_map.items() if k.startswith(VISUAL_PREFIXES)}
        return [root / n for n in sorted(names)]
    return sorted(root.glob("*.safetensors"))


def read_visual_tensors(root: Path) -> dict[str, torch.Tensor]:
    """``{name without prefix: tensor}`` of the vision tower only; the LM's tensors are never read."""
    from safetensors import safe_open

    found: dict[str, dict[str, torch.Tensor]] = {p: {} for p in VISUAL_PREFIXES}
    for shard in _shards(root):
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118 - safe_open handles are not mappings
                for prefix in VISUAL_PREFIXES:
                    if key.startswith(prefix):
                        found[prefix][key[len(prefix):]] = fh.get_tensor(key)
                        break
    for prefix in VISUAL_PREFIXES:
        if found[prefix]:
            return found[prefix]
    raise BackendUnavailable(f"no vision tower tensors ({' / '.join(VISUAL_PREFIXES)}*) in {root}")


def checkpoint_parameter_counts(root: Path) -> tuple[int, int]:
    """(vision tower, whole checkpoint) parameter counts from the safetensors headers (no tensor read)."""
    from safetensors import safe_open

    visual = total = 0
    for shard in sorted(root.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as fh:
            for key in fh.keys():  # noqa: SIM118
                n = 1
                for d in fh.get_slice(key).get_shape():
                    n *= int(d)
                total += n
                visual += n if key.startswith(VISUAL_PREFIXES) else 0
    return visual, total


class VisionTowerModel:
    """Stands in for ``Qwen3VLModel`` where a :class:`VisionEncoder` uses it: ``.visual`` and ``.config``
    (plus ``get_image_features``, the transformers entry point, for callers that use that)."""

    def __init__(self, visual: Any, config: Any) -> None:
        self.visual = visual
        self.config = config  # the full Qwen3VLConfig (text width, image token id, deepstack levels)

    def get_image_features(self, pixel_values: torch.Tensor, image_grid_thw: torch.Tensor,
                           return_dict: bool = True) -> Any:
        """Exactly ``Qwen3VLModel.get_image_features``: the tower, then a split per image."""
        pixel_values = pixel_values.type(self.visual.dtype)
        out = self.visual(pixel_values, grid_thw=image_grid_thw, return_dict=True)
        sizes = (image_grid_thw.prod(-1) // self.visual.spatial_merge_size**2).tolist()
        out.pooler_output = torch.split(out.pooler_output, sizes)
        out.deepstack_features = [torch.split(f, sizes) for f in out.deepstack_features]
        return out

    def parameters(self) -> Iterator[torch.nn.Parameter]:
        return iter(self.visual.parameters())


def load_vision_only(
    path_or_id: str | Path,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = "sdpa",
    revision: str | None = None,
) -> LoadedQwen:
    """A :class:`LoadedQwen` whose ``model`` is only the vision tower (same defaults as ``load_qwen``)."""
    from transformers import AutoConfig, AutoProcessor
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLVisionModel
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    root = checkpoint_dir(path_or_id, revision)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    try:
        config = AutoConfig.from_pretrained(str(root))
        processor = AutoProcessor.from_pretrained(str(root))
    except (OSError, ValueError) as exc:
        raise BackendUnavailable(f"cannot read the config/processor of {str(path_or_id)!r}: {exc}") from exc
    state = read_visual_tensors(root)
    loaded: Any = Qwen3VLVisionModel.from_pretrained(
        None, config=config.vision_config, state_dict=state, dtype=torch_dtype,
        attn_implementation=attn_implementation, output_loading_info=True,
    )
    visual, info = loaded
    del state, loaded
    if info.get("missing_keys") or info.get("mismatched_keys"):
        raise BackendUnavailable(
            f"vision tower of {root} is incomplete: missing {sorted(info.get('missing_keys', []))[:5]}, "
            f"mismatched {list(info.get('mismatched_keys', []))[:5]}"
        )
    visual.eval()
    thash = tower_hash(visual)  # before the move, exactly where load_qwen hashes
    visual.to(dev)
    return LoadedQwen(
        model=VisionTowerModel(visual, config),
        processor=processor,
        model_id=str(path_or_id),
        revision=_revision(str(root), config),
        device=dev,
        dtype=torch_dtype,
        tower_hash=thash,
        test_model=(root / "rubricsearch_test_model.json").exists(),
    )


def vision_only(
    path_or_id: str | Path,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = "sdpa",
    revision: str | None = None,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    preprocess: PreprocessMode = "official",
    engine: Literal["auto", "local", "accelerated"] = "auto",
    **options: Any,
) -> VisionEncoder:
    """A vision encoder over the tower alone (same ``prepare``, ``encode``, ``fingerprint`` as a local model's):
    the one ``engine`` names in the registry (``auto``: the accelerated one on a GPU); ``options`` are its own
    keywords (``max_batch_patches``, ``preprocess_threads``, ...)."""
    from rubricsearch.retrieval.runtime.config import VisionConfig
    from rubricsearch.retrieval.runtime.registry import vision_encoder

    loaded = load_vision_only(path_or_id, device=device, dtype=dtype, attn_implementation=attn_implementation,
                              revision=revision)
    return vision_encoder(loaded, VisionConfig(min_pixels=min_pixels, max_pixels=max_pixels, preprocess=preprocess),
                          engine=engine, **options)


def vision_fingerprint(
    path_or_id: str | Path,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    min_pixels: int = DEFAULT_MIN_PIXELS,
    max_pixels: int = DEFAULT_MAX_PIXELS,
    revision: str | None = None,
    preprocess: PreprocessMode = "official",
) -> Fingerprint:
    """The package fingerprint of a checkpoint's tower, computed by loading it (then dropping it).

    For a remote backend that only reads packages: the key must come from the real weights, never a guess.
    """
    # Hashed on the CPU (as load_qwen does, before its move); dtype as a local backend on ``device`` would use.
    torch_dtype = resolve_dtype(dtype, resolve_device(device))
    loaded = load_vision_only(path_or_id, device="cpu", dtype=torch_dtype, revision=revision)
    fp = tower_fingerprint(loaded, min_pixels, max_pixels, preprocess)
    del loaded
    return fp
