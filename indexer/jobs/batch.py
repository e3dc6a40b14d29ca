"""A claimed batch between the stages of :mod:`indexer.jobs.pipeline`; a module of its own so that the stages
and the helpers they use (:mod:`indexer.jobs.sizing`) can both name it without importing each other."""

from __future__ import annotations

from dataclasses import dataclass

from rubricsearch.indexer.catalog import ItemRecord
from rubricsearch.indexer.jobs.commit import Unit
from rubricsearch.retrieval.packages import Made, Preparation


@dataclass(eq=False)
class Batch:
    """A claimed batch between stages: ``prepared`` holds pixels preprocessed ahead of the tower, ``made``
    the packages the towers made until they are stored."""

    items: list[ItemRecord]
    units: list[Unit]
    beat: list[float]
    prepared: Preparation | None = None
    made: Made | None = None
    claim_no: int = -1  # for a runner that has several batches in flight

    def working(self) -> list[Unit]:
        return [u for u in self.units if u.working]
