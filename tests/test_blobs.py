"""The content-addressed blob store: layout, atomicity, idempotence, validation."""

from __future__ import annotations

import hashlib
import os
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from rubricsearch.indexer.blobs import BlobStore, validate_sha256
from rubricsearch.retrieval.errors import InvalidInput, NotFound


def test_put_get_roundtrip_and_sharded_layout(blob_store: BlobStore) -> None:
    data = b"\x89PNG not really"
    sha = blob_store.put(data)
    assert sha == hashlib.sha256(data).hexdigest()
    assert blob_store.path(sha) == blob_store.root / sha[:2] / sha[2:4] / sha
    assert blob_store.path(sha).read_bytes() == data
    assert blob_store.get(sha) == data
    assert blob_store.get(sha, verify=True) == data
    assert blob_store.exists(sha)
    assert blob_store.size(sha) == len(data)
    with blob_store.open(sha) as fh:
        assert fh.read() == data


def test_put_is_idempotent_and_leaves_no_temp_files(blob_store: BlobStore) -> None:
    first = blob_store.put(b"same bytes")
    inode = blob_store.path(first).stat().st_ino
    assert blob_store.put(b"same bytes") == first
    assert blob_store.path(first).stat().st_ino == inode  # not rewritten
    assert list(blob_store.iter_shas()) == [first]
    assert os.listdir(blob_store.root / "tmp") == []


def test_put_repairs_a_truncated_blob(blob_store: BlobStore) -> None:
    sha = blob_store.put(b"complete content")
    blob_store.path(sha).write_bytes(b"compl")
    assert blob_store.put(b"complete content") == sha
    assert blob_store.get(sha, verify=True) == b"complete content"


def test_verify_detects_corruption(blob_store: BlobStore) -> None:
    sha = blob_store.put(b"original")
    blob_store.path(sha).write_bytes(b"tampered")
    assert blob_store.get(sha) == b"tampered"
    with pytest.raises(InvalidInput):
        blob_store.get(sha, verify=True)


def test_put_file_streams_and_matches_put(blob_store: BlobStore, tmp_path) -> None:
    data = os.urandom(3 * (1 << 20) + 17)
    src = tmp_path / "big.bin"
    src.write_bytes(data)
    sha = blob_store.put_file(src)
    assert sha == hashlib.sha256(data).hexdigest()
    assert blob_store.get(sha) == data
    assert blob_store.put_file(src) == sha
    assert os.listdir(blob_store.root / "tmp") == []


def test_empty_blob_is_allowed(blob_store: BlobStore) -> None:
    sha = blob_store.put(b"")
    assert sha == hashlib.sha256(b"").hexdigest()
    assert blob_store.get(sha) == b""


def test_missing_blob_raises_not_found(blob_store: BlobStore) -> None:
    sha = hashlib.sha256(b"never stored").hexdigest()
    assert not blob_store.exists(sha)
    for call in (blob_store.get, blob_store.size, blob_store.open):
        with pytest.raises(NotFound):
            call(sha)
    assert blob_store.delete(sha) is False


def test_delete_removes_blob_and_prunes_empty_shards(blob_store: BlobStore) -> None:
    sha = blob_store.put(b"to delete")
    shard = blob_store.path(sha).parent
    assert blob_store.delete(sha) is True
    assert not blob_store.exists(sha)
    assert not shard.exists() and not shard.parent.exists()
    assert list(blob_store.iter_shas()) == []
    assert blob_store.put(b"to delete") == sha  # the shard is recreated


@pytest.mark.parametrize(
    "bad",
    [
        "",
        "../../etc/passwd",
        "a" * 63,
        "a" * 65,
        "A" * 64,
        "g" * 64,
        "../" + "a" * 61,
        "a" * 32 + "/" + "a" * 31,
        "a" * 63 + "\n",
    ],
)
def test_invalid_sha_is_rejected_everywhere(blob_store: BlobStore, bad: str) -> None:
    with pytest.raises(InvalidInput):
        validate_sha256(bad)
    for call in (blob_store.path, blob_store.exists, blob_store.get, blob_store.delete):
        with pytest.raises(InvalidInput):
            call(bad)


def test_iter_shas_is_sorted_and_ignores_strays(blob_store: BlobStore) -> None:
    shas = sorted(blob_store.put(f"blob {i}".encode()) for i in range(20))
    (blob_store.root / "tmp" / "leftover.part").write_bytes(b"partial")
    (blob_store.root / "README").write_text("not a blob")
    stray_dir = blob_store.root / shas[0][:2] / shas[0][2:4]
    (stray_dir / "notes.txt").write_text("not a blob")
    (stray_dir / ("f" * 64)).write_bytes(b"a sha-named file in the wrong shard")
    assert list(blob_store.iter_shas()) == shas


def test_sweep_temp_removes_only_old_leftovers(blob_store: BlobStore) -> None:
    old = blob_store.root / "tmp" / "old.part"
    new = blob_store.root / "tmp" / "new.part"
    old.write_bytes(b"x")
    new.write_bytes(b"y")
    past = time.time() - 7200
    os.utime(old, (past, past))
    assert blob_store.sweep_temp(older_than_s=3600) == 1
    assert not old.exists() and new.exists()


def test_concurrent_puts_of_the_same_content(blob_store: BlobStore) -> None:
    data = os.urandom(256 * 1024)
    with ThreadPoolExecutor(max_workers=4) as pool:
        shas = list(pool.map(lambda _: blob_store.put(data), range(16)))
    assert len(set(shas)) == 1
    assert blob_store.get(shas[0], verify=True) == data
    assert os.listdir(blob_store.root / "tmp") == []


def test_store_reopens_on_existing_root(blob_store: BlobStore) -> None:
    sha = blob_store.put(b"persisted")
    again = BlobStore(blob_store.root, fsync=False)
    assert again.get(sha) == b"persisted"
