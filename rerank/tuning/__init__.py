"""Fine-tuning the reranker from a set's judgments and cached packages: one trainer, through the inference forward.

The names load on first use (PEP 562), so the CLI can read :class:`TuningSettings`' defaults without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricsearch.rerank.tuning.cells import JudgedCell, split_by_reference
    from rubricsearch.rerank.tuning.settings import TuningSettings
    from rubricsearch.rerank.tuning.trainer import Metrics, Progress, Tuned, fine_tune_reranker
    from rubricsearch.rerank.tuning.version import CARD, save_version

_WHERE = {"JudgedCell": "cells", "split_by_reference": "cells", "TuningSettings": "settings", "Metrics": "trainer",
          "Progress": "trainer", "Tuned": "trainer", "fine_tune_reranker": "trainer", "CARD": "version",
          "save_version": "version"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_WHERE[name]}"), name)


__all__ = ["CARD", "JudgedCell", "Metrics", "Progress", "Tuned", "TuningSettings", "fine_tune_reranker",
           "save_version", "split_by_reference"]
