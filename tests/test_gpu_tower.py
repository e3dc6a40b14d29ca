"""Graphed vision-tower passes on CUDA (``pytest -m gpu``): small passes replay a CUDA graph per tuple of grids
(``retrieval/plugins/accelerated/graphed_tower.py``)
and give the eager packages, at rounding level; larger ones stay eager."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.images import EncodedImage, decode_image
from rubricsearch.retrieval.packages import PackageStore, VisualPackage
from rubricsearch.retrieval.plugins.accelerated.graphed_tower import MAX_IMAGES
from rubricsearch.retrieval.plugins.accelerated.model import accelerate
from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
from rubricsearch.retrieval.qwen.model.loading import load_qwen
from rubricsearch.retrieval.runtime.config import LocalConfig
from tests import gpu_modes
from tests.tower_checks import host_made_inputs_equal_the_grid_pass

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]

MODES, _options = gpu_modes.MODES, gpu_modes.options
_reference_kernels_after = gpu_modes._reference_kernels_after


def _close(got: list[VisualPackage], expected: list[VisualPackage], min_cos: float) -> None:
    """Same structure; every token's embedding and DeepStack features agree within rounding."""
    for g, e in zip(got, expected, strict=True):
        assert (g.image_sha256, g.grid_thw) == (e.image_sha256, e.grid_thw)
        for a, b in ((g.embeds, e.embeds), (g.deepstack, e.deepstack)):
            assert a.shape == b.shape and a.dtype == b.dtype and a.device == b.device and a.is_contiguous()
            cos = torch.nn.functional.cosine_similarity(a.float(), b.float(), dim=-1)
            print(f"{g.grid_thw}: min cos {float(cos.min()):.6f}, max |delta| {float((a - b).abs().max()):.3g}")
            assert float(cos.min()) >= min_cos


def _graph_counts(encoder: AcceleratedVisionEncoder) -> tuple[int, int, int]:
    s = encoder.stats()
    return s["tower_graph_captures"], s["tower_graph_replays"], s["tower_graph_capture_failures"]


