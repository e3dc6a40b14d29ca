"""Fine-tuning the reranker from a set's judgments and cached packages: one trainer, through the inference forward."""

from rubricsearch.rerank.tuning.cells import JudgedCell, split_by_reference
from rubricsearch.rerank.tuning.trainer import Metrics, Progress, Tuned, TuningSettings, fine_tune_reranker
from rubricsearch.rerank.tuning.version import CARD, save_version

__all__ = ["CARD", "JudgedCell", "Metrics", "Progress", "Tuned", "TuningSettings", "fine_tune_reranker",
           "save_version", "split_by_reference"]
