"""Feature store: corrupt or mismatched packages are never used; budgets; atomic writes; sharing."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch

from rubricsearch.rerank import load_reranker
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import Fingerprint, PackageStore, VisualPackage

FP = Fingerprint(tower="t" * 64, min_pixels=4096, max_pixels=1843200, patch_size=16, merge_size=2,
                 temporal_patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, resize="test")


def _pkg(seed: int, tokens_hw: tuple[int, int] = (4, 4), hidden: int = 32, levels: int = 2) -> VisualPackage:
    g = torch.Generator().manual_seed(seed)
    h, w = tokens_hw
    n = h * w // 4
    sha = f"{seed:064x}"
    return VisualPackage(sha, FP, (1, h, w), torch.randn(n, hidden, generator=g),
                         torch.randn(levels, n, hidden, generator=g))


def test_roundtrip_and_reload(tmp_path: Path) -> None:
    store = PackageStore(tmp_path, storage_dtype="float32")
    p = _pkg(1)
    store.put(p)
    again = PackageStore(tmp_path, storage_dtype="float32").get(p.image_sha256, FP)
    assert again is not None and torch.equal(again.embeds, p.embeds) and torch.equal(again.deepstack, p.deepstack)
    assert again.grid_thw == (1, 4, 4)
    assert not list(tmp_path.rglob("*.tmp"))


def test_other_fingerprint_or_dtype_is_a_miss(tmp_path: Path) -> None:
    store = PackageStore(tmp_path, storage_dtype="float32")
    p = _pkg(2)
    store.put(p)
    other = Fingerprint(**{**FP.__dict__, "max_pixels": 1000000})
    assert store.get(p.image_sha256, other) is None
    assert PackageStore(tmp_path, storage_dtype="bfloat16").get(p.image_sha256, FP) is None


@pytest.mark.parametrize("damage", ["truncate", "garbage", "swap"])
def test_corrupt_file_is_discarded(tmp_path: Path, damage: str) -> None:
    store = PackageStore(tmp_path, storage_dtype="float32")
    p, q = _pkg(3), _pkg(4)
    store.put(p)
    store.put(q)
    path = next(f for f in tmp_path.rglob("*.safetensors") if f.name.startswith(p.image_sha256))
    other = next(f for f in tmp_path.rglob("*.safetensors") if f.name.startswith(q.image_sha256))
    if damage == "truncate":
        path.write_bytes(path.read_bytes()[:100])
    elif damage == "garbage":
        path.write_bytes(os.urandom(path.stat().st_size))
    else:  # a valid file of another image under this image's name
        path.write_bytes(other.read_bytes())
    fresh = PackageStore(tmp_path, storage_dtype="float32")
    assert fresh.get(p.image_sha256, FP) is None
    assert fresh.stats()["corrupt"] == 1
    assert not path.exists()


def test_stale_temp_files_are_removed(tmp_path: Path) -> None:
    (tmp_path / "ab").mkdir()
    (tmp_path / "ab" / "half.safetensors.123.tmp").write_bytes(b"partial")
    PackageStore(tmp_path)
    assert not list(tmp_path.rglob("*.tmp"))


def test_memory_and_disk_budgets_evict_lru(tmp_path: Path) -> None:
    one = _pkg(10).nbytes
    store = PackageStore(tmp_path, storage_dtype="float32", memory_bytes=int(one * 2.5), disk_bytes=10**12)
    for s in range(10, 14):
        store.put(_pkg(s))
    st = store.stats()
    assert st["memory_packages"] == 2 and st["evictions_memory"] == 2
    assert store.get(_pkg(10).image_sha256, FP) is not None  # from disk
    file_size = next(tmp_path.rglob("*.safetensors")).stat().st_size
    small = PackageStore(tmp_path / "small", storage_dtype="float32", disk_bytes=int(file_size * 2.5))
    for s in range(20, 24):
        small.put(_pkg(s))
    small.get(_pkg(22).image_sha256, FP)
    assert small.stats()["disk_packages"] == 2
    fresh = PackageStore(tmp_path / "small", storage_dtype="float32", memory_bytes=0)
    assert fresh.get(_pkg(20).image_sha256, FP) is None  # least recently used went first
    assert fresh.get(_pkg(23).image_sha256, FP) is not None


def test_delete_image_removes_all_packages(tmp_path: Path) -> None:
    store = PackageStore(tmp_path, storage_dtype="float32")
    p = _pkg(30)
    store.put(p)
    assert store.delete_image(p.image_sha256) == 1
    assert store.get(p.image_sha256, FP) is None


def test_corrupt_package_recomputed_same_embedding(tmp_path: Path, tiny_embedding_dir: Path, make_png) -> None:
    data = make_png(150, 100, 5)
    emb = load_embedder(str(tiny_embedding_dir), store=PackageStore(tmp_path, storage_dtype="float32"))
    before = emb.embed([{"image": data}])
    for f in tmp_path.rglob("*.safetensors"):
        f.write_bytes(b"\x00" * 64)
    emb2 = load_embedder(str(tiny_embedding_dir), store=PackageStore(tmp_path, storage_dtype="float32"))
    after = emb2.embed([{"image": data}])
    assert emb2.stats["vision_encodes"] == 1
    assert np.abs(after - before).max() == 0.0


def test_max_pixels_gives_separate_package(tmp_path: Path, tiny_embedding_dir: Path, make_png) -> None:
    data = make_png(300, 300, 6)
    store = PackageStore(tmp_path, storage_dtype="float32")
    big = load_embedder(str(tiny_embedding_dir), store=store)
    small = load_embedder(str(tiny_embedding_dir), store=store, max_pixels=128 * 128)
    big.embed([{"image": data}])
    small.embed([{"image": data}])
    assert small.stats["vision_encodes"] == 1
    pkgs = {p.parent.parent.name for p in tmp_path.rglob("*.safetensors")}
    assert len(pkgs) == 2
    sha = decode_image(data).sha256
    assert store.get(sha, small.packages.fingerprint).grid_thw != store.get(sha, big.packages.fingerprint).grid_thw


def test_identical_towers_share_packages(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                         make_png) -> None:
    """The tiny embedding and reranker checkpoints of one seed have byte-identical vision towers."""
    store = PackageStore(tmp_path, storage_dtype="float32")
    emb = load_embedder(str(tiny_embedding_dir), store=store)
    rr = load_reranker(str(tiny_reranker_dir), store=store)
    assert emb.packages.fingerprint == rr.packages.fingerprint
    data = make_png(120, 80, 7)
    emb.embed([{"image": data}])
    rr.score("q", [{"image": data}])
    assert rr.stats["vision_encodes"] == 0 and rr.stats["package_hits"] == 1
    from rubricsearch.retrieval.qwen.model.checkpoint import make_test_model

    other = load_embedder(str(make_test_model(tmp_path / "other", "embedding", seed=9)), store=store)
    assert other.packages.fingerprint != emb.packages.fingerprint
    other.embed([{"image": data}])
    assert other.stats["vision_encodes"] == 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float8_e4m3fn"])
def test_compact_storage_deviation(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                   make_png, dtype: str, record_property) -> None:
    """Lossy storage dtypes: measure (and bound) the deviation they cause; the note reports it."""
    imgs = [make_png(200 + 13 * i, 150, 40 + i) for i in range(4)]
    items = [{"image": d, "text": "x"} for d in imgs]
    exact = load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))
    lossy = load_embedder(str(tiny_embedding_dir), store=PackageStore(tmp_path / "e", storage_dtype=dtype))
    lossy.embed(items)  # populate
    cos = (exact.embed(items) * lossy.embed(items)).sum(axis=1).min()
    rr_exact = load_reranker(str(tiny_reranker_dir), store=PackageStore(storage_dtype="float32"))
    rr_lossy = load_reranker(str(tiny_reranker_dir), store=PackageStore(tmp_path / "r", storage_dtype=dtype))
    docs = [{"image": d} for d in imgs]
    dev = float(np.abs(np.array(rr_exact.score("q", docs)) - np.array(rr_lossy.score("q", docs))).max())
    record_property("min_cosine", float(cos))
    record_property("max_score_delta", dev)
    print(f"[storage {dtype}] min embedding cosine {cos:.6f}, max |score delta| {dev:.2e}")
    assert cos > (0.999 if dtype == "bfloat16" else 0.99)
    assert dev < (1e-2 if dtype == "bfloat16" else 5e-2)


@pytest.mark.parametrize("storage_dtype,scales", [("float8_e4m3fn", "token"), ("float8_e4m3fn", "channel"),
                                                  ("bfloat16", "token")])
def test_get_many_gives_exactly_what_get_gives(tmp_path: Path, storage_dtype: str, scales: str) -> None:
    """Packages read together (float8 ones dequantised in one pass) equal those read one by one; a miss is
    left out, and packages read back from disk join those in memory."""
    store = PackageStore(tmp_path, storage_dtype=storage_dtype, fp8_scales=scales)  # type: ignore[arg-type]
    packages = [_pkg(40 + i, tokens_hw=(4, 4 + 2 * i)) for i in range(5)]
    for p in packages[:3]:
        store.put(p)
    cold = PackageStore(tmp_path, storage_dtype=storage_dtype, fp8_scales=scales)  # type: ignore[arg-type]
    cold.put(packages[3])  # in memory; the first three come from disk
    shas = [p.image_sha256 for p in packages]
    for s in (store, cold):
        many = s.get_many([*shas, shas[0]], FP)
        assert list(many) == [sha for sha in shas if s.contains(sha, FP)] and packages[4].image_sha256 not in many
        for sha, got in many.items():
            one = s.get(sha, FP)
            assert one is not None and got.grid_thw == one.grid_thw
            assert torch.equal(got.embeds, one.embeds) and torch.equal(got.deepstack, one.deepstack)
        storages = {got.embeds.untyped_storage().data_ptr() for got in many.values()}
        assert len(storages) == (1 if scales == "token" and storage_dtype == "float8_e4m3fn" else len(many))


@pytest.mark.parametrize("storage_dtype", ["float32", "bfloat16", "float8_e4m3fn"])
def test_stored_packages_hold_only_their_own_memory(tiny_embedding_dir: Path, make_png, storage_dtype: str) -> None:
    """A tower pass's packages are views of its batch tensors; what the store keeps of each is its own memory
    (else the memory tier, which counts a package's bytes, would hold whole passes), even where the storage
    dtype is the model's and no cast copies."""
    from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
    from rubricsearch.retrieval.qwen.model.loading import load_qwen

    encoder = VisionEncoder(load_qwen(tiny_embedding_dir, dtype="float32"))
    made = encoder.encode([decode_image(make_png(64 + 32 * i, 64, 900 + i)) for i in range(3)])
    assert any(p.deepstack.untyped_storage().nbytes() > p.deepstack.nbytes for p in made)  # views, as promised
    store = PackageStore(storage_dtype=storage_dtype, memory_device="cpu")  # type: ignore[arg-type]
    for p in made:
        store.put(p)
    store.put_many(encoder.encode([decode_image(make_png(96, 64 + 32 * i, 950 + i)) for i in range(3)]))
    for stored in store._memory.values():
        for t in stored.tensors().values():
            assert t.untyped_storage().nbytes() == t.numel() * t.element_size()


def test_one_filesystem_sync_covers_blobs_and_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Ingestion makes a batch's blobs and packages durable with one sync per filesystem, not one per store (both
    usually sit under the data directory); every filesystem among the roots is still synced, and a failed sync
    raises."""
    import ctypes
    import errno
    import types

    from rubricsearch.retrieval.packages import store

    synced: list[int] = []

    def fake_libc() -> object:
        return types.SimpleNamespace(syncfs=lambda fd: synced.append(os.fstat(fd).st_dev) or 0)

    monkeypatch.setattr(store, "_libc", fake_libc)
    (tmp_path / "blobs").mkdir()
    PackageStore(tmp_path / "packages").sync(tmp_path / "blobs")
    assert synced == [os.stat(tmp_path).st_dev]
    synced.clear()
    PackageStore(tmp_path / "packages").sync(tmp_path / "blobs", Path("/dev/shm"))
    assert sorted(synced) == sorted({os.stat(tmp_path).st_dev, os.stat("/dev/shm").st_dev})  # each once
    synced.clear()
    PackageStore().sync()  # memory only, no blobs to sync: no call
    assert synced == []
    # a write-back error syncfs reports (here EIO) fails the sync, so the batch is never committed
    monkeypatch.setattr(store, "_libc", lambda: types.SimpleNamespace(syncfs=lambda fd: -1))
    monkeypatch.setattr(ctypes, "get_errno", lambda: errno.EIO)
    with pytest.raises(OSError, match="syncfs"):
        PackageStore(tmp_path / "packages").sync(tmp_path / "blobs")
