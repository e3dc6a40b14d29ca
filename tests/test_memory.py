"""Memory held under churn (issue 13, soak): caches hold what they count, and the heap gives freed memory back.

The soak benchmark found RSS rising while the in-use heap stayed flat (glibc arenas kept freed chunks) and
the query tier holding about twice its byte budget (per-image views kept whole tower batches alive).
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rubricsearch.app.memory import _glibc
from rubricsearch.retrieval.packages import EphemeralPackages, Fingerprint, VisualPackage
from rubricsearch.retrieval.packages.storage_form import pack_many

FP = Fingerprint(tower="t" * 64, min_pixels=4096, max_pixels=1843200, patch_size=16, merge_size=2,
                 temporal_patch_size=2, image_mean=(0.5,) * 3, image_std=(0.5,) * 3, resize="test")


def _batch(images: int, seed: int, tokens: int = 16, hidden: int = 64, levels: int = 3) -> list[VisualPackage]:
    """Packages as a tower batch makes them: embeds are per-image views of one batch tensor."""
    gen = torch.Generator().manual_seed(seed)
    pooled = torch.randn(images * tokens, hidden, generator=gen)
    deep = [torch.randn(images * tokens, hidden, generator=gen) for _ in range(levels)]
    embeds, parts = torch.split(pooled, tokens), [torch.split(d, tokens) for d in deep]
    return [VisualPackage(f"{seed:032x}{i:032x}", FP, (1, 8, 8), embeds[i], torch.stack([p[i] for p in parts]))
            for i in range(images)]


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in tensors}
    return sum(storages.values())


def test_query_tier_holds_no_more_than_its_budget() -> None:
    """After many tower batches the tier's tensors really occupy at most its budget, not whole batches
    (a search's candidate shares its tower pass with other requests' images, which the tier never keeps)."""
    one = _batch(1, 0)[0].nbytes
    tier = EphemeralPackages(max_bytes=20 * one)
    for seed in range(1, 60):
        tier.put(_batch(8, seed)[0])
    held = [t for pkg in tier._items.values() for t in (pkg.embeds, pkg.deepstack)]
    assert tier.stats()["bytes"] <= tier.max_bytes
    assert _storage_bytes(held) <= tier.max_bytes


@pytest.mark.parametrize("dtype", ["float8_e4m3fn", "bfloat16"])
def test_packed_batch_is_dense(dtype: str) -> None:
    """Each stored package of a batch owns exactly its bytes (files and the memory tier stay dense)."""
    stored, joint = pack_many(_batch(8, 1), dtype, "token", torch.device("cpu"))  # type: ignore[arg-type]
    for one in stored:
        assert _storage_bytes(list(one.tensors().values())) == one.nbytes
    assert joint is not None  # what the package writers cut on the host: the same parts, from a copy
    copied = joint.split({name: t.clone() for name, t in joint.tensors.items()})
    for one, parts in zip(stored, copied, strict=True):
        for name, t in one.tensors().items():
            assert torch.equal(parts[name].view(torch.uint8), t.view(torch.uint8)) and parts[name].is_contiguous()


HEAP_CHURN = textwrap.dedent("""
    import ctypes, sys, time
    from rubricsearch.app.memory import HeapTrimmer
    libc = ctypes.CDLL("libc.so.6")
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    def rss():
        return int(next(l for l in open("/proc/self/status") if l.startswith("VmRSS")).split()[1]) // 1024
    blocks = [libc.malloc(64 << 10) for _ in range(3200)]  # 200 MiB of heap chunks, below the mmap threshold
    for b in blocks:
        ctypes.memset(b, 1, 64 << 10)
    for b in blocks[:-1]:
        libc.free(b)  # free, but below a live chunk: glibc keeps it all
    held = rss()
    trimmer = HeapTrimmer(float(sys.argv[1])).start()
    time.sleep(1.5)
    trimmer.stop()
    print(held, rss(), trimmer.trims)
""")


@pytest.mark.skipif(_glibc() is None, reason="glibc only")
def test_heap_trimmer_returns_freed_heap() -> None:
    """Freed heap below a live chunk stays in RSS until the server's trimmer runs; then it is returned."""
    def run(interval: str) -> tuple[int, int, int]:
        out = subprocess.run([sys.executable, "-c", HEAP_CHURN, interval], capture_output=True, text=True,
                             check=True, timeout=60)
        held, after, trims = map(int, out.stdout.split())
        return held, after, trims

    held, after, trims = run("0")  # disabled: the freed 200 MiB stay resident
    assert trims == 0 and held - after < 50
    held, after, trims = run("0.1")
    assert trims >= 1
    assert held - after > 150, f"RSS {held} MiB -> {after} MiB after {trims} trims"


def test_byte_settings_take_units() -> None:
    """The soak command sets ``RUBRICSEARCH_PACKAGES__MEMORY_BYTES=192MiB`` (a quarter for query packages)."""
    from rubricsearch.app.main import MALLOC_ARENA_MAX, MALLOC_TRIM_INTERVAL_S
    from rubricsearch.app.settings import Settings

    settings = Settings(packages={"memory_bytes": "192MiB"}, limits={"max_json_bytes": "4KiB"})  # type: ignore[arg-type]
    assert settings.packages.memory_bytes == 192 << 20 and settings.limits.max_json_bytes == 4096
    assert MALLOC_ARENA_MAX == 2 and MALLOC_TRIM_INTERVAL_S > 0


@pytest.mark.parametrize("memory", ["64MiB", "1GiB"])
def test_query_packages_get_a_share_of_the_package_memory(tmp_path: Path, memory: str) -> None:
    """No setting of its own: the query tier is a quarter of RUBRICSEARCH_PACKAGES__MEMORY_BYTES, so an operator
    who sizes the package memory sizes both (the default 2 GiB keeps the former 512 MiB)."""
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import QUERY_MEMORY_SHARE, AppState

    settings = Settings(_env_file=None, data_dir=tmp_path, packages={"memory_bytes": memory})  # type: ignore[arg-type]
    state = AppState.open(settings)
    try:
        assert state.packages.queries is not None
        assert state.packages.queries.max_bytes == int(settings.packages.memory_bytes * QUERY_MEMORY_SHARE)
        assert state.packages.queries.max_bytes == settings.packages.memory_bytes // 4
    finally:
        state.close()
    assert int(Settings(_env_file=None).packages.memory_bytes * QUERY_MEMORY_SHARE) == 512 << 20
