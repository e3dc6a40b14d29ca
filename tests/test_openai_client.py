"""The official ``openai`` client against a real uvicorn server on 127.0.0.1, running the documented examples.

``README_EXAMPLE`` is the exact text of docs/api.md's example (checked), and README.md's shorter example is read from
the README itself; the tests only point them at this server's port and run them in a folder holding ``cat.png``.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from fastapi import FastAPI
from openai import OpenAI

from rubricsearch.app.main import create_app
from tests.api_helpers import SEARCH_KEY, api_settings, serve_in_thread

ROOT = Path(__file__).resolve().parents[1]

README_EXAMPLE = '''\
import base64
from openai import OpenAI

client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key="EMPTY")  # a real key if search requires one
model = "Qwen/Qwen3-VL-Embedding-2B"

# Text, exactly as with OpenAI
texts = client.embeddings.create(model=model, input=["a tabby cat", "a red sports car"])

# Images: put {"image", "text"?, "instruction"?} items in `input` (a data: URL, or
# {"image_id": "<sha256>"} of an image already ingested into a reference set)
with open("cat.png", "rb") as f:
    cat = "data:image/png;base64," + base64.b64encode(f.read()).decode()
images = client.embeddings.create(
    model=model,
    input=[
        {"image": cat},
        {"image": cat, "text": "a cat in the snow", "instruction": "Represent the colours of the image."},
    ],  # type: ignore[arg-type]  # the openai type hints only know strings
    dimensions=128,
)

# Or vLLM's chat form through extra_body (the system message is the instruction)
chat = client.embeddings.create(
    model=model,
    input=[],
    extra_body={"messages": [
        {"role": "system", "content": "Represent the user input."},
        {"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": cat}},
            {"type": "text", "text": "a cat in the snow"},
        ]},
    ]},
)
print(len(texts.data), len(images.data[0].embedding), images.model)
'''


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
           ) -> Iterator[tuple[str, FastAPI]]:
    settings = api_settings(tmp_path_factory.mktemp("uvicorn"), tiny_embedding_dir, tiny_reranker_dir,
                            models={"embedding_model_aliases": ["Qwen/Qwen3-VL-Embedding-2B"]})
    app = create_app(settings)
    with serve_in_thread(app, log_level="info") as url:
        yield f"{url}/v1", app


def test_readme_example(server: tuple[str, FastAPI], tmp_path: Path, make_png, monkeypatch: pytest.MonkeyPatch,
                        capsys: pytest.CaptureFixture[str]) -> None:
    base_url, app = server
    png = make_png(120, 90, 7)
    (tmp_path / "cat.png").write_bytes(png)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    scope: dict[str, Any] = {}
    assert README_EXAMPLE in (ROOT / "docs" / "api.md").read_text(), "docs/api.md must show the tested example"
    exec(README_EXAMPLE.replace("http://127.0.0.1:8000/v1", base_url), scope)

    embedder = app.state.rubricsearch.embedder
    assert scope["texts"].model == embedder.model_id and len(scope["texts"].data) == 2
    got_texts = np.array([d.embedding for d in scope["texts"].data], dtype=np.float32)
    np.testing.assert_allclose(got_texts, embedder.embed(["a tabby cat", "a red sports car"]), atol=1e-6)
    got_images = np.array([d.embedding for d in scope["images"].data], dtype=np.float32)
    direct = embedder.embed([{"image": png}, {"image": png, "text": "a cat in the snow",
                                              "instruction": "Represent the colours of the image."}], 128)
    np.testing.assert_allclose(got_images, direct, atol=1e-6)
    chat = np.array(scope["chat"].data[0].embedding, dtype=np.float32)
    np.testing.assert_allclose(chat, embedder.embed([{"image": png, "text": "a cat in the snow",
                                                      "instruction": "Represent the user input."}])[0], atol=1e-6)
    assert capsys.readouterr().out.strip() == f"2 128 {embedder.model_id}"


def test_readme_short_example(server: tuple[str, FastAPI], tmp_path: Path, make_png,
                              monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    base_url, app = server
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    example = next(block for block in blocks if "from openai import OpenAI" in block)
    png = make_png(120, 90, 5)
    (tmp_path / "cat.png").write_bytes(png)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    scope: dict[str, Any] = {}
    exec(example.replace("http://127.0.0.1:8000/v1", base_url), scope)

    embedder = app.state.rubricsearch.embedder
    got_texts = np.array([d.embedding for d in scope["texts"].data], dtype=np.float32)
    np.testing.assert_allclose(got_texts, embedder.embed(["a tabby cat", "a red sports car"]), atol=1e-6)
    got_images = np.array([d.embedding for d in scope["images"].data], dtype=np.float32)
    direct = embedder.embed([{"image": png}, {"image": png, "text": "a cat in the snow",
                                              "instruction": "Represent the colours."}], 128)
    np.testing.assert_allclose(got_images, direct, atol=1e-6)
    assert capsys.readouterr().out.strip() == "2 128"


def test_float_format_errors_and_keys_not_logged(server: tuple[str, FastAPI], caplog: pytest.LogCaptureFixture,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    import openai

    base_url, _ = server
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    caplog.set_level(logging.INFO)
    client = OpenAI(base_url=base_url, api_key=SEARCH_KEY, max_retries=0)
    floats = client.embeddings.create(model="Qwen/Qwen3-VL-Embedding-2B", input="a", encoding_format="float")
    assert len(floats.data[0].embedding) == 128
    with pytest.raises(openai.NotFoundError) as info:
        client.embeddings.create(model="text-embedding-3-small", input="a")
    assert info.value.body["type"] == "not_found"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError):
        bad = [{"image": "http://127.0.0.1:1/x.png"}]
        client.embeddings.create(model="Qwen/Qwen3-VL-Embedding-2B", input=bad)  # type: ignore[arg-type]
    assert client.models.list().data[0].id == floats.model
    assert "POST /v1/embeddings" in caplog.text  # the access log is captured...
    assert SEARCH_KEY not in caplog.text  # ...and never holds the key
