"""One suite over the backends: local transformers and vLLM (fed our packages, or raw images) agree.

Every backend runs on the checkpoint the vLLM server fixture serves (``server.model_dir``) and is
compared with a separate local backend on a private store: embeddings cos >= 0.999, rerank |Δ| <= 1e-3.
The "local" and "vllm" backends share one PackageStore (vLLM's filled by the vision-only worker), so
whichever runs first makes the packages the other one uses.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.rerank.factory import load_reranker
from rubricsearch.rerank.protocol import Pair
from rubricsearch.rerank.task import TaskReranker
from rubricsearch.retrieval.embedding.factory import load_embedder
from rubricsearch.retrieval.embedding.task import TaskEmbedder
from rubricsearch.retrieval.errors import BackendUnavailable, PackageMismatch
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.inputs import parse_content
from rubricsearch.retrieval.packages import PackageStore, VisualPackage, VisualPackages
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.engine.vision_only import VisionTowerModel, vision_only
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.remote.mm_embeds import image_embeds_part

pytestmark = pytest.mark.vllm
BACKENDS = ["local", "vllm", "vllm-raw"]


@pytest.fixture(scope="module")
def imgs(make_png: Callable[..., bytes]) -> dict[str, bytes]:
    sizes = {"a": (200, 120), "b": (64, 300), "c": (97, 97), "d": (128, 64), "e": (80, 144), "f": (72, 72)}
    return {k: make_png(w, h, 100 + i) for i, (k, (w, h)) in enumerate(sizes.items())}


def embed_cases(i: dict[str, bytes]) -> dict[str, tuple[list[Any], int | None]]:
    a, b, c = i["a"], i["b"], i["c"]
    return {
        "text": ([{"text": "dark forehead stripes"}], None),
        "image": ([{"image": a}], None),
        "image+text": ([{"image": a, "text": "short fur", "instruction": "Find images matching this description"}],
                       None),
        "two-images": ([{"image": [b, c], "text": "two views"}], None),
        "mixed-batch": ([{"text": "a cat", "instruction": "Represent the colour"}, {},
                         {"image": c, "instruction": "Classify the object in this image."}, {"image": a},
                         {"image": [a, b]}, {"text": ["red", " cat"]}, "a plain string"], None),
        "matryoshka-64": ([{"image": a, "text": "stripes"}, {"text": "dog"}], 64),
        "matryoshka-96": ([{"image": [c, b]}, {"text": "cat", "instruction": "Find"}], 96),
    }


def image_count(items: list[Any]) -> int:
    n = 0
    for item in items:
        image = item.get("image") if isinstance(item, dict) else None
        n += len(image) if isinstance(image, list) else int(image is not None)
    return n


# -- embedder ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def embed_shared(vllm_embed_server: Any) -> tuple[VisualPackages, VisionEncoder]:
    return VisualPackages(PackageStore(storage_dtype="float32")), vision_only(vllm_embed_server.model_dir,
                                                                            dtype="float32")


@pytest.fixture(scope="module")
def embed_reference(vllm_embed_server: Any) -> TaskEmbedder:
    return load_embedder(load_qwen(vllm_embed_server.model_dir, dtype="float32"),
                         store=PackageStore(storage_dtype="float32"))


def make_embedder(backend: str, server: Any, packages: VisualPackages, vision: VisionEncoder) -> Any:
    if backend == "local":
        return load_embedder(load_qwen(server.model_dir, dtype="float32"), packages=packages)
    if backend == "vllm":
        return load_embedder(str(server.model_dir), base_url=server.base_url, served_model=server.model,
                             packages=packages, vision=vision)
    return load_embedder(str(server.model_dir), base_url=server.base_url, served_model=server.model)


@pytest.fixture(scope="module", params=BACKENDS)
def embedder(request: pytest.FixtureRequest, vllm_embed_server: Any,
             embed_shared: tuple[VisualPackages, VisionEncoder]) -> Iterator[Any]:
    backend = make_embedder(request.param, vllm_embed_server, *embed_shared)
    backend.kind = request.param
    yield backend
    backend.close()


@pytest.mark.parametrize("case", list(embed_cases({k: b"" for k in "abcdef"})))
def test_embeddings_congruent(embedder: Any, embed_reference: TaskEmbedder, imgs: dict[str, bytes],
                              case: str) -> None:
    items, dims = embed_cases(imgs)[case]
    before = dict(embedder.stats)
    got = embedder.embed(items, dimensions=dims)
    want = embed_reference.embed(items, dimensions=dims)
    assert got.dtype == np.float32 and got.shape == want.shape == (len(items), dims or embedder.dimension)
    assert np.allclose(np.linalg.norm(got, axis=1), 1.0, atol=1e-5)
    cos = (got * want).sum(axis=1)
    print(f"[congruence] embed {embedder.kind:<9} {case:<14} min cos {cos.min():.7f}")
    assert cos.min() >= 0.999, (embedder.kind, case, cos)
    after = embedder.stats
    for key in ("vision_encodes", "package_hits", "package_misses"):
        assert key in after
    if embedder.kind == "vllm":  # every image went as a package: no vision work on the server
        assert after["remote_images_embeds"] - before["remote_images_embeds"] == image_count(items)
        assert after["remote_images_raw"] == before["remote_images_raw"]
        assert after["requests"] == before["requests"] + 1
    elif embedder.kind == "vllm-raw":
        assert after["remote_images_raw"] - before["remote_images_raw"] == image_count(items)
        assert after["remote_images_embeds"] == 0 and after["vision_encodes"] == 0


def test_cached_images_cost_no_vision_anywhere(vllm_embed_server: Any,
                                               embed_shared: tuple[VisualPackages, VisionEncoder],
                                               imgs: dict[str, bytes]) -> None:
    """Second time round: store hits only, no local vision run, every image sent as image_embeds."""
    emb = make_embedder("vllm", vllm_embed_server, *embed_shared)
    items = [{"image": imgs["f"], "instruction": f"Rubric {n}"} for n in range(4)]
    first = emb.embed(items)
    assert emb.stats["vision_encodes"] == 1 and emb.stats["package_misses"] == 1
    assert emb.stats["remote_images_embeds"] == 4
    encodes = emb.stats["vision_encodes"]
    second = emb.embed(items)
    assert emb.stats["vision_encodes"] == encodes
    assert emb.stats["package_hits"] >= 1 and emb.stats["remote_images_embeds"] == 8
    assert emb.stats["remote_images_raw"] == 0
    assert np.abs(first - second).max() <= 1e-6
    emb.close()


def _corrupt(pkg: VisualPackage, kind: str) -> VisualPackage:
    e, d = pkg.embeds.clone(), pkg.deepstack.clone()
    if kind == "nan":
        e[0, 0] = float("nan")
    elif kind == "levels":
        d = torch.cat([d, d[:1]], dim=0)
    elif kind == "width":
        e, d = torch.cat([e, e[:, :1]], dim=1), torch.cat([d, d[:, :, :1]], dim=2)
    return VisualPackage(pkg.image_sha256, pkg.fingerprint, pkg.grid_thw, e, d)


def test_bad_packages_are_refused_and_never_sent(vllm_embed_server: Any, embed_reference: TaskEmbedder,
                                                imgs: dict[str, bytes]) -> None:
    store = PackageStore(storage_dtype="float32")
    worker = vision_only(vllm_embed_server.model_dir, dtype="float32")
    emb = load_embedder(str(vllm_embed_server.model_dir), base_url=vllm_embed_server.base_url,
                        served_model=vllm_embed_server.model, store=store)  # read-only store, no worker
    assert emb.packages.fingerprint == worker.fingerprint and not emb.packages.local  # from the real weights
    keys = ["b", "d", "e"]
    good = worker.encode([decode_image(imgs[k]) for k in keys])
    for pkg, kind in zip(good, ["nan", "levels", "width"], strict=True):
        bad = _corrupt(pkg, kind)
        with pytest.raises(PackageMismatch):
            assert emb.runtime.images.spec is not None
            image_embeds_part(bad.embeds, bad.deepstack, bad.grid_thw, emb.runtime.images.spec)
        store.put(bad)  # the store takes it (shapes agree with the grid); the validator must not
    items = [{"image": imgs["b"]}, {"image": imgs["d"], "text": "x"}, {"image": [imgs["e"], imgs["b"]]}]
    got = emb.embed(items)
    stats = emb.stats
    assert stats["packages_refused"] == 3 and stats["remote_images_embeds"] == 0
    assert stats["remote_images_raw"] == 4
    assert ((got * embed_reference.embed(items)).sum(axis=1)).min() >= 0.999
    assert emb.health()  # the engine is alive: nothing malformed reached it
    assert emb.embed(["still fine"]).shape == (1, emb.dimension)
    emb.close()


def test_message_is_all_packages_or_all_raw(vllm_embed_server: Any, embed_reference: TaskEmbedder,
                                            imgs: dict[str, bytes]) -> None:
    store = PackageStore(storage_dtype="float32")
    for pkg in vision_only(vllm_embed_server.model_dir, dtype="float32").encode([decode_image(imgs["a"])]):
        store.put(pkg)
    emb = load_embedder(str(vllm_embed_server.model_dir), base_url=vllm_embed_server.base_url,
                        served_model=vllm_embed_server.model, store=store)
    items = [{"image": [imgs["a"], imgs["c"]], "text": "one cached, one not"}, {"image": imgs["a"]}]
    got = emb.embed(items)  # vLLM would answer 400 to a message mixing the two forms
    assert emb.stats["remote_images_raw"] == 2 and emb.stats["remote_images_embeds"] == 1
    assert emb.stats["package_hits"] == 1 and emb.stats["package_misses"] == 1
    assert ((got * embed_reference.embed(items)).sum(axis=1)).min() >= 0.999
    emb.close()


def test_local_vision_worker_is_exposed_like_the_local_backend(vllm_embed_server: Any,
                                                              imgs: dict[str, bytes]) -> None:
    """``local_vision=True`` builds the vision-only worker: the model's packages can be made here."""
    server = vllm_embed_server
    emb = load_embedder(str(server.model_dir), base_url=server.base_url, served_model=server.model,
                        local_vision=True, dtype="float32")
    tower = emb.packages.slot.tower if emb.packages.slot is not None else None
    assert emb.packages.local and isinstance(tower, VisionEncoder) and isinstance(tower.loaded.model, VisionTowerModel)
    emb.packages.service.build([decode_image(imgs["e"])])  # as ingestion does, then embed from the package
    emb.embed([{"image": imgs["e"]}])
    assert emb.stats["package_hits"] == 1 and emb.stats["remote_images_embeds"] == 1
    raw = load_embedder(str(server.model_dir), base_url=server.base_url, served_model=server.model)
    assert not raw.packages.local
    emb.close()
    raw.close()