@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("dtype,min_cos", [("bfloat16", 0.999), ("float32", 0.9999)])
def test_graphed_tower_matches_eager(tiny_embedding_dir: Path, make_png: Any, mode: str, dtype: str,
                                     min_cos: float) -> None:
    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype=dtype)
    accelerate(loaded, LocalConfig(**_options(mode)))  # as the accelerated runtime sets the model up
    eager, graphed = AcceleratedVisionEncoder(loaded), AcceleratedVisionEncoder(loaded, cuda_graphs=True)
    assert graphed.cuda_graphs and not eager.cuda_graphs
    a, b, c = (decode_image(make_png(w, h, seed)) for w, h, seed in ((448, 448, 1), (448, 448, 2), (320, 640, 3)))

    first = graphed.encode([a])  # captured, then replayed
    assert _graph_counts(graphed) == (1, 1, 0)
    _close(first, eager.encode([a]), min_cos)
    kept = (first[0].embeds.clone(), first[0].deepstack.clone())

    other = graphed.encode([b])  # same grid, other pixels: a replay, with the new pixels
    assert _graph_counts(graphed) == (1, 2, 0)
    _close(other, eager.encode([b]), min_cos)
    assert torch.equal(first[0].embeds, kept[0]) and torch.equal(first[0].deepstack, kept[1])  # copies, not views
    assert not torch.equal(other[0].embeds, first[0].embeds)

    again = graphed.encode([a])  # a replay repeats the capture exactly
    assert _graph_counts(graphed) == (1, 3, 0)
    assert torch.equal(again[0].embeds, kept[0]) and torch.equal(again[0].deepstack, kept[1])

    _close(graphed.encode([c]), eager.encode([c]), min_cos)  # a new grid: a new graph
    assert _graph_counts(graphed) == (2, 4, 0)
    _close(graphed.encode([c, a]), eager.encode([c, a]), min_cos)  # two images, one pass: its own grid tuple
    assert _graph_counts(graphed) == (3, 5, 0)

    batches = graphed.stats()["tower_batches"]
    many = [decode_image(make_png(96 + 32 * i, 96, 10 + i)) for i in range(MAX_IMAGES + 1)]
    _close(graphed.encode(many), eager.encode(many), min_cos)  # over the image budget: eager, one pass
    assert _graph_counts(graphed) == (3, 5, 0) and graphed.stats()["tower_batches"] == batches + 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_an_eager_pass_on_host_made_inputs_equals_the_grid_pass(tiny_embedding_dir: Path, make_png: Any,
                                                                 dtype: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU, in both dtypes (the CPU test is in ``tests/test_graphed_tower.py``)."""
    host_made_inputs_equal_the_grid_pass(load_qwen(tiny_embedding_dir, device="cuda", dtype=dtype), make_png,
                                         monkeypatch)


def test_embedder_replays_tower_graphs(tiny_embedding_dir: Path, make_png: Any) -> None:
    """``cuda_graphs`` reaches the embedder's tower: a search's candidate image replays a graph, and
    the embedding equals the eager one at bf16 rounding."""
    eager = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16",
                          store=PackageStore(storage_dtype="bfloat16"))
    graphed: Any = load_embedder(str(tiny_embedding_dir), device="cuda", dtype="bfloat16", cuda_graphs=True,
                                 store=PackageStore(storage_dtype="bfloat16"))
    for seed in (1, 2, 3):  # other images of one size: no package hit, one grid
        item = [{"image": make_png(448, 448, seed), "text": "short fur"}]
        assert np.abs(graphed.embed(item) - eager.embed(item)).max() <= 0.05
    stats = graphed.runtime.vision.stats()
    assert (stats["tower_graph_captures"], stats["tower_graph_replays"]) == (1, 3)


def test_bulk_tower_passes_are_graphed_once_their_grids_come_back(tiny_embedding_dir: Path, make_png: Any) -> None:
    """Passes over the small graphs' budget (ingestion batches of one image size) run eagerly until their grid
    tuple comes a third time, then through a bulk graph: the eager packages at rounding level, other pixels
    honoured. Passes of images of several lengths (a mixed-size set's) stay eager."""
    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype="float32")
    eager = AcceleratedVisionEncoder(loaded)
    graphed = AcceleratedVisionEncoder(loaded, cuda_graphs=True, bulk_graphs=True)
    sizes = [(160, 96)] * (MAX_IMAGES + 1)
    one, two = ([decode_image(make_png(w, h, seed + i)) for i, (w, h) in enumerate(sizes)] for seed in (10, 50))

    def bulk() -> tuple[int, int, int]:
        s = graphed.stats()
        return s["tower_bulk_graph_captures"], s["tower_bulk_graph_replays"], s["tower_bulk_graph_capture_failures"]

    for _ in range(2):
        _close(graphed.encode(one), eager.encode(one), 0.9999)
    assert bulk() == (0, 0, 0)  # first and second sightings: eager
    got = graphed.encode(two)
    assert bulk() == (1, 1, 0)
    _close(got, eager.encode(two), 0.9999)
    _close(graphed.encode(one), eager.encode(one), 0.9999)  # a replay with the first batch's pixels
    assert bulk() == (1, 2, 0) and _graph_counts(graphed) == (0, 0, 0)

    # a second tuple (the portrait size: as many patches) in the same pool; then the two alternate, with new pixels
    other = [(h, w) for w, h in sizes]
    for seed in (90, 91, 92):
        graphed.encode([decode_image(make_png(w, h, seed + i)) for i, (w, h) in enumerate(other)])
    assert bulk() == (2, 3, 0)
    for seed in (200, 300, 400):
        for shape in (sizes, other):
            images = [decode_image(make_png(w, h, seed + i)) for i, (w, h) in enumerate(shape)]
            _close(graphed.encode(images), eager.encode(images), 0.9999)
    assert bulk() == (2, 9, 0)
    # larger images (40 x 32 patches each, over BULK_IMAGE_PATCHES): eager however often they come
    photos = [decode_image(make_png(640, 512, 500 + i)) for i in range(MAX_IMAGES + 1)]
    for _ in range(3):
        graphed.encode(photos)
    assert bulk() == (2, 9, 0)
    mixed = [(96 + 32 * i, 96) for i in range(MAX_IMAGES + 1)]  # small, but of nine lengths: eager
    for seed in (600, 700, 800):
        images = [decode_image(make_png(w, h, seed + i)) for i, (w, h) in enumerate(mixed)]
        _close(graphed.encode(images), eager.encode(images), 0.9999)
    assert bulk() == (2, 9, 0)
    off = AcceleratedVisionEncoder(loaded, cuda_graphs=True)  # its default: no bulk graphs (the server's is on)
    for _ in range(3):
        off.encode(one)
    assert off.stats()["tower_bulk_graph_captures"] == 0


def test_gpu_preprocessing_runs_beside_the_model_stream(tiny_embedding_dir: Path) -> None:
    """Pixels made ahead (nvJPEG, resize) neither queue behind the passes on the model's stream nor race with
    them: they are ready while that stream is still busy, and the packages equal those of pixels made inline."""
    from tests.test_gpu_preprocess import photo

    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype="float32")
    encoder = AcceleratedVisionEncoder(loaded, preprocess="gpu-nvjpeg")
    images = [EncodedImage(photo(i, w, h)) for i, (w, h) in enumerate([(640, 480), (300, 900), (448, 448)])]
    want = encoder.encode(images)
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000_000)  # ~1 s of a busy model stream (the current one)
    prepared = encoder.prepare(images)
    assert prepared.ready is not None and not prepared.errors
    prepared.ready.synchronize()
    assert not torch.cuda.current_stream().query()  # ready before the model's stream got to it
    _close(encoder.encode(images, prepared), want, 0.999999)


