"""Hostile images through the embedder and reranker: a correct embedding or a typed error, never a crash."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from rubricsearch.rerank import load_reranker
from rubricsearch.retrieval import load_embedder
from rubricsearch.retrieval.errors import ImageError, RubricSearchError
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.packages import PackageStore
from tests import fixtures_images as fx

VALID: dict[str, Callable[[], bytes]] = {
    "1x1": fx.png_1x1,
    "cmyk_jpeg": fx.cmyk_jpeg,
    "png_16bit": fx.png_16bit,
    "palette_alpha": fx.palette_alpha_png,
    "exif_rotated": fx.exif_rotated_jpeg,
    "animated_gif": fx.animated_gif,
    "jpeg_trailing_html": fx.jpeg_with_trailing_html,
}
INVALID: dict[str, Callable[[], bytes]] = {
    "zero_bytes": fx.zero_bytes,
    "truncated_jpeg": fx.truncated_jpeg,
    "png_100000x100000_header": fx.png_huge_header,
    "non_image": fx.non_image_bytes,
    "gif_js_polyglot": fx.gif_js_polyglot,
}


@pytest.fixture(scope="module")
def embedder(tiny_embedding_dir: Path):
    return load_embedder(str(tiny_embedding_dir), store=PackageStore(storage_dtype="float32"))


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(VALID))
def test_odd_but_valid_images_embed(embedder, name: str) -> None:
    data = VALID[name]()
    vec = embedder.embed([{"image": data, "text": "x"}])
    assert vec.shape == (1, embedder.dimension) and np.isfinite(vec).all()
    np.testing.assert_allclose(np.linalg.norm(vec), 1.0, atol=1e-5)
    # what the model saw is the decoded RGB image; EXIF orientation 6 turns 60x40 upright to 40x60
    if name == "exif_rotated":
        assert decode_image(data).image.size == (40, 60)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("name", sorted(INVALID))
def test_invalid_images_are_typed_errors(embedder, tiny_reranker_dir: Path, name: str) -> None:
    data = INVALID[name]()
    try:
        decode_image(data)
    except RubricSearchError:
        pass
    else:  # the fixture is meant to be unreadable
        pytest.skip(f"{name} decodes on this Pillow")
    with pytest.raises(ImageError):
        embedder.embed([{"image": data}])
    # the process and the model are fine afterwards
    assert embedder.embed([{"text": "still alive"}]).shape == (1, embedder.dimension)
    rr = load_reranker(str(tiny_reranker_dir), store=PackageStore(storage_dtype="float32"))
    with pytest.raises(ImageError):
        rr.score("q", [{"image": data}])