def test_unavailable_server_or_wrong_model(vllm_embed_server: Any, vllm_rerank_server: Any) -> None:
    with pytest.raises(BackendUnavailable, match="not the expected model"):
        load_embedder(str(vllm_embed_server.model_dir), base_url=vllm_embed_server.base_url, served_model="other")
    with pytest.raises(BackendUnavailable, match="not the expected model"):
        load_reranker(str(vllm_rerank_server.model_dir), base_url=vllm_embed_server.base_url,
                      served_model=vllm_rerank_server.model)
    import socket

    with socket.socket() as sock:  # bound, not listening: connections to it are refused
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        with pytest.raises(BackendUnavailable, match="not healthy"):
            load_reranker(str(vllm_rerank_server.model_dir), base_url=url, max_retries=0)


# -- reranker ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def rerank_shared(vllm_rerank_server: Any) -> tuple[VisualPackages, VisionEncoder]:
    return VisualPackages(PackageStore(storage_dtype="float32")), vision_only(vllm_rerank_server.model_dir,
                                                                            dtype="float32")


@pytest.fixture(scope="module")
def rerank_reference(vllm_rerank_server: Any) -> TaskReranker:
    loaded = load_qwen(vllm_rerank_server.model_dir, dtype="float32", lm_rows=("yes", "no"))
    return load_reranker(loaded, store=PackageStore(storage_dtype="float32"))


