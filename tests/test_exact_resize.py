"""The tiled resize (each pass one gather and one batched float64 product) gives Pillow's bicubic pixels bit for bit
where its tiling is stressed: outputs that are not a multiple of the tile (a ragged last tile, padded and dropped),
windows clamped at the image's ends, windows longer than the image (upscaling small sides), 1-pixel and prime
sides, aspect ratios far beyond any photo's, 12-megapixel shapes, batches, and both of Pillow's pass orders.
Pixels are random noise (its bicubic overshoot must be clipped), compared with ``PIL.Image.resize`` itself.
The arithmetic of each step (offset, clip, weights, pass order) is pinned by tests/test_exact_preprocess.py too.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from rubricsearch.retrieval.plugins.accelerated.exact_resize import (
    PILLOW,
    TILE,
    band,
    coefficients,
    horizontal_first,
    resize,
)

# (height, width) -> (height, width), each naming what of the tiling it stresses
CASES = [
    ((300, 700), (300, TILE)),  # exactly one full tile
    ((300, 700), (300, 2 * TILE + 1)),  # a last tile of one output
    ((300, 700), (300, 3 * TILE - 1)),  # a last tile one short
    ((997, 331), (331, 997)),  # prime sides, one shrinks and one grows (vertical first in Pillow 13)
    ((211, 1009), (89, 1013)),  # prime sides, a slight upscale beside a shrink
    ((37, 23), (224, 224)),  # upscaling: the window of a tile is longer than the image, clamped to it
    ((100, 100), (1000, 1000)),  # upscaling over many tiles, windows clamped at both ends
    ((1, 1), (32, 32)),  # a single pixel grows
    ((1, 500), (1, 97)),  # a 1-pixel height kept: the horizontal pass alone
    ((500, 1), (131, 1)),  # a 1-pixel width kept: the vertical pass alone
    ((777, 3), (1, 1)),  # down to a single pixel: one tile of one output whose window is the whole side
    ((5, 4000), (32, 1024)),  # an 800:1 strip, height up and width down
    ((4000, 5), (1024, 32)),  # its transpose
    ((2, 2999), (64, 2987)),  # a 2-pixel side grows while a prime side barely shrinks
]


def _noise(height: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)


def _pillow(arr: np.ndarray, size: tuple[int, int]) -> np.ndarray:
    return np.asarray(Image.fromarray(arr).resize((size[1], size[0])))


def _ours(arr: np.ndarray, size: tuple[int, int], device: str = "cpu") -> np.ndarray:
    x = torch.from_numpy(arr).to(device).permute(2, 0, 1).contiguous()
    return resize(x, size).permute(1, 2, 0).cpu().numpy()


def _assert_same(got: np.ndarray, want: np.ndarray, what: object) -> None:
    assert got.shape == want.shape, what
    delta = np.abs(got.astype(np.int16) - want.astype(np.int16))
    assert delta.max() == 0, f"{what}: {int((delta > 0).sum())} values differ, max |delta| {int(delta.max())}"


@pytest.mark.parametrize("source,target", CASES)
def test_tiled_resize_is_pillows(source: tuple[int, int], target: tuple[int, int]) -> None:
    arr = _noise(*source, seed=source[0] * 31 + target[1])
    _assert_same(_ours(arr, target), _pillow(arr, target), (source, target))


def test_the_cases_cover_both_pass_orders_and_ragged_tiles() -> None:
    """The cases above stress what they claim: both of Pillow's orders, and last tiles of several fill levels."""
    orders = {horizontal_first(*s, *t) for s, t in CASES if s[0] != t[0] and s[1] != t[1]}
    assert orders == {True, False}
    fills = {side % TILE for _, t in CASES for side in t if side > TILE}
    assert {0, 1, TILE - 1} <= fills


def test_window_covers_every_tap_and_the_offset_row() -> None:
    """Per tile, the weights sum to one in fixed point (each output's taps all fell inside its tile's window) and
    the last row is the rounding offset; the window never reads past the image."""
    for in_size, out_size in ((4000, 1568), (3000, 1184), (37, 224), (1009, 1013), (3, 1), (1, 32)):
        index, weights = band(in_size, out_size)
        window = index.shape[1]
        assert int(index.min()) >= 0 and int(index.max()) < in_size
        scaled = weights[:, :window] * float(1 << 22)
        assert torch.equal(scaled, scaled.round())  # integers once scaled back: exact in float64
        sums = scaled.sum(dim=1).flatten()[:out_size]
        assert torch.all((sums - (1 << 22)).abs() <= coefficients(in_size, out_size)[2].shape[1] / 2)
        assert torch.all(weights[:, window] == 0.5)


