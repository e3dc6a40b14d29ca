"""The typed client (``app.client``) against a real uvicorn server on 127.0.0.1: every operation, resume,
and the server's error envelope raised as the server's own domain errors."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from rubricsearch.app.client import AsyncClient, Client
from rubricsearch.app.main import create_app
from rubricsearch.retrieval.errors import InvalidInput, NotFound, Unauthorized
from tests.api_helpers import ADMIN_KEY, api_settings, data_url, serve_in_thread

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
         ) -> Iterator[str]:
    app = create_app(api_settings(tmp_path_factory.mktemp("client"), tiny_embedding_dir, tiny_reranker_dir,
                                  ingest={"workers": 1}, auth={"search_requires_key": True}))
    with serve_in_thread(app) as url:
        yield url


def test_ingest_resume_search_and_models(base: str, tmp_path: Path, make_png) -> None:
    files = []
    for i in range(3):
        (tmp_path / f"{i}.png").write_bytes(make_png(64, 48 + 8 * i, 60 + i))
        files.append(tmp_path / f"{i}.png")
    with Client(base, api_key=ADMIN_KEY) as client:
        ref = client.create_set("client-refs")
        jobs = client.ingest(ref.id, files[:2], progress=True)
        assert [j.state for j in jobs] == ["succeeded"] and jobs[0].done == 2
        resumed = client.ingest(ref.id, files)  # only the file the set lacks is sent
        assert len(resumed) == 1 and resumed[0].total == 1 and resumed[0].done == 1
        assert client.ingest(ref.id, files) == []
        assert len(client.shas(ref.id)) == 3
        hits = client.search(ref.id, criteria=["short fur"], image=data_url(files[0].read_bytes()), top_n=3)
        assert len(hits.hits) == 3
        models = client.models()
        assert [m.kind for m in models.data] == ["embedding", "reranker"]
        emb = client.embeddings(["a", "b"], dimensions=64)
        cohere = client.embed(models.data[0].id, texts=["a", "b"], output_dimension=64)
        np.testing.assert_allclose([d.embedding for d in emb.data], cohere.embeddings.float_, atol=1e-6)
        part = {"type": "image_url", "image_url": {"url": data_url(files[1].read_bytes())}}
        ranked = client.rerank("a cat", ["a cat", {"content": [part]}])
        assert sorted(r.index for r in ranked.results) == [0, 1]
        pkgs = client.packages([{"image_id": sorted(client.shas(ref.id))[0]}])
        assert pkgs.data[0].cached is True  # ingestion made it


def test_errors_are_the_servers_types(base: str) -> None:
    with Client(base) as anonymous:
        with pytest.raises(Unauthorized) as info:
            anonymous.models()
        assert info.value.status == 401
    with Client(base, api_key=ADMIN_KEY) as client:
        with pytest.raises(NotFound):
            client.get_set("no-such-set")
        with pytest.raises(InvalidInput) as bad:
            client.embed("my-embedder", texts=["a"], truncate="START")
        assert bad.value.status == 400 and "START" in bad.value.message


def test_async_client(base: str) -> None:
    async def run() -> tuple[int, str]:
        async with AsyncClient(base, api_key=ADMIN_KEY) as client:
            emb, models = await asyncio.gather(client.embeddings("a"), client.models())
            try:
                await client.get_set("nope")
            except NotFound as exc:
                return len(emb.data[0].embedding), type(exc).__name__ + models.data[0].kind
        return 0, ""

    assert asyncio.run(run()) == (128, "NotFoundembedding")
