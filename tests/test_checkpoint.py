"""The offline test checkpoint is a real, deterministic Qwen3-VL checkpoint."""

from __future__ import annotations

import hashlib
from pathlib import Path

from rubricsearch.retrieval.qwen.model.checkpoint import SPECIAL_TOKENS, is_test_model, make_test_model


def _digest(path: Path) -> dict[str, str]:
    return {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(path.iterdir()) if p.is_file()}


def test_same_seed_same_files(tmp_path: Path, tiny_embedding_dir: Path) -> None:
    again = make_test_model(tmp_path / "again", "embedding", seed=0)
    assert _digest(again) == _digest(tiny_embedding_dir)
    other = make_test_model(tmp_path / "other", "embedding", seed=1)
    assert _digest(other)["model.safetensors"] != _digest(tiny_embedding_dir)["model.safetensors"]


def test_loads_offline_with_real_classes(tiny_embedding_dir: Path, monkeypatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import AutoProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration, Qwen3VLProcessor

    processor = AutoProcessor.from_pretrained(tiny_embedding_dir)
    assert isinstance(processor, Qwen3VLProcessor)
    config = Qwen3VLConfig.from_pretrained(tiny_embedding_dir)
    assert config.text_config.head_dim == 32
    assert len(config.vision_config.deepstack_visual_indexes) >= 2
    assert sum(config.text_config.rope_parameters["mrope_section"]) == config.text_config.head_dim // 2
    model = Qwen3VLForConditionalGeneration.from_pretrained(tiny_embedding_dir)
    assert model.config.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    vocab = processor.tokenizer.get_vocab()
    for token in SPECIAL_TOKENS:
        assert token in vocab
        assert processor.tokenizer.encode(token, add_special_tokens=False) == [vocab[token]]
    for word in ("yes", "no"):
        assert processor.tokenizer.encode(word, add_special_tokens=False) == [vocab[word]]
    assert is_test_model(tiny_embedding_dir)


def test_cli_writes_checkpoint(tmp_path: Path) -> None:
    from rubricsearch.app.cli import main

    assert main(["make-test-model", str(tmp_path / "ck"), "--kind", "reranker", "--seed", "3"]) == 0
    assert (tmp_path / "ck" / "model.safetensors").exists()
    assert (tmp_path / "ck" / "tokenizer.json").exists()
