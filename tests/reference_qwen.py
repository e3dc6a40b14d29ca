"""Plain reference computations in the official message layout (no rubricsearch code involved).

They mirror QwenLM/Qwen3-VL-Embedding's ``Qwen3VLEmbedder.process`` and ``Qwen3VLReranker.process``:
conversation -> ``apply_chat_template`` -> ``qwen_vl_utils.process_vision_info`` -> ``Qwen3VLProcessor``
-> ``Qwen3VLModel``; used by the fidelity tests as ground truth.
"""

from __future__ import annotations

import unicodedata
from typing import Any

import torch
import torch.nn.functional as F

RERANK_SYSTEM = (
    'Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
    'Note that the answer can only be "yes" or "no".'
)


def _load(model_dir: str, padding_side: str) -> tuple[Any, Any, Any]:
    from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

    processor = AutoProcessor.from_pretrained(model_dir, padding_side=padding_side)
    full = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
    return processor, full.model, full


def official_embed_conversation(item: dict[str, Any], min_pixels: int, max_pixels: int,
                                default_instruction: str = "Represent the user's input.") -> list[dict[str, Any]]:
    instruction = item.get("instruction")
    if instruction:
        instruction = instruction.strip()
        if instruction and not unicodedata.category(instruction[-1]).startswith("P"):
            instruction = instruction + "."
    content: list[dict[str, Any]] = []
    conversation = [
        {"role": "system", "content": [{"type": "text", "text": instruction or default_instruction}]},
        {"role": "user", "content": content},
    ]
    text, image = item.get("text"), item.get("image")
    if not text and not image:
        content.append({"type": "text", "text": "NULL"})
        return conversation
    images = image if isinstance(image, list) else ([image] if image is not None else [])
    for img in images:
        content.append({"type": "image", "image": img, "min_pixels": min_pixels, "max_pixels": max_pixels})
    texts = text if isinstance(text, list) else ([text] if text else [])
    for t in texts:
        content.append({"type": "text", "text": t})
    return conversation


def _vision(conversations: list[list[dict[str, Any]]]) -> Any:
    from qwen_vl_utils import process_vision_info

    images, _videos, _kwargs = process_vision_info(
        conversations, image_patch_size=16, return_video_metadata=True, return_video_kwargs=True
    )
    return images


@torch.no_grad()
def official_embed(model_dir: str, items: list[dict[str, Any]], min_pixels: int = 4096,
                   max_pixels: int = 1843200) -> torch.Tensor:
    """``items`` hold PIL images (already decoded); returns L2-normalised float32 [N, H]."""
    processor, model, _ = _load(model_dir, "right")
    conversations = [official_embed_conversation(i, min_pixels, max_pixels) for i in items]
    text = processor.apply_chat_template(conversations, add_generation_prompt=True, tokenize=False)
    images = _vision(conversations)
    inputs = processor(text=text, images=images, videos=None, truncation=True, max_length=8192,
                       padding=True, do_resize=False, return_tensors="pt")
    out = model(**inputs)
    mask = inputs["attention_mask"]
    last = mask.flip(dims=[1]).argmax(dim=1)
    last = mask.shape[1] - last - 1
    pooled = out.last_hidden_state[torch.arange(mask.shape[0]), last]
    return F.normalize(pooled, p=2, dim=-1)


def official_rerank_conversation(query: dict[str, Any], doc: dict[str, Any], instruction: str,
                                 min_pixels: int, max_pixels: int) -> list[dict[str, Any]]:
    def side(prefix: str, d: dict[str, Any]) -> list[dict[str, Any]]:
        content: list[dict[str, Any]] = [{"type": "text", "text": prefix}]
        text, image = d.get("text"), d.get("image")
        if not text and not image:
            content.append({"type": "text", "text": "NULL"})
            return content
        for img in image if isinstance(image, list) else ([image] if image is not None else []):
            content.append({"type": "image", "image": img, "min_pixels": min_pixels, "max_pixels": max_pixels})
        if text:
            content.append({"type": "text", "text": text})
        return content

    contents = [{"type": "text", "text": "<Instruct>: " + instruction}]
    contents += side("<Query>:", query)
    contents += side("\n<Document>:", doc)
    return [{"role": "system", "content": [{"type": "text", "text": RERANK_SYSTEM}]},
            {"role": "user", "content": contents}]


@torch.no_grad()
def official_rerank(model_dir: str, query: dict[str, Any], docs: list[dict[str, Any]], instruction: str,
                    min_pixels: int = 4096, max_pixels: int = 1843200) -> list[float]:
    """One pair per forward, as the official reranker does."""
    processor, model, full = _load(model_dir, "left")
    vocab = processor.tokenizer.get_vocab()
    head = full.get_output_embeddings().weight
    w = (head[vocab["yes"]] - head[vocab["no"]]).float()
    scores = []
    for doc in docs:
        conv = official_rerank_conversation(query, doc, instruction, min_pixels, max_pixels)
        text = processor.apply_chat_template([conv], add_generation_prompt=True, tokenize=False)
        images = _vision([conv])
        inputs = processor(text=text, images=images, videos=None, truncation=False, padding=True,
                           do_resize=False, return_tensors="pt")
        h = model(**inputs).last_hidden_state[:, -1].float()
        scores.append(torch.sigmoid(h @ w).item())
    return scores