def test_write_behind_files_hold_the_gpu_packages(tiny_embedding_dir: Path, make_png: Any, tmp_path: Path) -> None:
    """Packages made on the GPU reach their files through the writers' pinned copies: a store opened on the
    same directory (cold memory tier) reads back exactly what the first one serves from GPU memory."""
    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype="float32")
    encoder = AcceleratedVisionEncoder(loaded)
    images = [decode_image(make_png(96 + 32 * i, 64 + 16 * i, 700 + i)) for i in range(6)]
    store = PackageStore(tmp_path, storage_dtype="float8_e4m3fn", write_behind=True, writer_threads=3)
    store.put_many(encoder.encode(images))
    assert store.flush(timeout=60)
    fresh = PackageStore(tmp_path, storage_dtype="float8_e4m3fn")
    for img in images:
        hot, cold = store.get(img.sha256, encoder.fingerprint), fresh.get(img.sha256, encoder.fingerprint)
        assert hot is not None and cold is not None and hot.grid_thw == cold.grid_thw
        assert torch.equal(hot.embeds, cold.embeds.to(hot.embeds.device))
        assert torch.equal(hot.deepstack, cold.deepstack.to(hot.deepstack.device))
    assert fresh.counters["disk_hits"] == len(images) and store.stats()["disk_packages"] == len(images)
    store.close()


