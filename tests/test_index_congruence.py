"""One suite for every vector index backend: FAISS in a temp dir (the default, its plain reference alone, and the
device search path, run by torch on the CPU here), Qdrant in local mode.

Each backend is checked against a brute-force numpy reference (so the two must agree with each
other), and one test drives both side by side through the same mixed sequence of writes.
"""

from __future__ import annotations

import hashlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import cast

import numpy as np
import pytest

from rubricsearch.indexer.catalog import ImageRecord
from rubricsearch.indexer.jobs.reconcile import _repair_payloads, payload_digest
from rubricsearch.retrieval.errors import BackendUnavailable, Conflict, InvalidInput, NotFound
from rubricsearch.retrieval.index import VectorIndex, make_index
from rubricsearch.retrieval.index.faiss_index import FaissIndex
from rubricsearch.retrieval.index.qdrant_index import QdrantIndex, point_id

BACKENDS = ["faiss", "faiss-reference", "faiss-device", "faiss-device-fp8", "qdrant"]
DIM = 24


def sha(i: int | str) -> str:
    return hashlib.sha256(str(i).encode()).hexdigest()


def unit(rng: np.random.Generator, n: int, dim: int = DIM) -> np.ndarray:
    x = rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def exact(store: dict[str, np.ndarray], query: np.ndarray, k: int) -> list[tuple[str, float]]:
    ids = list(store)
    scores = np.stack([store[i] for i in ids]) @ query
    order = np.argsort(-scores)[:k]
    return [(ids[j], float(scores[j])) for j in order]


def assert_hits(got, want, tol: float = 1e-5) -> None:
    assert [h.id for h in got] == [i for i, _ in want]
    np.testing.assert_allclose([h.score for h in got], [s for _, s in want], atol=tol)


Opener = Callable[[], VectorIndex]


def opener(backend: str, root: Path, **options) -> Opener:
    if backend == "faiss":
        return lambda: make_index("faiss", path=root / "faiss", **options)
    if backend == "faiss-reference":  # the plain index the default one layers its filtered and device search on
        return lambda: make_index("faiss-reference", path=root / "faiss", **options)
    if backend == "faiss-device":  # the accelerator path (exact half-precision pass + float32 re-score)
        return lambda: make_index("faiss", path=root / "faiss", device_search="torch", search_device="cpu",
                                  **options)
    if backend == "faiss-device-fp8":  # the same with the float8 copy a Hopper GPU gets by default
        return lambda: make_index("faiss", path=root / "faiss", device_search="torch", search_device="cpu",
                                  device_precision="float8", **options)
    return lambda: make_index("qdrant", path=str(root / "qdrant"), **options)


@pytest.fixture(params=BACKENDS)
def reopen(request, tmp_path: Path) -> Iterator[Opener]:
    """A function that opens the backend on the same storage (to test reloads)."""
    yield opener(request.param, tmp_path)


@pytest.fixture
def index(reopen: Opener) -> Iterator[VectorIndex]:
    idx = reopen()
    yield idx
    idx.close()


def test_implements_protocol(index: VectorIndex) -> None:
    assert isinstance(index, VectorIndex)
    assert index.health()


def test_exact_search_matches_numpy(index: VectorIndex) -> None:
    rng = np.random.default_rng(1)
    vecs = unit(rng, 400)
    ids = [sha(i) for i in range(400)]
    index.create_set("refs", DIM)
    index.upsert("refs", ids, vecs)
    store = dict(zip(ids, vecs, strict=True))
    queries = unit(rng, 6)
    results = index.search("refs", queries, 10)
    assert len(results) == 6
    for q, got in zip(queries, results, strict=True):
        assert_hits(got, exact(store, q, 10))
    single = index.search("refs", queries[0], 3)  # a 1-D query is one row
    assert_hits(single[0], exact(store, queries[0], 3))
    assert index.count("refs") == 400
    assert index.ids("refs") == set(ids)
    stored = index.vectors("refs", [ids[3], sha("absent"), ids[0], ids[3]])
    assert set(stored) == {ids[0], ids[3]}
    np.testing.assert_allclose(stored[ids[3]], vecs[3], atol=1e-6)
    assert stored[ids[0]].dtype == np.float32 and stored[ids[0]].shape == (DIM,)


