"""The sync and async clients: one method per API operation, both built on :class:`app.client.core.Call`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeVar

import httpx

from rubricsearch.app.client.core import FINISHED_STATES, Call, clean, file_part, sha256_file
from rubricsearch.app.schemas.cohere import CohereEmbedResponse
from rubricsearch.app.schemas.embeddings import EmbeddingResponse, ModelList
from rubricsearch.app.schemas.images import ImagePage
from rubricsearch.app.schemas.jobs import JobList, JobOut
from rubricsearch.app.schemas.metadata import ManifestOut
from rubricsearch.app.schemas.packages import PackagesResponse
from rubricsearch.app.schemas.rerank import RerankResponse
from rubricsearch.app.schemas.search import SearchResponse
from rubricsearch.app.schemas.sets import SetList, SetOut

T = TypeVar("T")


class _Calls:
    """Request specs for every operation (no I/O here)."""

    @staticmethod
    def create_set(name: str, description: str | None = None, dimensions: int | None = None) -> Call[SetOut]:
        return Call("POST", "/v1/sets", SetOut,
                    json=clean({"name": name, "description": description, "dimensions": dimensions}))

    @staticmethod
    def list_sets() -> Call[SetList]:
        return Call("GET", "/v1/sets", SetList)

    @staticmethod
    def get_set(set_id: str) -> Call[SetOut]:
        return Call("GET", f"/v1/sets/{set_id}", SetOut)

    @staticmethod
    def delete_set(set_id: str) -> Call[None]:
        return Call("DELETE", f"/v1/sets/{set_id}", None)

    @staticmethod
    def upload(set_id: str, paths: Sequence[str | Path]) -> Call[JobOut]:
        return Call("POST", f"/v1/sets/{set_id}/images", JobOut, files=[file_part(p) for p in paths])

    @staticmethod
    def import_urls(set_id: str, urls: Sequence[str | dict[str, Any]]) -> Call[JobOut]:
        return Call("POST", f"/v1/sets/{set_id}/imports", JobOut, json={"urls": list(urls)})

    @staticmethod
    def apply_manifest(set_id: str, name: str, data: bytes) -> Call[ManifestOut]:
        return Call("POST", f"/v1/sets/{set_id}/manifest", ManifestOut,
                    files=[("file", (name, data, "text/plain"))])

    @staticmethod
    def images(set_id: str, after: int | None = None, limit: int = 1000) -> Call[ImagePage]:
        return Call("GET", f"/v1/sets/{set_id}/images", ImagePage, params=clean({"after": after, "limit": limit}))

    @staticmethod
    def jobs(set_id: str | None = None, limit: int = 50) -> Call[JobList]:
        return Call("GET", "/v1/jobs", JobList, params=clean({"set_id": set_id, "limit": limit}))

    @staticmethod
    def job(job_id: str) -> Call[JobOut]:
        return Call("GET", f"/v1/jobs/{job_id}", JobOut)

    @staticmethod
    def cancel(job_id: str) -> Call[JobOut]:
        return Call("POST", f"/v1/jobs/{job_id}/cancel", JobOut)

    @staticmethod
    def search(set_id: str, **body: Any) -> Call[SearchResponse]:
        return Call("POST", "/v1/search", SearchResponse, json=clean({"set_id": set_id, **body}))

    @staticmethod
    def embeddings(input: Any = None, **body: Any) -> Call[EmbeddingResponse]:
        return Call("POST", "/v1/embeddings", EmbeddingResponse, json=clean({"input": input, **body}))

    @staticmethod
    def embed(model: str, **body: Any) -> Call[CohereEmbedResponse]:
        return Call("POST", "/v2/embed", CohereEmbedResponse, json=clean({"model": model, **body}))

    @staticmethod
    def rerank(query: Any, documents: Sequence[Any], **body: Any) -> Call[RerankResponse]:
        return Call("POST", "/v1/rerank", RerankResponse,
                    json=clean({"query": query, "documents": list(documents), **body}))

    @staticmethod
    def packages(images: Sequence[Any], model: str | None = None, dtype: str = "auto") -> Call[PackagesResponse]:
        return Call("POST", "/v1/visual-packages", PackagesResponse,
                    json=clean({"images": list(images), "model": model, "dtype": dtype}))

    @staticmethod
    def models() -> Call[ModelList]:
        return Call("GET", "/v1/models", ModelList)


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _bar(total: int, progress: bool) -> Any:
    if not progress:
        return None
    from tqdm import tqdm

    return tqdm(total=total, unit="img", desc="ingest")


def _tick(bar: Any, job: JobOut) -> None:
    if bar is not None:
        bar.total = job.total
        bar.n = job.done + job.failed + job.skipped
        bar.refresh()


class Client:
    """Sync client: ``Client("http://127.0.0.1:8000", api_key=...)``; every call raises the server's errors."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 300.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.http = httpx.Client(base_url=base_url, headers=_headers(api_key), timeout=timeout, transport=transport)

    def __enter__(self) -> Client:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.http.close()

    def send(self, call: Call[T]) -> T:
        return call.read(self.http.request(call.method, call.path, **call.request_kwargs()))

    def create_set(self, name: str, description: str | None = None, dimensions: int | None = None) -> SetOut:
        return self.send(_Calls.create_set(name, description, dimensions))

    def list_sets(self) -> SetList:
        return self.send(_Calls.list_sets())

    def get_set(self, set_id: str) -> SetOut:
        return self.send(_Calls.get_set(set_id))

    def delete_set(self, set_id: str) -> None:
        return self.send(_Calls.delete_set(set_id))

    def upload(self, set_id: str, paths: Sequence[str | Path]) -> JobOut:
        return self.send(_Calls.upload(set_id, paths))

    def import_urls(self, set_id: str, urls: Sequence[str | dict[str, Any]]) -> JobOut:
        return self.send(_Calls.import_urls(set_id, urls))

    def apply_manifest(self, set_id: str, name: str, data: bytes) -> ManifestOut:
        """A ``manifest.csv`` / ``manifest.jsonl`` (``name`` says which) for images already in the set."""
        return self.send(_Calls.apply_manifest(set_id, name, data))

    def images(self, set_id: str, after: int | None = None, limit: int = 1000) -> ImagePage:
        return self.send(_Calls.images(set_id, after, limit))

    def jobs(self, set_id: str | None = None, limit: int = 50) -> JobList:
        return self.send(_Calls.jobs(set_id, limit))

    def job(self, job_id: str) -> JobOut:
        return self.send(_Calls.job(job_id))

    def cancel(self, job_id: str) -> JobOut:
        return self.send(_Calls.cancel(job_id))

    def search(self, set_id: str, **body: Any) -> SearchResponse:
        return self.send(_Calls.search(set_id, **body))

    def embeddings(self, input: Any = None, **body: Any) -> EmbeddingResponse:
        return self.send(_Calls.embeddings(input, **body))

    def embed(self, model: str, **body: Any) -> CohereEmbedResponse:
        return self.send(_Calls.embed(model, **body))

    def rerank(self, query: Any, documents: Sequence[Any], **body: Any) -> RerankResponse:
        return self.send(_Calls.rerank(query, documents, **body))

    def packages(self, images: Sequence[Any], model: str | None = None, dtype: str = "auto") -> PackagesResponse:
        return self.send(_Calls.packages(images, model, dtype))

    def models(self) -> ModelList:
        return self.send(_Calls.models())

    def wait(self, job_id: str, *, progress: bool = False, poll_s: float = 0.5, timeout_s: float = 3600) -> JobOut:
        """Poll a job until it finishes (a tqdm bar when ``progress``)."""
        deadline = time.monotonic() + timeout_s
        job: JobOut = self.job(job_id)
        bar = _bar(job.total, progress)
        try:
            while job.state not in FINISHED_STATES and time.monotonic() < deadline:
                _tick(bar, job)
                time.sleep(poll_s)
                job = self.job(job_id)
            _tick(bar, job)
            return job
        finally:
            if bar is not None:
                bar.close()

    def ingest(self, set_id: str, paths: Sequence[str | Path], *, resume: bool = True, progress: bool = False,
               batch: int = 64) -> list[JobOut]:
        """Upload files in batches and wait for each job; ``resume`` skips files the set already holds (by
        sha256), so an interrupted ingestion continues where it stopped. Each zip goes in a request of its own,
        where the manifest at its root applies."""
        todo = [Path(p) for p in paths]
        if resume:
            have = self.shas(set_id)
            todo = [p for p in todo if p.suffix.lower() == ".zip" or sha256_file(p) not in have]
        zips = [[p] for p in todo if p.suffix.lower() == ".zip"]
        files = [p for p in todo if p.suffix.lower() != ".zip"]
        requests = zips + [files[i:i + batch] for i in range(0, len(files), batch)]
        return [self.wait(self.upload(set_id, part).id, progress=progress) for part in requests]

    def shas(self, set_id: str) -> set[str]:
        out: set[str] = set()
        after: int | None = None
        while True:
            page = self.images(set_id, after)
            out.update(i.sha256 for i in page.data)
            if page.next_after is None:
                return out
            after = page.next_after