def test_many_threads_preprocess_on_shared_pooled_streams(tiny_embedding_dir: Path) -> None:
    """More preprocessing threads than torch's pool has streams (32): threads that share a side stream take
    turns on it, so every image gets the pixels it gets alone."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.test_gpu_preprocess import photo

    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype="float32")
    encoder = AcceleratedVisionEncoder(loaded, preprocess="gpu-nvjpeg")
    images = [EncodedImage(photo(300 + i, 320 + 16 * (i % 5), 240)) for i in range(48)]
    want = {img.sha256: encoder._process([img])[0] for img in images}
    torch.cuda.synchronize()
    with ThreadPoolExecutor(48) as pool:
        got = list(pool.map(lambda img: encoder._process([img, img])[0], images * 3))
    torch.cuda.synchronize()
    for img, result in zip(images * 3, got, strict=True):
        expected = want[img.sha256]
        assert not isinstance(result, Exception) and not isinstance(expected, Exception)
        assert result[1] == expected[1] and torch.equal(result[0], expected[0])


@pytest.mark.parametrize("storage_dtype", ["bfloat16", "float8_e4m3fn"])
def test_a_batch_packed_on_the_gpu_equals_each_package_packed_alone(storage_dtype: str) -> None:
    """pack_many on the device (one quantisation pass for the batch, then a copy per part): every stored part
    bit-identical to pack() of that package alone, dense, and holding only its own memory."""
    from rubricsearch.retrieval.packages.storage_form import pack, pack_many
    from tests.test_memory import FP as fp

    device = torch.device("cuda")
    batch_embeds, batch_deep = torch.randn(40, 64, device=device), torch.randn(3, 40, 64, device=device)
    sizes, packages, at = [4, 16, 20], [], 0
    for i, n in enumerate(sizes):
        packages.append(VisualPackage(f"{i:064x}", fp, (1, 2, 2 * n), batch_embeds[at:at + n],
                                      batch_deep[:, at:at + n]))
        at += n
    stored, joint = pack_many(packages, storage_dtype, "token", device)  # type: ignore[arg-type]
    assert joint is not None
    on_host = joint.split({name: t.cpu() for name, t in joint.tensors.items()})  # as the package writers cut it
    for together, package, host in zip(stored, packages, on_host, strict=True):
        alone = pack(package, storage_dtype, "token", device)  # type: ignore[arg-type]
        for name, t in together.tensors().items():
            expected = alone.tensors()[name]
            assert t.is_contiguous() and t.untyped_storage().nbytes() == t.numel() * t.element_size()
            assert torch.equal(t.view(torch.uint8), expected.contiguous().view(torch.uint8)), name
            assert torch.equal(host[name].view(torch.uint8), expected.cpu().contiguous().view(torch.uint8)), name


def test_download_waits_for_the_stream_and_lands_in_pinned_memory() -> None:
    """The read-back of the LM's vectors: queued behind a long product, it still returns that product's
    values (the event wait is real), in pinned memory."""
    from rubricsearch.retrieval.qwen.engine.forward import download

    x = torch.randn(4096, 4096, device="cuda")
    for _ in range(8):  # keep the stream busy well past the copy's launch
        x = torch.tanh(x @ x)
    got = download(x.sum(dim=1))
    snapshot = got.clone()  # taken at once: a copy still in flight would leave other values here
    assert torch.cuda.current_stream().query()  # nothing queued before the return is still running
    assert got.is_pinned() and torch.equal(snapshot, x.sum(dim=1).cpu())


def _cudnn_expected(cudnn_attention: Any) -> None:
    """A Hopper GPU must have taken cuDNN (a bug that made every call refuse would otherwise skip, not fail)."""
    if not cudnn_attention.usable():
        if torch.cuda.get_device_capability() >= (9, 0):
            pytest.fail(f"cuDNN attention refused on a compute capability 9+ GPU: {cudnn_attention.CUDNN}")
        pytest.skip("this GPU or build has no cuDNN attention (the tower keeps FlashAttention)")


def test_flash_one_query_per_segment_with_an_empty_key_segment() -> None:
    """The final layer's form (one query per sequence, grouped-query heads) where a pad row has no keys: the real
    segments equal the reference loop and the pad's output is finite (FlashAttention: 0, log-sum-exp +inf)."""
    from rubricsearch.retrieval.plugins.accelerated.packed import Segments, merge_attention, varlen_attention

    gen = torch.Generator(device="cpu").manual_seed(4)
    lengths_k = [7, 0, 3]
    q = torch.randn(3, 4, 64, generator=gen)
    k, v = (torch.randn(sum(lengths_k), 2, 64, generator=gen) for _ in range(2))
    pk, pv = (torch.randn(5, 2, 64, generator=gen) for _ in range(2))
    args = {"causal": True, "scale": 0.125}
    sq, sk, sp = (Segments.of(n, torch.device("cuda")) for n in ([1, 1, 1], lengths_k, [5]))
    whole = Segments.of([3], torch.device("cuda"))
    gpu = [t.to("cuda", torch.bfloat16) for t in (q, k, v, pk, pv)]
    own = varlen_attention(gpu[0], gpu[1], gpu[2], sq, sk, **args)
    got = merge_attention(own, varlen_attention(gpu[0], gpu[3], gpu[4], whole, sp, causal=False, scale=0.125))
    want = merge_attention(varlen_attention(q, k, v, sq, sk, **args),
                           varlen_attention(q, pk, pv, whole, sp, causal=False, scale=0.125))
    assert torch.isfinite(got).all() and torch.isfinite(own[0]).all()
    for row in (0, 2):  # the rows with keys of their own
        assert (got[row].float().cpu() - want[row]).abs().max().item() < 3e-2


