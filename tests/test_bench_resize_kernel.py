"""bench/resize_kernel.py starts, runs the product's settings (one changed by ``--set``), times both methods and
finds them identical: a tiny CPU run, so an import or flag that breaks fails the suite (timings are not checked)."""

from __future__ import annotations

from tests.test_bench_smoke import NUMBER, bench, numbers, settings_of


def test_resize_kernel_bench_runs_and_finds_no_difference() -> None:
    out = bench("resize_kernel.py", "--device", "cpu", "--images", "3", "--repeats", "1", "--width", "900",
                "--height", "600", "--set", "models.max_pixels=131072", timeout=300)
    printed = settings_of(out)
    assert printed["models.max_pixels"] == "131072*" and printed["models.engine"] == "auto"
    assert printed["device_in_use"] == "cpu"
    width, height, out_w, out_h, n, per_call = numbers(
        rf"resize {NUMBER}x{NUMBER} -> {NUMBER}x{NUMBER} \(\w+ first\): {NUMBER} images, {NUMBER} per call", out)
    assert (width, height, n) == (900, 600, 3) and out_w * out_h <= 131072 and out_w < width and per_call >= 3
    former = numbers(rf"per-tap int32 ops \(former\)\s+{NUMBER} ms/image", out)[0]
    product = numbers(rf"tiled float64 GEMM \(product\)\s+{NUMBER} ms/image", out)[0]
    assert former > 0 and product > 0
    ratio, delta, delta_pil = numbers(rf"ratio former/product: {NUMBER}x\s+max \|delta\| former vs product: "
                                      rf"{NUMBER}\s+product vs PIL \(image 0\): {NUMBER}", out)
    assert ratio > 0 and delta == 0 and delta_pil == 0