def test_random_large_sizes_match_pillow() -> None:
    """Sizes drawn at random up to several tiles per side (the seed fixed): no hand-picked case hides a tiling."""
    rng = np.random.default_rng(3636)
    orders = set()
    for _ in range(12):
        h, w, oh, ow = (int(v) for v in rng.integers(1, 700, 4))
        orders.add(horizontal_first(h, w, oh, ow))
        arr = _noise(h, w, seed=h + w * oh)
        _assert_same(_ours(arr, (oh, ow)), _pillow(arr, (oh, ow)), ((h, w), (oh, ow)))
    assert orders == {True, False}


def test_a_batch_is_each_image_alone() -> None:
    """The product resizes a group of same-size images in one call: leading axes are rows of the same product."""
    images = [_noise(333, 517, seed) for seed in range(3)]
    batch = torch.stack([torch.from_numpy(a).permute(2, 0, 1) for a in images])
    got = resize(batch, (150, 250))
    for k, arr in enumerate(images):
        _assert_same(got[k].permute(1, 2, 0).numpy(), _pillow(arr, (150, 250)), k)


TWELVE_MP = [((3000, 4000), (1152, 1536), True), ((4032, 3024), (1536, 1152), True), ((8000, 1500), (3104, 576), False)]


@pytest.mark.parametrize("source,target,horizontal", TWELVE_MP)
def test_twelve_megapixel_shapes(source: tuple[int, int], target: tuple[int, int], horizontal: bool) -> None:
    """12-MP images to the model's default size (smart_resize, max_pixels 1,843,200): 4:3 landscape and portrait
    (horizontal pass first) and a tall 16:3 strip (vertical first in Pillow 13)."""
    from qwen_vl_utils.vision_process import smart_resize

    assert smart_resize(*source, factor=32, min_pixels=4096, max_pixels=1_843_200) == target
    assert horizontal_first(*source, *target) == horizontal or PILLOW < (13, 0)
    arr = _noise(*source, seed=source[0])
    _assert_same(_ours(arr, target), _pillow(arr, target), (source, target))


@pytest.mark.parametrize("pillow,order", [
    ((13, 0), ["h", "v", "v", "h", "h"]),
    ((12, 2), ["h", "h", "v", "h", "v"]),  # Image.resize's own rule (python-pillow/Pillow#9524)
    ((12, 1), ["h", "h", "h", "h", "h"]),
])
def test_pass_order_follows_the_installed_pillow(pillow: tuple[int, int], order: list[str]) -> None:
    """The order rule of each Pillow line: a 800:1 strip is where 12.2's rule and 13's first differ from always
    horizontal-first (a GPU box with Pillow 12.3 found it), a 2x height shrink where 13's alone does, a tall strip
    losing a row where 12.2's alone does."""
    cases = [((300, 400), (117, 155)), ((240, 100), (60, 90)), ((4000, 5), (1024, 32)), ((5, 4000), (32, 1024)),
             ((1000, 9), (999, 1))]
    got = ["h" if horizontal_first(*s, *t, pillow=pillow) else "v" for s, t in cases]
    assert got == order


def test_the_strip_matches_pillow_by_its_own_rule() -> None:
    """The installed Pillow's result for the strip equals ours under the rule for its version (on any version)."""
    arr = _noise(4000, 5, seed=5)
    _assert_same(_ours(arr, (1024, 32)), _pillow(arr, (1024, 32)), PILLOW)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_gives_pillows_pixels() -> None:
    """On CUDA the products run as cuBLAS float64 GEMMs (the H100's FP64 tensor cores): the same integers."""
    for source, target in [*CASES, *((s, t) for s, t, _ in TWELVE_MP)]:
        arr = _noise(*source, seed=source[1])
        _assert_same(_ours(arr, target, "cuda"), _pillow(arr, target), (source, target))
    images = [_noise(1000, 750, seed) for seed in range(4)]
    batch = torch.stack([torch.from_numpy(a).permute(2, 0, 1) for a in images]).cuda()
    got = resize(batch, (640, 480)).cpu()
    for k, arr in enumerate(images):
        _assert_same(got[k].permute(1, 2, 0).numpy(), _pillow(arr, (640, 480)), k)
