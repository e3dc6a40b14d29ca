"""One budget of decoded pixels for the whole process: searches, embeddings, reranks, visual packages and
ingestion batches hold their images' pixels from it while they decode and preprocess.

A small compressed file can decode to a large image (an 8000 x 8000 PNG is 200 KB on the wire, and PIL holds
several copies of its pixels while it decodes and converts it), so memory follows decoded pixels, not bytes. Every
caller asks for the pixels its images' headers declare, before decoding any of them: requests wait briefly for room
and are then refused with :class:`~retrieval.errors.Overloaded` (503 with Retry-After); ingestion waits as long as
it takes. One request never holds more than the whole budget, so a single image up to the per-image limit always
gets its turn. Callers acquire once per request or per claimed batch, never inside the tower or LM loops.
"""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager

from rubricsearch.retrieval.errors import Overloaded
from rubricsearch.retrieval.images import DecodedImage, EncodedImage, ImageLike, inspect_image


class PixelBudget:
    """A counting semaphore of pixels; :meth:`hold` is the only way in."""

    def __init__(self, total: int, wait_s: float = 2.0) -> None:
        self.total = total
        self.wait_s = wait_s
        self.used = 0
        self.refused = 0
        self._cond = threading.Condition()

    @contextmanager
    def hold(self, pixels: int, *, wait_s: float | None = None) -> Iterator[int]:
        """Hold ``pixels`` (at most the whole budget) for the block; waits up to ``wait_s`` (default: the budget's;
        ``math.inf``: as long as it takes), then raises :class:`Overloaded`. Yields the pixels held."""
        need = min(max(0, pixels), self.total)
        if need == 0:
            yield 0
            return
        deadline = time.monotonic() + (self.wait_s if wait_s is None else wait_s)
        with self._cond:
            while self.used + need > self.total:
                left = deadline - time.monotonic()
                if left <= 0:
                    self.refused += 1
                    raise Overloaded("too many image pixels are being decoded; retry shortly", retry_after_s=1,
                                     pixels=pixels, budget=self.total)
                self._cond.wait(None if math.isinf(left) else left)
            self.used += need
        try:
            yield need
        finally:
            with self._cond:
                self.used -= need
                self._cond.notify_all()


def declared_pixels(images: Iterable[ImageLike]) -> int:
    """The pixels the images' headers declare (as stored), read without decoding: an image not decoded yet is
    inspected (its bytes are read for that); a decoded one counts its size."""
    total = 0
    for img in images:
        if isinstance(img, EncodedImage | DecodedImage):
            total += img.width * img.height
            continue
        try:
            info = inspect_image(img.data, max_bytes=math.inf, max_pixels=math.inf)  # type: ignore[arg-type]
        except Exception:  # the decoder reports what is wrong with it, as without a budget
            continue
        total += info.width * info.height
    return total


@contextmanager
def holding(budget: PixelBudget | None, images: Iterable[ImageLike], *, wait_s: float | None = None,
            ) -> Iterator[int]:
    """:meth:`PixelBudget.hold` for the images' declared pixels; nothing without a budget."""
    if budget is None:
        yield 0
        return
    with budget.hold(declared_pixels(images), wait_s=wait_s) as held:
        yield held
