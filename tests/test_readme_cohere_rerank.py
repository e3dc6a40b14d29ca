"""README's ``cohere`` v2 rerank example, read from README.md and run against a real uvicorn server on 127.0.0.1.

``co.rerank`` posts to ``/v2/rerank``; its scores must be the ones ``/v1/rerank`` gives for the same query and
documents.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from rubricsearch.app.main import create_app
from tests.api_helpers import api_settings, serve_in_thread

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
           ) -> Iterator[tuple[str, FastAPI]]:
    settings = api_settings(tmp_path_factory.mktemp("cohere-rerank"), tiny_embedding_dir, tiny_reranker_dir,
                            models={"reranker_model_aliases": ["Qwen/Qwen3-VL-Reranker-2B"]},
                            auth={"search_api_keys": []})
    app = create_app(settings)
    with serve_in_thread(app) as url:
        yield url, app


def test_readme_cohere_rerank_example(server: tuple[str, FastAPI], monkeypatch: pytest.MonkeyPatch,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    url, _ = server
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), flags=re.S)
    example = next(block for block in blocks if "co.rerank(" in block)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1")
    scope: dict[str, Any] = {}
    exec(example.replace("http://127.0.0.1:8000", url), scope)

    v1 = httpx.post(f"{url}/v1/rerank", json={"query": "a cat with dark forehead stripes",
                                              "documents": ["a tabby cat", "a red sports car"]}).json()
    best = v1["results"][0]
    got = scope["res"].results
    assert len(got) == 1 and got[0].index == best["index"]
    assert got[0].relevance_score == pytest.approx(best["relevance_score"], abs=1e-6)
    assert capsys.readouterr().out.split()[0] == str(best["index"])