class AsyncClient:
    """Async twin of :class:`Client` (``await client.search(...)``)."""

    def __init__(self, base_url: str, api_key: str | None = None, *, timeout: float = 300.0,
                 transport: httpx.AsyncBaseTransport | None = None) -> None:
        self.http = httpx.AsyncClient(base_url=base_url, headers=_headers(api_key), timeout=timeout,
                                      transport=transport)

    async def __aenter__(self) -> AsyncClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.http.aclose()

    async def send(self, call: Call[T]) -> T:
        return call.read(await self.http.request(call.method, call.path, **call.request_kwargs()))

    async def create_set(self, name: str, description: str | None = None,
                         dimensions: int | None = None) -> SetOut:
        return await self.send(_Calls.create_set(name, description, dimensions))

    async def list_sets(self) -> SetList:
        return await self.send(_Calls.list_sets())

    async def get_set(self, set_id: str) -> SetOut:
        return await self.send(_Calls.get_set(set_id))

    async def delete_set(self, set_id: str) -> None:
        return await self.send(_Calls.delete_set(set_id))

    async def upload(self, set_id: str, paths: Sequence[str | Path]) -> JobOut:
        return await self.send(_Calls.upload(set_id, paths))

    async def import_urls(self, set_id: str, urls: Sequence[str | dict[str, Any]]) -> JobOut:
        return await self.send(_Calls.import_urls(set_id, urls))

    async def apply_manifest(self, set_id: str, name: str, data: bytes) -> ManifestOut:
        return await self.send(_Calls.apply_manifest(set_id, name, data))

    async def images(self, set_id: str, after: int | None = None, limit: int = 1000) -> ImagePage:
        return await self.send(_Calls.images(set_id, after, limit))

    async def jobs(self, set_id: str | None = None, limit: int = 50) -> JobList:
        return await self.send(_Calls.jobs(set_id, limit))

    async def job(self, job_id: str) -> JobOut:
        return await self.send(_Calls.job(job_id))

    async def cancel(self, job_id: str) -> JobOut:
        return await self.send(_Calls.cancel(job_id))

    async def search(self, set_id: str, **body: Any) -> SearchResponse:
        return await self.send(_Calls.search(set_id, **body))

    async def embeddings(self, input: Any = None, **body: Any) -> EmbeddingResponse:
        return await self.send(_Calls.embeddings(input, **body))

    async def embed(self, model: str, **body: Any) -> CohereEmbedResponse:
        return await self.send(_Calls.embed(model, **body))

    async def rerank(self, query: Any, documents: Sequence[Any], **body: Any) -> RerankResponse:
        return await self.send(_Calls.rerank(query, documents, **body))

    async def packages(self, images: Sequence[Any], model: str | None = None, dtype: str = "auto") -> PackagesResponse:
        return await self.send(_Calls.packages(images, model, dtype))

    async def models(self) -> ModelList:
        return await self.send(_Calls.models())

    async def wait(self, job_id: str, *, poll_s: float = 0.5, timeout_s: float = 3600) -> JobOut:
        deadline = time.monotonic() + timeout_s
        job: JobOut = await self.job(job_id)
        while job.state not in FINISHED_STATES and time.monotonic() < deadline:
            await asyncio.sleep(poll_s)
            job = await self.job(job_id)
        return job