def test_backends_agree_through_mixed_writes(tmp_path: Path) -> None:
    faiss_idx = make_index("faiss", path=tmp_path / "f", ann_threshold=10_000)
    qdrant_idx = make_index("qdrant", path=":memory:", batch_size=64)
    rng = np.random.default_rng(2)
    pool = [sha(i) for i in range(300)]
    try:
        for idx in (faiss_idx, qdrant_idx):
            idx.create_set("s", DIM)
        for step in range(8):
            upserts = list(rng.choice(pool, size=60, replace=False))
            vecs = unit(rng, 60)
            deletes = list(rng.choice(pool, size=25, replace=False))
            queries = unit(rng, 3)
            outcomes = []
            for idx in (faiss_idx, qdrant_idx):
                idx.upsert("s", upserts, vecs)
                idx.delete("s", deletes)
                outcomes.append((idx.count("s"), idx.ids("s"), idx.search("s", queries, 7), idx.matching("s", pool)))
            (fc, fids, fhits, fin), (qc, qids, qhits, qin) = outcomes
            assert fc == qc == len(fids), step
            assert fids == qids == fin == qin
            for a, b in zip(fhits, qhits, strict=True):
                assert [h.id for h in a] == [h.id for h in b]
                np.testing.assert_allclose([h.score for h in a], [h.score for h in b], atol=1e-5)
    finally:
        faiss_idx.close()
        qdrant_idx.close()


def test_upsert_is_idempotent_and_replaces(index: VectorIndex) -> None:
    rng = np.random.default_rng(3)
    vecs = unit(rng, 50)
    ids = [sha(i) for i in range(50)]
    index.create_set("s", DIM)
    index.upsert("s", ids, vecs)
    index.upsert("s", ids, vecs)
    index.upsert("s", [i.upper() for i in ids[:5]], vecs[:5])  # upper-case hex is the same id
    assert index.count("s") == 50
    moved = unit(rng, 1)[0]
    index.upsert("s", [ids[7]], moved[None, :])
    assert index.count("s") == 50
    top = index.search("s", moved, 1)[0][0]
    assert top.id == ids[7] and top.score == pytest.approx(1.0, abs=1e-5)
    # a repeated id inside one batch keeps its last vector, as two upserts in a row would
    index.upsert("s", [ids[8], ids[8]], np.stack([vecs[0], moved]))
    assert index.count("s") == 50
    assert {h.id for h in index.search("s", moved, 2)[0]} == {ids[7], ids[8]}


def test_deleted_ids_never_return(index: VectorIndex) -> None:
    rng = np.random.default_rng(4)
    vecs = unit(rng, 120)
    ids = [sha(i) for i in range(120)]
    index.create_set("s", DIM)
    index.upsert("s", ids, vecs)
    gone = set(ids[::3])
    index.delete("s", list(gone))
    index.delete("s", [*gone, sha("never-added")])  # repeated and unknown ids are ignored
    assert index.count("s") == 80
    assert index.ids("s") == set(ids) - gone
    hits = index.search("s", vecs, 120)
    assert all(h.id not in gone for row in hits for h in row)
    assert all(len(row) == 80 for row in hits)
    index.upsert("s", [ids[0]], vecs[:1])  # a deleted id can come back
    assert index.search("s", vecs[0], 1)[0][0].id == ids[0]
    assert index.count("s") == 81


def test_reload_keeps_everything(reopen: Opener) -> None:
    rng = np.random.default_rng(5)
    vecs = unit(rng, 90)
    ids = [sha(i) for i in range(90)]
    idx = reopen()
    idx.create_set("a", DIM)
    idx.create_set("empty", 8)
    idx.upsert("a", ids, vecs)
    idx.delete("a", ids[:10])
    before = idx.search("a", vecs[10:13], 5)
    idx.close()
    idx = reopen()
    try:
        assert idx.list_sets() == {"a": DIM, "empty": 8}
        assert idx.count("a") == 80 and idx.count("empty") == 0
        assert idx.ids("a") == set(ids[10:])
        after = idx.search("a", vecs[10:13], 5)
        assert [[h.id for h in r] for r in after] == [[h.id for h in r] for r in before]
    finally:
        idx.close()


def test_input_validation(index: VectorIndex) -> None:
    rng = np.random.default_rng(6)
    index.create_set("s", DIM)
    good = unit(rng, 2)
    ids = [sha(1), sha(2)]
    with pytest.raises(InvalidInput, match="dimension 25"):
        index.upsert("s", ids, unit(rng, 2, DIM + 1))
    with pytest.raises(InvalidInput, match="dimension"):
        index.search("s", unit(rng, 1, DIM - 1), 3)
    for bad_value in (np.nan, np.inf):
        bad = good.copy()
        bad[1, 3] = bad_value
        with pytest.raises(InvalidInput, match="NaN or infinite"):
            index.upsert("s", ids, bad)
        with pytest.raises(InvalidInput, match="NaN or infinite"):
            index.search("s", bad, 3)
    with pytest.raises(InvalidInput, match="L2-normalised"):
        index.upsert("s", ids, good * 2)
    with pytest.raises(InvalidInput, match="2 ids but 1 vectors"):
        index.upsert("s", ids, good[:1])
    with pytest.raises(InvalidInput, match="sha256"):
        index.upsert("s", ["not-a-sha", sha(2)], good)
    with pytest.raises(InvalidInput, match="sha256"):
        index.matching("s", [sha(2), "not-a-sha"])
    with pytest.raises(InvalidInput, match="k"):
        index.search("s", good[0], 0)
    with pytest.raises(InvalidInput, match="set id"):
        index.create_set("../escape", DIM)
    with pytest.raises(InvalidInput, match="dimension"):
        index.create_set("zero", 0)
    with pytest.raises(Conflict):
        index.create_set("s", DIM * 2)
    index.create_set("s", DIM)  # same dimension: a no-op
    assert index.count("s") == 0  # nothing above was half-written


