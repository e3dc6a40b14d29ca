"""The accelerated local runtime: the plain :class:`~retrieval.runtime.local.LocalRuntime` with CUDA graphs.

On a GPU, small LM passes (a search's candidate, an instruction list) and small vision-tower batches replay
captured CUDA graphs; with ``bulk_graphs`` ingestion's large passes do too, once their bucketed key comes a third
time. Outputs equal the plain runtime's within the kernels' rounding (tests/test_gpu.py). Off a GPU it is the
plain runtime.
"""

from __future__ import annotations

from rubricsearch.retrieval.qwen.engine.graphed_lm import BULK_TOKENS, GraphedLM
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.local import LocalRuntime


class AcceleratedRuntime(LocalRuntime):
    """:class:`LocalRuntime` whose tower and LM replay CUDA graphs where the configuration asks for them."""

    def replays_graphs(self, config: LocalConfig) -> bool:
        return config.cuda_graphs

    def vision_encoder(self, loaded: LoadedQwen, config: LocalConfig, vision_config: VisionConfig) -> VisionEncoder:
        return VisionEncoder(loaded, min_pixels=vision_config.min_pixels, max_pixels=vision_config.max_pixels,
                             preprocess=vision_config.preprocess, cuda_graphs=config.cuda_graphs,
                             bulk_graphs=config.bulk_graphs)

    def lm_graphs(self, config: LocalConfig) -> GraphedLM | None:
        if not self.cuda_graphs:
            return None
        return GraphedLM(self.loaded, self.pad_id, bulk_tokens=BULK_TOKENS if config.bulk_graphs else 0)
