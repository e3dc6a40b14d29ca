"""How many items a claim takes and a batch keeps: as many as its images' pixels (read from their headers, before
anything is decoded) fit in ``batch_pixels``, from a run's first claim on. Claims are sized ahead by the last
batch's images (:func:`claim_limit`), which a batch of larger images can outgrow; the items over the bound go
back to pending at once, for the next claim (:func:`fit`), except URL items whose fetched bytes the fetch-ahead
stages again (so they are not fetched twice)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from rubricsearch.indexer.catalog import Catalog, ItemRecord, JobRecord, release_items
from rubricsearch.indexer.jobs.batch import Batch
from rubricsearch.retrieval.images import EncodedImage

FIRST_CLAIM = 8  # items in a run's first claim under a pixel budget, before any of its image sizes is known
# items handed back with their loaded bytes -> the ids staged again, still claimed (FetchAhead.restage)
Restage = Callable[[list[tuple[ItemRecord, JobRecord, bytes]]], set[int]]


def claim_limit(batch_size: int, batch_pixels: int | None, last_pixels: list[int]) -> int:
    """Items the next claim takes: ``batch_size``, fewer where the images of the last batch this run prepared
    (pixels each, as stored: the header's size, before any resize) would take a batch over ``batch_pixels``.

    A batch is the pipeline's unit (indexer/jobs/overlap.py): while one is in the towers the next is decoded
    and an earlier one committed. 64 items suit small images; 64 photos claimed at once would be one batch with
    nothing to overlap it, and a few large batches leave the pipeline's fill and drain unhidden, so photos are
    claimed a few at a time."""
    if not batch_pixels:
        return batch_size
    if not last_pixels:
        return min(batch_size, FIRST_CLAIM)
    per_item = max(1.0, sum(last_pixels) / len(last_pixels))
    return max(1, min(batch_size, int(batch_pixels // per_item)))


class Seen(threading.local):
    def __init__(self) -> None:
        self.pixels: list[int] = []  # each image's size (as stored) in the last batch the thread prepared


def fit(batch: Batch, batch_pixels: int | None, catalog: Catalog, worker_id: str,
        restage: Restage | None = None) -> None:
    """Cut ``batch`` after the last item whose images fit ``batch_pixels`` (always keeping the first) and hand the
    others back: to ``restage`` those with loaded bytes, and what it does not keep to pending in ``catalog``; no
    bound when ``batch_pixels`` is 0 or None."""
    if not batch_pixels:
        return
    pixels = 0
    for k, u in enumerate(batch.units):
        pixels += u.decoded.width * u.decoded.height if u.decoded is not None and u.working else 0
        if k and pixels > batch_pixels:
            over = batch.units[k:]
            del batch.units[k:]
            handed = {x.item.id for x in over}
            batch.items = [i for i in batch.items if i.id not in handed]
            loaded = [(x.item, x.job, x.decoded.data) for x in over if isinstance(x.decoded, EncodedImage)]
            released = sorted(handed - (restage(loaded) if restage is not None and loaded else set()))
            if released:
                with catalog.write() as s:
                    release_items(s, worker_id, released, unattempted=True)
            return