def test_unknown_set_is_not_found(index: VectorIndex) -> None:
    vec = unit(np.random.default_rng(7), 1)
    assert not index.has_set("nope")
    calls = [
        lambda: index.upsert("nope", [sha(1)], vec),
        lambda: index.delete("nope", [sha(1)]),
        lambda: index.count("nope"),
        lambda: index.ids("nope"),
        lambda: index.vectors("nope", [sha(1)]),
        lambda: index.matching("nope", []),
        lambda: index.search("nope", vec, 1),
        lambda: index.dim("nope"),
        lambda: index.drop_set("nope"),
    ]
    for call in calls:
        with pytest.raises(NotFound, match="nope"):
            call()


def test_sets_are_isolated_with_their_own_dims(index: VectorIndex) -> None:
    rng = np.random.default_rng(8)
    ids = [sha(i) for i in range(30)]
    small, large = unit(rng, 30, 16), unit(rng, 30, 48)
    index.create_set("small", 16)
    index.create_set("large", 48)
    index.upsert("small", ids, small)
    index.upsert("large", ids, large)
    index.delete("small", ids[:10])
    assert index.list_sets() == {"small": 16, "large": 48}
    assert (index.dim("small"), index.dim("large")) == (16, 48)
    assert (index.count("small"), index.count("large")) == (20, 30)
    assert index.search("large", large[0], 1)[0][0].id == ids[0]
    with pytest.raises(InvalidInput):
        index.search("small", large[0], 1)
    index.drop_set("small")
    assert not index.has_set("small") and index.has_set("large")
    assert index.count("large") == 30
    index.create_set("small", 32)  # a dropped set can be re-created with another dimension
    assert index.count("small") == 0 and index.dim("small") == 32


def test_small_and_empty_searches(index: VectorIndex) -> None:
    rng = np.random.default_rng(9)
    index.create_set("s", DIM)
    assert index.search("s", unit(rng, 2), 5) == [[], []]
    index.upsert("s", [], np.zeros((0, DIM), np.float32))
    vecs = unit(rng, 3)
    index.upsert("s", [sha(i) for i in range(3)], vecs)
    assert [len(r) for r in index.search("s", unit(rng, 2), 10)] == [3, 3]
    assert index.search("s", np.zeros((0, DIM), np.float32), 5) == []


def test_faiss_switches_to_hnsw_and_keeps_recall(tmp_path: Path) -> None:
    rng = np.random.default_rng(10)
    n, dim = 3000, 32
    centres = unit(rng, 40, dim)  # clustered, like real embeddings, not uniform noise
    vecs = centres[rng.integers(0, 40, n)] + 0.35 * unit(rng, n, dim)
    vecs = (vecs / np.linalg.norm(vecs, axis=1, keepdims=True)).astype(np.float32)
    ids = [sha(i) for i in range(n)]
    idx = FaissIndex(tmp_path, ann_threshold=1000, autoflush=False)
    idx.create_set("big", dim)
    idx.upsert("big", ids[:800], vecs[:800])
    assert not idx.is_ann("big")
    idx.upsert("big", ids[800:], vecs[800:])
    assert idx.is_ann("big")
    gone = set(ids[:300])
    idx.delete("big", list(gone))  # below the rebuild ratio: tombstones, not a rebuild
    store = {i: v for i, v in zip(ids, vecs, strict=True) if i not in gone}
    queries = vecs[rng.integers(0, n, 50)] + 0.1 * unit(rng, 50, dim)
    queries = (queries / np.linalg.norm(queries, axis=1, keepdims=True)).astype(np.float32)
    found = idx.search("big", queries, 10)
    recall = np.mean(
        [
            len({h.id for h in got} & {i for i, _ in exact(store, q, 10)}) / 10
            for q, got in zip(queries, found, strict=True)
        ]
    )
    assert recall >= 0.9
    assert all(h.id not in gone for row in found for h in row)
    idx.upsert("big", ids[300:400], vecs[300:400])  # unchanged rows stay where they are
    idx.upsert("big", [ids[500]], queries[:1])  # a changed row is replaced inside HNSW
    assert idx.count("big") == n - 300
    assert idx.search("big", queries[0], 1)[0][0].id == ids[500]
    idx.close()
    idx = FaissIndex(tmp_path, ann_threshold=1000)
    assert idx.is_ann("big") and idx.count("big") == n - 300
    idx.delete("big", ids[300:2700])  # 300 left: rebuilt as an exact index
    assert not idx.is_ann("big") and idx.count("big") == 300
    left = {i: v for i, v in store.items() if i in set(ids[2700:])}
    assert_hits(idx.search("big", queries[0], 5)[0], exact(left, queries[0], 5))
    idx.close()


