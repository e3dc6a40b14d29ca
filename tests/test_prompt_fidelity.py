"""Rendered prompts and token ids equal the official Qwen3-VL-Embedding / Reranker templates."""

from __future__ import annotations

from pathlib import Path

import pytest

from rubricsearch.rerank.prompts import rerank_conversation
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content, Tokenizer, embed_conversation, finish_instruction, render

SYSTEM_RR = ('Judge whether the Document meets the requirements based on the Query and the Instruct provided. '
             'Note that the answer can only be "yes" or "no".')
VISION = "<|vision_start|><|image_pad|><|vision_end|>"


@pytest.fixture(scope="module")
def processor(tiny_embedding_dir: Path):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_embedding_dir)


def test_instruction_punctuation_rule() -> None:
    assert finish_instruction("Find images matching this description", "D.") == \
        "Find images matching this description."
    assert finish_instruction("  Which? ", "D.") == "Which?"
    assert finish_instruction(None, "Represent the user's input.") == "Represent the user's input."
    assert finish_instruction("   ", "D.") == "D."


def test_embedding_templates(processor, make_png) -> None:
    img = decode_image(make_png(64, 64))
    cases = [
        (Content(images=[img]), None,
         f"<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\n{VISION}<|im_end|>\n"
         "<|im_start|>assistant\n"),
        (Content(texts=["A cat in the snow."], images=[img]), "Find images matching this description",
         "<|im_start|>system\nFind images matching this description.<|im_end|>\n<|im_start|>user\n"
         f"{VISION}A cat in the snow.<|im_end|>\n<|im_start|>assistant\n"),
        (Content(), None,
         "<|im_start|>system\nRepresent the user's input.<|im_end|>\n<|im_start|>user\nNULL<|im_end|>\n"
         "<|im_start|>assistant\n"),
    ]
    for content, instruction, expected in cases:
        prompt = render(processor, embed_conversation(content, instruction, "Represent the user's input."),
                        content.images)
        assert prompt.text == expected


def test_reranker_template(processor, make_png) -> None:
    img = decode_image(make_png(64, 64))
    q = Content(texts=["short fur"], images=[img])
    d = Content(images=[img])
    prompt = render(processor, rerank_conversation(q, d, "Match the markings"), [img, img])
    assert prompt.text == (
        f"<|im_start|>system\n{SYSTEM_RR}<|im_end|>\n<|im_start|>user\n<Instruct>: Match the markings"
        f"<Query>:{VISION}short fur\n<Document>:{VISION}<|im_end|>\n<|im_start|>assistant\n"
    )
    default = render(processor, rerank_conversation(Content(texts=["q"]), Content(), None), [])
    assert "<Instruct>: Given a search query, retrieve relevant candidates that answer the query.<Query>:q" \
        "\n<Document>:NULL<|im_end|>" in default.text


def test_cached_rendering_equals_the_template(processor, make_png) -> None:
    """The tokenizer renders each conversation shape once; every later rendering must still equal the
    template's own output, for other images, texts, instructions and image positions."""
    tok = Tokenizer(processor, image_token_id=0)
    a, b = decode_image(make_png(64, 64, 1)), decode_image(make_png(48, 80, 2))
    conversations = [
        (rerank_conversation(Content(texts=["short fur"], images=[a]), Content(images=[b]), "Match"), [a, b]),
        (rerank_conversation(Content(texts=["short fur"], images=[b]), Content(images=[a]), "Match"), [b, a]),
        (rerank_conversation(Content(texts=["long fur"], images=[a]), Content(images=[b]), "Match"), [a, b]),
        (rerank_conversation(Content(texts=["short fur"], images=[a]), Content(images=[b]), "Other"), [a, b]),
        (rerank_conversation(Content(texts=["short fur"]), Content(images=[a, b]), "Match"), [a, b]),
        (rerank_conversation(Content(images=[a]), Content(texts=["short fur"], images=[b]), "Match"), [a, b]),
        (embed_conversation(Content(texts=["a cat"], images=[a]), None, "Represent the user's input."), [a]),
        (embed_conversation(Content(texts=["a cat"]), None, "Represent the user's input."), []),
    ]
    for _ in range(2):  # the second round is served from the cache
        for conversation, images in conversations:
            assert tok.render(conversation, images).text == render(processor, conversation, images).text
    assert len(tok._rendered) == len(conversations) - 1  # the first two differ only in which images


def test_token_ids_equal_processor_expansion(processor, make_png, tiny_embedding_dir: Path) -> None:
    """Expanding pads from the package grid gives the ids the processor makes from pixels."""
    from qwen_vl_utils import fetch_image

    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    loaded = load_qwen(tiny_embedding_dir)
    encoder = VisionEncoder(loaded)
    images = [decode_image(make_png(200, 120, 1)), decode_image(make_png(64, 300, 2))]
    content = Content(texts=["two"], images=images)
    prompt = render(processor, embed_conversation(content, "Compare", "x"), images)
    ids = Tokenizer(processor, loaded.image_token_id).ids(prompt, encoder.encode(images))
    resized = [fetch_image({"image": i.image, "min_pixels": 4096, "max_pixels": 1843200}, image_patch_size=16)
               for i in images]
    expected = processor(text=[prompt.text], images=resized, do_resize=False, return_tensors="pt")
    assert ids == expected["input_ids"][0].tolist()


def test_mrope_positions_equal_transformers(tiny_embedding_dir: Path) -> None:
    """Our per-run M-RoPE positions equal Qwen3VLModel.get_rope_index, padding included, rows of one layout
    (computed once) included."""
    import torch

    from rubricsearch.retrieval.qwen.engine.forward import mrope_positions
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    loaded = load_qwen(tiny_embedding_dir)
    img = loaded.image_token_id
    rows = [
        [5, 6, img, img, img, img, 7, 8, img, img, img, img, img, img, 9],
        [1, 2, 3],
        [4, img, img, img, img, img, img, img, img, 3, 3],
        [5, 6, img, img, img, img, 7],  # one layout twice, with grids of as many tokens: positions differ
        [5, 6, img, img, img, img, 7],
        [5, 6, img, img, img, img, 7],
    ]
    grids = [(1, 4, 4), (1, 4, 6), (1, 4, 8), (1, 2, 8), (1, 4, 4), (1, 2, 8)]
    width = max(map(len, rows))
    ids = torch.zeros((len(rows), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for r, row in enumerate(rows):
        ids[r, : len(row)] = torch.tensor(row)
        mask[r, : len(row)] = 1
    ours = mrope_positions(ids, mask, grids, img, 2)
    ref, _ = loaded.model.get_rope_index(ids, mm_token_type_ids=(ids == img).int(),
                                         image_grid_thw=torch.tensor(grids), attention_mask=mask)
    assert torch.equal(ours, ref)
