"""The committed OpenAPI document matches the app (regenerate with ``UPDATE_SNAPSHOTS=1``).

A change to a request or response shape shows up in review as a diff of ``tests/openapi.json``.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest

from rubricsearch.app.main import create_app
from rubricsearch.app.settings import Settings

SNAPSHOT = Path(__file__).with_name("openapi.json")


@pytest.fixture(scope="module")
def document(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    app = create_app(Settings(_env_file=None, data_dir=tmp_path_factory.mktemp("openapi")))
    return app.openapi()


def test_openapi_matches_snapshot(document: dict[str, Any]) -> None:
    text = json.dumps(document, indent=2, sort_keys=True) + "\n"
    if os.environ.get("UPDATE_SNAPSHOTS") == "1":
        SNAPSHOT.write_text(text)
    assert SNAPSHOT.exists(), "no snapshot yet: run with UPDATE_SNAPSHOTS=1"
    assert text == SNAPSHOT.read_text(), "OpenAPI changed: review, then rerun with UPDATE_SNAPSHOTS=1"


def test_multimodal_inputs_are_documented_with_examples(document: dict[str, Any]) -> None:
    for path, names in {"/v1/embeddings": {"image_data_url", "ingested_image", "vllm_messages"},
                        "/v1/rerank": {"image_query", "vllm_content"}}.items():
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]
        assert names <= set(body["examples"])
    schemas = document["components"]["schemas"]
    for name in ("EmbeddingItem", "ImageId", "ChatMessage", "RerankItem", "ImageUrlPart", "ImageIdPart"):
        assert name in schemas
    assert schemas["EmbeddingItem"]["examples"] and schemas["RerankItem"]["examples"]


def test_errors_use_the_envelope(document: dict[str, Any]) -> None:
    assert "HTTPValidationError" not in document["components"]["schemas"]
    for path, methods in document["paths"].items():
        for method, operation in methods.items():
            for status, response in operation["responses"].items():
                if status.startswith(("4", "5")):
                    ref = response["content"]["application/json"]["schema"]["$ref"]
                    assert ref.endswith("/ErrorResponse"), (method, path, status)
