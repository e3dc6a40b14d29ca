"""The device copy of a set (``retrieval.index.faiss_accel.device_search.TorchMatrix``) in both precisions, on the CPU.

The float8 copy only picks candidates (re-scored exactly afterwards), so what it must keep is the true
top-k among its oversampled candidates; padding (width and rows to multiples of 16), growth, deletes and the
caller's arrays must behave as in the half-precision copy.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from rubricsearch.retrieval.index.faiss_accel.device_search import TorchMatrix, oversampled


def unit(rng: np.random.Generator, n: int, dim: int) -> np.ndarray:
    # low-rank plus noise, as embeddings are: many near-ties, the hard case for a coarse number format
    basis = rng.standard_normal((16, dim)).astype(np.float32)
    x = rng.standard_normal((n, 16)).astype(np.float32) @ basis + 0.3 * rng.standard_normal((n, dim)).astype(np.float32)
    return x / np.linalg.norm(x, axis=1, keepdims=True)


@pytest.mark.parametrize("precision", ["float16", "float8"])
def test_candidates_hold_the_exact_top_k(precision: str) -> None:
    rng = np.random.default_rng(0)
    dim, k = 200, 10  # 200: not a multiple of 16, so the float8 copy pads its width
    rows = unit(rng, 5000, dim)
    queries = unit(rng, 40, dim)
    matrix = TorchMatrix(dim, "cpu", capacity=64, precision=precision)  # grows several times
    for start in range(0, len(rows), 700):
        matrix.append(rows[start : start + 700])
    assert matrix.rows == 5000
    assert matrix.fp8 is (precision == "float8")
    found = matrix.candidates(queries, oversampled(k))
    assert found.shape == (40, oversampled(k))
    truth = np.argsort(-(queries @ rows.T), axis=1)[:, :k]
    for got, want in zip(found, truth, strict=True):
        assert set(want) <= set(got.tolist())
    # the first candidate is the best by the copy's own scores; with float8 it may differ from exact only by a
    # near-tie, never by a different neighbourhood
    best = (queries @ rows.T).max(axis=1)
    picked = np.einsum("qd,qd->q", queries, rows[found[:, 0]])
    assert np.all(best - picked < 0.02)


def test_float8_copy_is_half_the_bytes_and_leaves_the_callers_array_alone() -> None:
    rng = np.random.default_rng(1)
    rows = unit(rng, 64, 256)
    before = rows.copy()
    half = TorchMatrix(256, "cpu", capacity=64, precision="float16")
    eight = TorchMatrix(256, "cpu", capacity=64, precision="float8")
    half.append(rows)
    eight.append(rows)
    np.testing.assert_array_equal(rows, before)  # the scaling into float8 range is never done in place
    assert eight.nbytes * 2 == half.nbytes


def test_float8_deletes_and_padding_rows_never_come_back() -> None:
    rng = np.random.default_rng(2)
    rows = unit(rng, 21, 48)  # 21 rows in a buffer padded to 32: the padding rows must never be candidates
    matrix = TorchMatrix(48, "cpu", capacity=16, precision="float8")
    matrix.append(rows)
    matrix.kill([0, 5])
    found = matrix.candidates(rows[:3], 30)
    assert found.shape == (3, 21)
    for row in found:
        live = [s for s in row.tolist() if s >= 0]
        assert sorted(live) == sorted(set(range(21)) - {0, 5})
        assert row.tolist().count(-1) == 2
    assert found[1][0] == 1 and found[2][0] == 2  # a row is its own nearest neighbour


def test_unknown_precision_is_refused() -> None:
    with pytest.raises(ValueError, match="precision"):
        TorchMatrix(16, "cpu", precision="int4")


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_cuda_auto_copy_is_float8_on_hopper_and_keeps_the_top_k() -> None:
    import torch

    from rubricsearch.retrieval.index.faiss_accel.device_search import float8_supported

    device = torch.device("cuda")
    rng = np.random.default_rng(3)
    rows, queries = unit(rng, 50_000, 2048), unit(rng, 20, 2048)
    matrix = TorchMatrix(2048, device)
    assert matrix.device == torch.device("cuda", torch.cuda.current_device())  # pinned, not a later current GPU
    assert matrix.fp8 is float8_supported(device)  # auto: float8 wherever the GPU multiplies it
    matrix.append(rows)
    found = matrix.candidates(queries, oversampled(10))
    truth = np.argsort(-(queries @ rows.T), axis=1)[:, :10]
    for got, want in zip(found, truth, strict=True):
        assert set(want) <= set(got.tolist())


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA device")
def test_a_cuda_search_does_not_wait_for_the_models_queued_work() -> None:
    """The mirror's work runs on a side stream (``TorchMatrix._stream``): a search returns while the default
    stream, where the models' passes queue, is still busy; appends and kills on the mirror stay ordered before the
    searches that follow them; and the stream is none that GPU preprocessing draws (it shares those under turns)."""
    import torch

    from rubricsearch.retrieval.plugins.accelerated.gpu_preprocess import PRIORITY as PREPROCESS_PRIORITY

    preprocessing = {torch.cuda.Stream(priority=PREPROCESS_PRIORITY).cuda_stream for _ in range(40)}  # > the pool
    rng = np.random.default_rng(5)
    rows, queries = unit(rng, 4_096, 256), unit(rng, 4, 256)
    matrix = TorchMatrix(256, "cuda")
    assert matrix._stream is not None and matrix._stream.cuda_stream not in preprocessing
    matrix.append(rows)
    best = np.argmax(queries @ rows.T, axis=1)
    matrix.kill(best[:1])  # the first query's best row is gone
    matrix.candidates(queries, 8)  # first use: the stream's matrix-product workspace is made now
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of queued work on the default stream
    found = matrix.candidates(queries, 8)
    busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert busy  # the search came back before the queued work ended
    assert best[0] not in found[0].tolist()
    assert all(best[q] in found[q].tolist() for q in range(1, len(queries)))


@pytest.mark.parametrize(("device", "mirror"), [("cuda:1", "cuda:1"), ("cpu", "cuda")])
def test_the_apps_index_mirrors_sets_on_the_models_gpu(tmp_path: Path, device: str, mirror: str) -> None:
    """``RUBRICSEARCH_MODELS__DEVICE=cuda:1`` puts the models on GPU 1: the vector mirrors go there too, not to GPU 0
    (where CUDA's current device would put them). Models on the CPU leave the mirrors to the current GPU."""
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import _make_index
    from rubricsearch.retrieval.index.faiss_index import FaissIndex

    index = _make_index(Settings(_env_file=None, data_dir=tmp_path, models={"device": device}))
    try:
        assert isinstance(index, FaissIndex)
        assert index.search_device == mirror
        # VECTOR_SEARCH_DEVICE's auto: a mirror wherever there is a GPU, the CPU's index otherwise
        assert (index.device_search in {"torch", "faiss-gpu"}) == __import__("torch").cuda.is_available()
    finally:
        index.close()