def _packed_attention(lengths: list[int], min_tokens: int, monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    """The grouped attention over random packed images of ``lengths`` with cuDNN taking runs from ``min_tokens``."""
    from rubricsearch.retrieval.plugins.accelerated import tower_attention

    monkeypatch.setattr(tower_attention, "CUDNN_MIN_TOKENS", min_tokens)
    monkeypatch.setattr(tower_attention, "SEEN", set(lengths))  # sizes met before: cuDNN from the first call
    gen = torch.Generator(device="cpu").manual_seed(3)
    q, k, v = (torch.randn(1, 4, sum(lengths), 64, generator=gen).to("cuda", torch.bfloat16) for _ in range(3))
    tower_attention.RUNS.runs = tower_attention.runs_of(lengths)
    try:
        out, _ = tower_attention.grouped_attention(None, q, k, v, scaling=0.125)
    finally:
        tower_attention.RUNS.runs = None
    return out


def test_photo_runs_take_cudnn_and_equal_flash_attention(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs of long images go to cuDNN, shorter runs between them to FlashAttention, and the outputs stay in token
    order: equal to all-FlashAttention within bf16 rounding (a block at a wrong offset would differ by O(1))."""
    from rubricsearch.retrieval.plugins.accelerated import tower_attention
    from rubricsearch.retrieval.plugins.accelerated.kernels import cudnn_attention

    lengths = [16, 16, 256, 256, 256, 64, 300, 300, 16]  # short run, long run, short, long, short
    flash = _packed_attention(lengths, 1 << 30, monkeypatch)
    calls = cudnn_attention.CUDNN["calls"]
    mixed = _packed_attention(lengths, 256, monkeypatch)
    _cudnn_expected(cudnn_attention)
    assert cudnn_attention.CUDNN["calls"] == calls + 3  # the runs of 256 (as 2 + 1 images) and of 300
    assert tower_attention.cudnn_blocks(tower_attention.runs_of(lengths), 256) == [
        (False, [(0, 16, 2)]), (True, [(32, 256, 2)]), (True, [(544, 256, 1)]), (False, [(800, 64, 1)]),
        (True, [(864, 300, 2)]), (False, [(1464, 16, 1)])]
    assert mixed.shape == flash.shape
    diff = (mixed.float() - flash.float()).abs().max().item()
    print(f"cuDNN blocks vs FlashAttention: max |delta| {diff:.2e}")
    assert diff < 2e-2


def test_photo_runs_through_cudnn_give_the_packages_of_flash_attention(
        tiny_embedding_dir: Path, make_png: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    from rubricsearch.retrieval.plugins.accelerated import tower_attention
    from rubricsearch.retrieval.plugins.accelerated.kernels import cudnn_attention

    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype="bfloat16")
    images = [decode_image(make_png(w, h, seed)) for w, h, seed in ((256, 256, 1), (256, 256, 2), (96, 64, 3))]
    monkeypatch.setattr(tower_attention, "CUDNN_MIN_TOKENS", 1 << 30)
    flash = AcceleratedVisionEncoder(loaded, grouped_attention=True).encode(images)
    calls = cudnn_attention.CUDNN["calls"]
    monkeypatch.setattr(tower_attention, "CUDNN_MIN_TOKENS", 256)  # the 256 px images' 256 patches
    monkeypatch.setattr(tower_attention, "SEEN", {256})  # a size met before
    photos = AcceleratedVisionEncoder(loaded, grouped_attention=True).encode(images)
    _cudnn_expected(cudnn_attention)
    assert cudnn_attention.CUDNN["calls"] > calls
    _close(photos, flash, 0.999)


def test_fused_swiglu_is_the_transformers_mlp_bit_for_bit(tiny_embedding_dir: Path) -> None:
    pytest.importorskip("liger_kernel", reason="the fused kernels come with the gpu extra (liger-kernel)")
    loaded = load_qwen(tiny_embedding_dir, device="cuda", dtype="bfloat16")
    accelerate(loaded, LocalConfig(fused_kernels=True))
    mlp = loaded.model.language_model.layers[0].mlp
    assert "forward" in vars(mlp)  # switched on this module
    x = torch.randn(2, 37, mlp.gate_proj.in_features, device="cuda", dtype=torch.bfloat16)
    with torch.inference_mode():
        fused = mlp(x)
        plain = type(mlp).forward(mlp, x)  # transformers' own forward, the instance's patch bypassed
    assert torch.equal(fused, plain)
    assert not torch.equal(fused, mlp.down_proj(mlp.gate_proj(x) * mlp.up_proj(x)))  # not a product without SiLU

