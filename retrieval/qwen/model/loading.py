"""Loading a Qwen3-VL checkpoint (hub id or local path) the way the official classes do.

The embedder and the reranker both load ``Qwen3VLForConditionalGeneration`` and keep its inner
``Qwen3VLModel`` (the official ``Qwen3VLForEmbedding`` wraps exactly that module). The reranker also keeps
the ``yes``/``no`` rows of the LM head; the full head is dropped to save memory.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput


@dataclass
class LoadedQwen:
    """A loaded checkpoint: the inner model, its processor and what identifies it."""

    model: Any  # transformers Qwen3VLModel
    processor: Any  # transformers Qwen3VLProcessor
    model_id: str
    revision: str
    device: torch.device
    dtype: torch.dtype
    tower_hash: str
    lm_rows: dict[str, torch.Tensor] = field(default_factory=dict)
    test_model: bool = False
    fused_kernels: bool = False  # Liger's kernels run in this model's passes (the accelerated runtime switches them)

    @property
    def config(self) -> Any:
        return self.model.config

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.text_config.hidden_size)

    @property
    def head_dim(self) -> int:
        """The language model's attention head size (configs without ``head_dim`` imply hidden size / heads)."""
        text = self.model.config.text_config
        return int(getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads)

    @property
    def deepstack_levels(self) -> int:
        return len(self.model.config.vision_config.deepstack_visual_indexes)

    @property
    def image_token_id(self) -> int:
        return int(self.model.config.image_token_id)



def public_model_id(source: str | Path) -> str:
    """The name responses give a model: a hub id as is, a local checkpoint by its folder name only, so a
    server never tells its callers its filesystem layout."""
    text = str(source)
    path = Path(text).expanduser()
    if path.is_absolute() or text.startswith((".", "~")) or path.exists():
        return path.resolve().name or text
    return text

def resolve_device(device: str | None) -> torch.device:
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype | None, device: torch.device) -> torch.dtype:
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype in (None, "auto"):
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    value = getattr(torch, str(dtype), None)
    if not isinstance(value, torch.dtype):
        raise InvalidInput(f"unknown dtype {dtype!r}")
    return value


def tower_hash(visual: torch.nn.Module) -> str:
    """sha256 over the vision tower's named parameters and buffers (name, dtype, shape, bytes)."""
    h = hashlib.sha256()
    tensors: dict[str, torch.Tensor] = dict(visual.named_parameters())
    tensors.update(dict(visual.named_buffers()))
    for name in sorted(tensors):
        t = tensors[name].detach()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}\n".encode())
        flat = t.to("cpu").contiguous().view(-1)
        h.update(flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b"")
    return h.hexdigest()


def load_qwen(
    path_or_id: str | Path,
    *,
    device: str | None = None,
    dtype: str | torch.dtype | None = None,
    attn_implementation: str | None = "sdpa",
    lm_rows: tuple[str, ...] = (),
    revision: str | None = None,
) -> LoadedQwen:
    """Load processor + model; keep ``lm_rows`` (token strings) of the LM head, drop the rest of it."""
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    if torch.cuda.is_available():
        # cuDNN attention builds a new execution plan for every new batch shape (every shortlist and
        # ingestion batch differs), which costs more than the attention; Flash/efficient kernels do not.
        torch.backends.cuda.enable_cudnn_sdp(False)
    dev = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, dev)
    source = str(path_or_id)
    kwargs: dict[str, Any] = {"revision": revision} if revision else {}
    try:
        processor = AutoProcessor.from_pretrained(source, **kwargs)
        full = Qwen3VLForConditionalGeneration.from_pretrained(
            source, dtype=torch_dtype, attn_implementation=attn_implementation, **kwargs
        )
    except OSError as exc:
        raise BackendUnavailable(
            f"cannot load Qwen3-VL checkpoint {source!r}: {exc}. Give a local path, or a hub id that is in the "
            "Hugging Face cache (no hub is reachable here); `rubricsearch make-test-model DIR` writes a test one."
        ) from exc
    full.eval()
    rows: dict[str, torch.Tensor] = {}
    if lm_rows:
        vocab = processor.tokenizer.get_vocab()
        head = full.get_output_embeddings().weight
        for token in lm_rows:
            if token not in vocab:
                raise InvalidInput(f"token {token!r} is not in the vocabulary of {source}")
            rows[token] = head[vocab[token]].detach().to(torch.float32).clone()
    model = full.model
    thash = tower_hash(model.visual)
    del full  # drops the LM head (tied heads stay alive through the input embeddings)
    model.to(dev)
    rows = {k: v.to(dev) for k, v in rows.items()}
    loaded = LoadedQwen(
        model=model,
        processor=processor,
        model_id=public_model_id(source),
        revision=_revision(source, model.config),
        device=dev,
        dtype=torch_dtype,
        tower_hash=thash,
        lm_rows=rows,
        test_model=(Path(source) / "rubricsearch_test_model.json").exists(),
    )
    return loaded


def _revision(source: str, config: Any) -> str:
    commit = getattr(config, "_commit_hash", None)
    if commit:
        return str(commit)
    card = Path(source) / "rubricsearch_test_model.json"
    if card.exists():
        meta = json.loads(card.read_text())
        return f"test-{meta.get('size', 'tiny')}-seed{meta.get('seed', 0)}"
    return "local"
