"""Fine-tuning the reranker from a set's judgments and cached packages: one trainer, through the inference forward;
what it shares with the embedder's fine-tune lives in :mod:`retrieval.tuning`.

The names load on first use (PEP 562), so the CLI can read :class:`TuningSettings`' defaults without torch."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from rubricsearch.rerank.tuning.cells import split_by_reference
    from rubricsearch.rerank.tuning.trainer import Metrics, Tuned, fine_tune_reranker
    from rubricsearch.rerank.tuning.version import save_version
    from rubricsearch.retrieval.tuning.judgments import JudgedCell
    from rubricsearch.retrieval.tuning.loop import Progress
    from rubricsearch.retrieval.tuning.settings import TuningSettings
    from rubricsearch.retrieval.tuning.version import CARD

_SHARED = "rubricsearch.retrieval.tuning"  # what the embedder's fine-tune uses too
_WHERE = {"JudgedCell": f"{_SHARED}.judgments", "split_by_reference": f"{__name__}.cells",
          "TuningSettings": f"{_SHARED}.settings", "Metrics": f"{__name__}.trainer", "Progress": f"{_SHARED}.loop",
          "Tuned": f"{__name__}.trainer", "fine_tune_reranker": f"{__name__}.trainer", "CARD": f"{_SHARED}.version",
          "save_version": f"{__name__}.version"}


def __getattr__(name: str) -> Any:
    if name not in _WHERE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(_WHERE[name]), name)


__all__ = ["CARD", "JudgedCell", "Metrics", "Progress", "Tuned", "TuningSettings", "fine_tune_reranker",
           "save_version", "split_by_reference"]