def test_faiss_directory_has_one_owner(tmp_path: Path) -> None:
    first = FaissIndex(tmp_path)
    with pytest.raises(BackendUnavailable, match="in use"):
        FaissIndex(tmp_path)
    first.close()
    assert not first.health()
    with pytest.raises(BackendUnavailable, match="closed"):
        first.has_set("s")
    FaissIndex(tmp_path).close()


def test_faiss_concurrent_writers(tmp_path: Path) -> None:
    idx = FaissIndex(tmp_path, autoflush=False)
    idx.create_set("s", DIM)
    rng = np.random.default_rng(11)
    vecs = unit(rng, 400)

    def write(part: int) -> None:
        for j in range(part * 100, part * 100 + 100, 10):
            idx.upsert("s", [sha(i) for i in range(j, j + 10)], vecs[j : j + 10])
            idx.search("s", vecs[j], 3)

    threads = [threading.Thread(target=write, args=(p,)) for p in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert idx.count("s") == 400
    idx.close()


def test_qdrant_point_ids_are_deterministic() -> None:
    digest = sha("x")
    assert point_id(digest) == point_id(digest)
    assert point_id(digest).replace("-", "") == digest[:32]
    assert point_id(digest) != point_id(sha("y"))


def test_qdrant_unreachable_server_is_backend_unavailable() -> None:
    with socket.socket() as sock:  # a loopback port with nothing listening
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    idx = QdrantIndex(url=f"http://127.0.0.1:{port}", timeout=1, retries=2, backoff_s=0.01)
    assert not idx.health()
    with pytest.raises(BackendUnavailable, match="3 attempt"):
        idx.has_set("s")
    idx.close()


def test_factory_rejects_unknown_backend() -> None:
    with pytest.raises(InvalidInput, match="unknown vector index backend"):
        make_index("milvus")
    with pytest.raises(InvalidInput, match="exactly one"):
        make_index("qdrant")


def test_payloads_read_back_what_was_set_and_repair_settles(reopen: Opener) -> None:
    """``payloads()`` is what start-up reconciliation compares with the catalog by digest: every backend must give
    back each stored payload with its types (``1``, ``1.0`` and ``true`` differ), ``{}`` for an id without one,
    nothing for an id not in the set, across a reopen and past one batch (Qdrant reads 256 ids a request);
    otherwise repair would rewrite the same payloads at every start, or miss drift."""
    idx = reopen()
    ids = [sha(i) for i in range(300)]
    idx.create_set("refs", DIM)
    idx.upsert("refs", ids, unit(np.random.default_rng(9), len(ids)))
    payloads: dict[str, dict[str, object]] = {ids[i]: {"n": i, "tag": f"t{i % 7}", "tags": ["a", "b"]}
                                              for i in range(0, 300, 2)}
    payloads |= {ids[1]: {"v": 1}, ids[3]: {"v": 1.0}, ids[5]: {"v": True}, ids[7]: {"label": "é\u2603 \"q\""},
                 ids[9]: {"big": 2**62, "neg": -0.5}}
    idx.set_payloads("refs", payloads)
    want = {s: payloads.get(s, {}) for s in ids}
    rows = [cast(ImageRecord, SimpleNamespace(sha256=s, payload=p)) for s, p in want.items()]
    for attempt in range(2):
        got = idx.payloads("refs", [*ids, sha("absent")])
        assert got == want, attempt
        assert {s: payload_digest(p) for s, p in got.items()} == {s: payload_digest(p) for s, p in want.items()}
        assert _repair_payloads(idx, "refs", rows) == 0, attempt  # nothing drifted: nothing rewritten
        idx.flush()
        idx.close()
        idx = reopen()
    idx.set_payloads("refs", {ids[1]: {"v": 2}, ids[2]: {}})  # drift, as a crash before the index's save leaves
    assert _repair_payloads(idx, "refs", rows) == 2
    assert idx.payloads("refs", ids[:3]) == {s: want[s] for s in ids[:3]}
    with pytest.raises(NotFound):
        idx.payloads("nope", ids[:1])
    idx.close()
