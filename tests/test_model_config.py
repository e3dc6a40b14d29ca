"""Typed model configuration: each flat option belongs to exactly one group, the settings reach their groups
through one function, and ``preprocess`` reaches every tower through the vision group alone."""

from __future__ import annotations

from dataclasses import fields
from pathlib import Path
from typing import get_type_hints

import pytest

from rubricsearch.app.model_loading import model_config
from rubricsearch.app.settings import Settings
from rubricsearch.retrieval.runtime.config import (
    InputLimits,
    LocalConfig,
    ModelConfig,
    ModelOptions,
    VisionConfig,
    VLLMConfig,
    configure,
)

GROUPS = (VisionConfig, InputLimits, LocalConfig, VLLMConfig)


def test_every_option_is_a_field_of_a_group() -> None:
    options = set(get_type_hints(ModelOptions))
    named = {f.name for g in GROUPS for f in fields(g)} | {"max_length", "default_instruction"}
    assert options == named
    shared = {f.name for f in fields(LocalConfig)} & {f.name for f in fields(VLLMConfig)}
    assert shared == {"device", "dtype"}  # the vLLM runtime keys its packages as a local one would make them


def test_options_land_in_their_group() -> None:
    local = configure(None, {"device": "cpu", "max_pixels": 128 * 128, "share_prefix": False, "max_length": 99,
                             "image_max_bytes": 1000})
    assert local.vllm is None and local.local.device == "cpu" and not local.local.share_prefix
    assert local.vision.max_pixels == 128 * 128 and local.inputs.image_max_bytes == 1000 and local.max_length == 99
    remote = configure(None, {"base_url": "http://x", "device": "cpu", "dtype": "float32", "package_keys": False})
    assert remote.vllm == VLLMConfig(base_url="http://x", device="cpu", dtype="float32", package_keys=False)
    assert remote.local == LocalConfig()  # device and dtype went to the vLLM group only
    kept = configure(remote, {"max_retries": 0})
    assert kept.vllm is not None and kept.vllm.base_url == "http://x" and kept.vllm.max_retries == 0
    with pytest.raises(TypeError, match="unknown model options"):
        configure(None, {"batchsize": 3})  # type: ignore[typeddict-unknown-key]


@pytest.mark.parametrize("kind", ["embedding", "reranker"])
def test_settings_reach_one_group_each(tmp_path: Path, kind: str) -> None:
    settings = Settings(data_dir=tmp_path,
                        models={"preprocess": "gpu-nvjpeg", "max_pixels": 65536, "engine": "local"},
                        limits={"decode_pixel_budget": 1_234_567},
                        vllm={"embedding_url": "http://e", "reranker_url": "http://r"})
    local = model_config(settings, kind, "local")  # type: ignore[arg-type]
    remote = model_config(settings, kind, "vllm")  # type: ignore[arg-type]
    for config in (local, remote):
        assert config.vision == VisionConfig(min_pixels=4096, max_pixels=65536, preprocess="gpu-nvjpeg")
        assert (config.inputs.image_max_bytes, config.inputs.image_max_pixels) == (settings.image_bytes, 1_234_567)
    assert local.vllm is None and local.local.cuda_graphs and local.local.engine == "local"
    # rows per pass and LM workers are the runtime's by device (the Python API's options set them for a bench)
    assert local.local.batch_size is None and local.local.lm_workers is None
    assert local.local.bulk_graphs == (kind == "embedding")  # bulk graphs serve ingestion, the embedder's
    assert remote.vllm is not None and remote.vllm.base_url == ("http://e" if kind == "embedding" else "http://r")
    assert remote.vllm.local_vision and remote.vllm.package_keys  # sent only where the start-up probe allows
    assert remote.local == ModelConfig().local  # nothing of the local group reaches a vLLM model


def test_a_model_runs_on_vllm_where_its_url_is_set(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The backends follow the URLs (the old variables are ignored with a warning, and cannot contradict them)."""
    settings = Settings(_env_file=None, data_dir=tmp_path, vllm={"reranker_url": "http://r"})
    assert (settings.backend("embedding"), settings.backend("reranker")) == ("local", "vllm")
    assert settings.vector_backend() == "faiss"  # likewise the vectors: Qdrant only where its URL is set
    assert Settings(_env_file=None, vectors={"qdrant_url": "http://q:6333"}).vector_backend() == "qdrant"
    remote = model_config(settings, "reranker", settings.backend("reranker"))
    assert remote.vllm is not None and remote.vllm.base_url == "http://r"
    monkeypatch.setenv("RUBRICSEARCH_MODELS__EMBEDDING_BACKEND", "vllm")
    with pytest.warns(DeprecationWarning, match="RUBRICSEARCH_MODELS__EMBEDDING_BACKEND is ignored"):
        assert Settings(_env_file=None, data_dir=tmp_path).backend("embedding") == "local"