@pytest.fixture(scope="module", params=BACKENDS)
def reranker(request: pytest.FixtureRequest, vllm_rerank_server: Any,
             rerank_shared: tuple[VisualPackages, VisionEncoder]) -> Iterator[Any]:
    server, (packages, vision) = vllm_rerank_server, rerank_shared
    backend: Any
    if request.param == "local":
        backend = load_reranker(load_qwen(server.model_dir, dtype="float32", lm_rows=("yes", "no")),
                                packages=packages)
    elif request.param == "vllm":
        backend = load_reranker(str(server.model_dir), base_url=server.base_url, served_model=server.model,
                                packages=packages, vision=vision)
    else:
        backend = load_reranker(str(server.model_dir), base_url=server.base_url, served_model=server.model)
    backend.kind = request.param
    yield backend
    backend.close()


def rerank_cases(i: dict[str, bytes]) -> dict[str, tuple[Any, list[Any], str | None]]:
    docs = [{"image": i["b"]}, {"image": i["c"], "text": "tabby cat"}, {"text": "a dog"},
            {"image": [i["b"], i["d"]]}, {}, "plain text"]
    return {
        "text": ("cats", ["a cat", {"text": ["blue dog", " with short fur"]}, {}], None),
        "image+text-query": ({"image": i["a"], "text": "short fur"}, docs, "Retrieve references whose markings match"),
        "text-query-image-docs": ("striped cat", docs, "Find a picture of a cat."),
        "image-query": ({"image": i["e"]}, docs[:2], None),
    }


