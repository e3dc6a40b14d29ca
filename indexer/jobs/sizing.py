"""How many of its claimed items a batch keeps: as many as its images' pixels (read from their headers, before
anything is decoded) fit in ``batch_pixels``, from a run's first claim on. Claims are sized ahead by the last
batch's images (:func:`indexer.jobs.runner.claim_limit`), which a batch of larger images can outgrow; the items
over the bound go back to pending at once, for the next claim."""

from __future__ import annotations

import threading

from indexer.catalog import Catalog, release_items
from indexer.jobs.batch import Batch


class Seen(threading.local):
    def __init__(self) -> None:
        self.pixels: list[int] = []  # each image's size (as stored) in the last batch the thread prepared


def fit(batch: Batch, batch_pixels: int | None, catalog: Catalog, worker_id: str) -> None:
    """Cut ``batch`` after the last item whose images fit ``batch_pixels`` (always keeping the first) and hand the
    others back to pending in ``catalog``; no bound when ``batch_pixels`` is 0 or None."""
    if not batch_pixels:
        return
    pixels = 0
    for k, u in enumerate(batch.units):
        pixels += u.decoded.width * u.decoded.height if u.decoded is not None and u.working else 0
        if k and pixels > batch_pixels:
            handed = {x.item.id for x in batch.units[k:]}
            del batch.units[k:]
            batch.items = [i for i in batch.items if i.id not in handed]
            with catalog.write() as s:
                release_items(s, worker_id, sorted(handed), unattempted=True)
            return
