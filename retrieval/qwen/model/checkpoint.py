"""Offline random-weight Qwen3-VL checkpoints for tests and speed work.

No model hub is reachable in CI, so tests run the real transformers model code on a checkpoint made
here: a real ``Qwen3VLConfig``, a real byte-level BPE tokenizer (built with ``tokenizers``, carrying the
Qwen special tokens and ``yes``/``no`` as single tokens), the Qwen3-VL chat template and a real
``Qwen3VLProcessor``. ``size="2b"`` writes the real 2B architecture with random weights, whose compute
cost equals the real model's.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

Kind = Literal["embedding", "reranker"]
Size = Literal["tiny", "small", "2b"]

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<|object_ref_start|>",
    "<|object_ref_end|>",
    "<|box_start|>",
    "<|box_end|>",
    "<|quad_start|>",
    "<|quad_end|>",
    "<|vision_start|>",
    "<|vision_end|>",
    "<|vision_pad|>",
    "<|image_pad|>",
    "<|video_pad|>",
]

# Qwen2/Qwen3 pre-tokenizer split pattern.
_QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|"
    r"\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Words that become single tokens (with and without a leading space), so prompts tokenize compactly.
_WORDS = [
    "yes",
    "no",
    "system",
    "user",
    "assistant",
    "Represent",
    "the",
    "user's",
    "input",
    "Judge",
    "whether",
    "Document",
    "meets",
    "requirements",
    "based",
    "on",
    "Query",
    "and",
    "Instruct",
    "provided",
    "Note",
    "that",
    "answer",
    "can",
    "only",
    "be",
    "Given",
    "search",
    "query",
    "retrieve",
    "relevant",
    "candidates",
    "which",
    "references",
    "match",
    "this",
    "candidate",
    "image",
    "images",
    "by",
    "short",
    "fur",
    "triangular",
    "ears",
    "dark",
    "forehead",
    "stripes",
    "color",
    "shape",
    "red",
    "green",
    "blue",
    "cat",
    "dog",
    "a",
    "an",
    "of",
    "to",
    "in",
    "is",
    "with",
    "for",
    "NULL",
    "Find",
    "matching",
    "description",
    "Classify",
    "object",
    "photo",
    "picture",
    # A punctuation run that real byte-level vocabularies merge: a text document starting with "(" then
    # tokenizes across the reranker's "<Document>:" boundary, as it can with the real Qwen tokenizer.
    ">:(",
]


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1))
    bs += list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs, strict=True)}


def build_tokenizer_json() -> tuple[str, int]:
    """Return (tokenizer.json text, vocabulary size including special tokens).

    Merges are written out explicitly (no training), so the tokenizer is identical on every machine.
    """
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    byte_map = _bytes_to_unicode()
    vocab: dict[str, int] = {}
    for b in range(256):
        vocab[byte_map[b]] = len(vocab)
    merges: list[tuple[str, str]] = []
    for word in _WORDS:
        for variant in (word, " " + word):
            symbols = [byte_map[b] for b in variant.encode("utf-8")]
            current = symbols[0]
            for sym in symbols[1:]:
                merged = current + sym
                if merged not in vocab:
                    merges.append((current, sym))
                    vocab[merged] = len(vocab)
                current = merged
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, byte_fallback=False, ignore_merges=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(_QWEN_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL_TOKENS)
    return tok.to_str(), tok.get_vocab_size(with_added_tokens=True)


def _config(size: Size, vocab_size: int, token_ids: dict[str, Any], tie: bool) -> object:
    from transformers import Qwen3VLConfig

    if size == "2b":
        text = dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            num_hidden_layers=28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=262144,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [24, 20, 20],
                "mrope_interleaved": True,
            },
        )
        vision = dict(
            depth=24,
            hidden_size=1024,
            intermediate_size=4096,
            num_heads=16,
            out_hidden_size=2048,
            deepstack_visual_indexes=[5, 11, 17],
            num_position_embeddings=2304,
        )
    elif size == "small":  # CPU benchmarks: vision and LM costs in roughly the 2B model's proportion
        text = dict(
            vocab_size=vocab_size,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            max_position_embeddings=32768,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [8, 12, 12],
                "mrope_interleaved": True,
            },
        )
        vision = dict(
            depth=6,
            hidden_size=256,
            intermediate_size=1024,
            num_heads=4,
            out_hidden_size=512,
            deepstack_visual_indexes=[1, 3, 4],
            num_position_embeddings=2304,
        )
    else:
        text = dict(
            vocab_size=vocab_size,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            max_position_embeddings=8192,
            rope_parameters={
                "rope_type": "default",
                "rope_theta": 5_000_000.0,
                "mrope_section": [4, 6, 6],
                "mrope_interleaved": True,
            },
        )
        vision = dict(
            depth=3,
            hidden_size=64,
            intermediate_size=128,
            num_heads=2,
            out_hidden_size=128,
            deepstack_visual_indexes=[0, 1],
            num_position_embeddings=256,
        )
    vision.update(
        patch_size=16, temporal_patch_size=2, spatial_merge_size=2, in_channels=3, hidden_act="gelu_pytorch_tanh"
    )
    # tie_word_embeddings also on text_config: vLLM's yes/no classifier conversion reads it there.
    text.update(
        hidden_act="silu",
        rms_norm_eps=1e-6,
        attention_bias=False,
        pad_token_id=token_ids["<|endoftext|>"],
        tie_word_embeddings=tie,
    )
    return Qwen3VLConfig(
        text_config=text,
        vision_config=vision,
        image_token_id=token_ids["<|image_pad|>"],
        video_token_id=token_ids["<|video_pad|>"],
        vision_start_token_id=token_ids["<|vision_start|>"],
        vision_end_token_id=token_ids["<|vision_end|>"],
        tie_word_embeddings=tie,
        architectures=["Qwen3VLForConditionalGeneration"],
    )


def make_test_model(
    out_dir: str | Path,
    kind: Kind = "embedding",
    *,
    size: Size = "tiny",
    seed: int = 0,
    dtype: str = "float32",
) -> Path:
    """Write a random-weight Qwen3-VL checkpoint that ``from_pretrained`` loads offline.

    The same seed gives the same files. ``kind`` only changes the model card and whether input and
    output embeddings are tied (the reranker keeps its own ``lm_head``, whose yes/no rows it reads).
    """
    import torch
    from transformers import (
        PreTrainedTokenizerFast,
        Qwen2VLImageProcessor,
        Qwen3VLForConditionalGeneration,
        Qwen3VLProcessor,
        Qwen3VLVideoProcessor,
    )

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tok_json, vocab_size = build_tokenizer_json()
    (out / "tokenizer.json").write_text(tok_json)
    template = (Path(__file__).with_name("chat_template.jinja")).read_text()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_file=str(out / "tokenizer.json"),
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=262144,
        clean_up_tokenization_spaces=False,
    )
    token_ids = {t: tokenizer.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS}
    for word in ("yes", "no"):
        assert len(tokenizer.encode(word, add_special_tokens=False)) == 1, word

    image_processor = Qwen2VLImageProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 65536, "longest_edge": 16777216},
    )
    video_processor = Qwen3VLVideoProcessor(
        patch_size=16,
        temporal_patch_size=2,
        merge_size=2,
        image_mean=[0.5, 0.5, 0.5],
        image_std=[0.5, 0.5, 0.5],
        size={"shortest_edge": 4096, "longest_edge": 25165824},
    )
    processor = Qwen3VLProcessor(
        image_processor=image_processor,
        tokenizer=tokenizer,
        video_processor=video_processor,
        chat_template=template,
    )
    processor.save_pretrained(str(out))
    tokenizer.save_pretrained(str(out))
    _patch_tokenizer_config(out, template)

    config = _config(size, vocab_size, token_ids, tie=(kind == "embedding"))
    torch.manual_seed(seed)
    torch_dtype = getattr(torch, dtype)
    device = "cuda" if size == "2b" and torch.cuda.is_available() else "cpu"
    with torch.device(device):
        model = Qwen3VLForConditionalGeneration(config).to(torch_dtype)  # type: ignore[arg-type]
    model.save_pretrained(str(out), safe_serialization=True)
    card = {"rubricsearch_test_model": True, "kind": kind, "size": size, "seed": seed}
    (out / "rubricsearch_test_model.json").write_text(json.dumps(card, indent=2))
    return out


def _patch_tokenizer_config(out: Path, template: str) -> None:
    """Name the Qwen2 tokenizer class and keep the template where every loader looks for it."""
    path = out / "tokenizer_config.json"
    cfg = json.loads(path.read_text()) if path.exists() else {}
    cfg["tokenizer_class"] = "Qwen2Tokenizer"
    cfg["chat_template"] = template
    cfg.setdefault("errors", "replace")
    path.write_text(json.dumps(cfg, indent=2))
    (out / "chat_template.jinja").write_text(template)


def is_test_model(path: str | Path) -> bool:
    """True for checkpoints written by :func:`make_test_model` (the UI shows a banner for them)."""
    return (Path(path) / "rubricsearch_test_model.json").exists()
