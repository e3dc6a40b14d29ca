"""Calibrations in the catalog (SQLite and, when configured, PostgreSQL): versions per set, the latest read back
whole, staleness against the set's judgments, and the cascade when the set goes."""

from __future__ import annotations

import hashlib
from dataclasses import replace
from datetime import UTC, datetime

import numpy as np
import pytest

import rubricsearch.indexer.catalog as cat
from rubricsearch.indexer.catalog import Catalog, JudgmentSpec, SetRecord
from rubricsearch.indexer.catalog.calibrations import latest_calibration, save_calibration, staleness
from rubricsearch.rerank.calibration import Calibration, fit
from rubricsearch.retrieval.errors import NotFound


def _fit(n: int, max_id: int, seed: int = 0) -> Calibration:
    rng = np.random.default_rng(seed)
    raw = rng.random(n)
    labels = rng.random(n) < raw
    return fit(raw, labels, [f"r{i % 20}" for i in range(n)], [f"c{i % 3}" for i in range(n)], model_key="m@1",
               max_judgment_id=max_id, fitted_at=datetime(2026, 12, 6, tzinfo=UTC))


def test_versions_grow_per_set_and_the_latest_reads_back_whole(catalog: Catalog, reference_set: SetRecord) -> None:
    with catalog.write() as s:
        other = cat.create_set(s, "other")
        assert latest_calibration(s, reference_set.id) is None
        first = save_calibration(s, reference_set.id, _fit(200, 200, seed=1))
        second = save_calibration(s, reference_set.id, _fit(300, 300, seed=2))
        elsewhere = save_calibration(s, other.id, _fit(100, 100, seed=3))
    assert (first.version, second.version, elsewhere.version) == (1, 2, 1)
    with catalog.read() as s:
        assert latest_calibration(s, reference_set.id) == second
        assert latest_calibration(s, other.id) == elsewhere
    with catalog.write() as s:
        cat.delete_set(s, other.id)
    with catalog.read() as s:
        assert latest_calibration(s, other.id) is None
    with catalog.write() as s, pytest.raises(NotFound):
        save_calibration(s, "no-such-set", _fit(100, 100))


def test_staleness_counts_judgments_recorded_and_gone_since_the_fit(catalog: Catalog, reference_set: SetRecord
                                                                   ) -> None:
    with catalog.write() as s:
        image = cat.add_image(s, reference_set.id, sha256=hashlib.sha256(b"x").hexdigest(), byte_size=1,
                              source="upload")[0]
        judged = cat.record_judgments(s, reference_set.id, [JudgmentSpec(image.id, f"c{i}", i % 2 == 0)
                                                            for i in range(4)])
        fitted = save_calibration(s, reference_set.id, replace(_fit(100, 0), judgments=4,
                                                               max_judgment_id=max(j.id for j in judged)))
        assert not staleness(s, reference_set.id, fitted).stale
        cat.record_judgments(s, reference_set.id, [JudgmentSpec(image.id, "c0", False),  # replaced: new id
                                                   JudgmentSpec(image.id, "c9", True)])
        cat.delete_judgment(s, reference_set.id, judged[1].id)
        moved = staleness(s, reference_set.id, fitted)
    assert (moved.new, moved.gone, moved.stale) == (2, 2, True)