@pytest.mark.parametrize("case", list(rerank_cases({k: b"" for k in "abcdef"})))
def test_rerank_congruent(reranker: Any, rerank_reference: TaskReranker, imgs: dict[str, bytes], case: str) -> None:
    query, docs, instruction = rerank_cases(imgs)[case]
    before = dict(reranker.stats)
    got = reranker.score(query, docs, instruction)
    want = rerank_reference.score(query, docs, instruction)
    assert len(got) == len(docs)
    delta = float(np.abs(np.array(got) - np.array(want)).max())
    print(f"[congruence] rerank {reranker.kind:<9} {case:<22} max |delta| {delta:.2e}")
    assert delta <= 1e-3, (reranker.kind, case, got, want)
    after = reranker.stats
    if reranker.kind == "vllm":
        assert after["remote_images_raw"] == before["remote_images_raw"]
    elif reranker.kind == "vllm-raw":
        assert after["remote_images_embeds"] == 0


def test_score_pairs_groups_by_query_and_instruction(reranker: Any, rerank_reference: TaskReranker,
                                                     imgs: dict[str, bytes]) -> None:
    """Criteria-style: 2 queries x 3 instructions x 4 documents in one call, in input order."""
    queries = [parse_content({"image": imgs["a"], "text": "stripes"}), parse_content("a red cat")]
    docs = [parse_content(d) for d in ({"image": imgs["c"]}, {"image": imgs["d"], "text": "cat"}, "dog", {})]
    instructions = ["Short fur", "Triangular ears", None]
    pairs = [Pair(q, d, ins) for d in docs for ins in instructions for q in queries]
    before = dict(reranker.stats)
    got = reranker.score_pairs(pairs)
    want = rerank_reference.score_pairs(pairs)
    assert np.abs(np.array(got) - np.array(want)).max() <= 1e-3
    if reranker.kind.startswith("vllm"):
        assert reranker.stats["requests"] - before["requests"] == len(queries) * len(instructions)


def test_rerank_pair_forms_are_never_mixed(vllm_rerank_server: Any, rerank_reference: TaskReranker,
                                          imgs: dict[str, bytes]) -> None:
    """Query cached, one document not: that pair goes raw (vLLM refuses mixed pairs), the others as packages."""
    store = PackageStore(storage_dtype="float32")
    for pkg in vision_only(vllm_rerank_server.model_dir, dtype="float32").encode([decode_image(imgs[k])
                                                                                  for k in ("a", "b")]):
        store.put(pkg)
    rr = load_reranker(str(vllm_rerank_server.model_dir), base_url=vllm_rerank_server.base_url,
                       served_model=vllm_rerank_server.model, store=store)
    query = {"image": imgs["a"], "text": "stripes"}
    docs = [{"image": imgs["b"]}, {"image": imgs["f"], "text": "not cached"}, "text only"]
    got = rr.score(query, docs, "Match the markings")
    want = rerank_reference.score(query, docs, "Match the markings")
    assert np.abs(np.array(got) - np.array(want)).max() <= 1e-3
    stats = rr.stats
    assert stats["requests"] == 2  # one all-packages call, one all-raw call
    assert stats["remote_images_embeds"] == 2  # query + doc b (the text document rides in the same call)
    assert stats["remote_images_raw"] == 2  # query + doc f
    assert rr.health()
    rr.close()


def test_request_byte_budget_splits_requests(vllm_embed_server: Any, vllm_rerank_server: Any,
                                            embed_shared: tuple[VisualPackages, VisionEncoder],
                                            rerank_shared: tuple[VisualPackages, VisionEncoder],
                                            embed_reference: TaskEmbedder, rerank_reference: TaskReranker,
                                            imgs: dict[str, bytes]) -> None:
    """Packages are big (base64 tensors): a body budget splits a call into several, results unchanged."""
    es, rs = vllm_embed_server, vllm_rerank_server
    emb = load_embedder(str(es.model_dir), base_url=es.base_url, served_model=es.model, packages=embed_shared[0],
                        vision=embed_shared[1], max_request_bytes=1)
    items = [{"image": imgs["a"]}, {"image": imgs["b"], "text": "x"}, "text"]
    got = emb.embed(items)
    assert emb.stats["requests"] == 3
    assert ((got * embed_reference.embed(items)).sum(axis=1)).min() >= 0.999
    rr = load_reranker(str(rs.model_dir), base_url=rs.base_url, served_model=rs.model, packages=rerank_shared[0],
                       vision=rerank_shared[1], max_request_bytes=1)
    query, docs = {"image": imgs["a"]}, [{"image": imgs["b"]}, {"image": imgs["c"]}, "dog"]
    scores = rr.score(query, docs, "Match")
    assert rr.stats["requests"] == 3
    assert np.abs(np.array(scores) - np.array(rerank_reference.score(query, docs, "Match"))).max() <= 1e-3
    emb.close()
    rr.close()


def test_servers_still_healthy(vllm_embed_server: Any, vllm_rerank_server: Any) -> None:
    import httpx

    for server in (vllm_embed_server, vllm_rerank_server):
        assert httpx.get(server.base_url + "/health", timeout=5).status_code == 200
