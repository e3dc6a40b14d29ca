"""The accelerated local runtime: the plain :class:`~retrieval.runtime.local.LocalRuntime` with the GPU paths.

It switches the checkpoint to the fused kernels and compiles its blocks where the configuration asks
(:mod:`.model`); its vision tower is the :class:`~.vision.AcceleratedVisionEncoder` (preprocessing on the GPU,
all images of a pass in one attention call, CUDA graphs); LM passes run packed where FlashAttention's
variable-length kernel works (:mod:`.packed`), and small ones (a search's candidate, an instruction list) replay
captured CUDA graphs, as ingestion's large ones do with ``bulk_graphs`` once their bucketed key comes a third
time (:mod:`.graphed_lm`). Outputs equal the plain runtime's within the kernels' rounding (tests/test_gpu.py).
Off a GPU it runs the plain passes.
"""

from __future__ import annotations

from rubricsearch.retrieval.packages import VisualPackages
from rubricsearch.retrieval.plugins.accelerated.graphed_lm import BULK_TOKENS, GraphedLM
from rubricsearch.retrieval.plugins.accelerated.model import accelerate
from rubricsearch.retrieval.plugins.accelerated.packed import flash_varlen_works, last_token_states
from rubricsearch.retrieval.plugins.accelerated.vision import AcceleratedVisionEncoder
from rubricsearch.retrieval.qwen.engine.batching import LMPass
from rubricsearch.retrieval.qwen.engine.vision import VisionEncoder
from rubricsearch.retrieval.qwen.model.loading import LoadedQwen
from rubricsearch.retrieval.runtime.config import LocalConfig, VisionConfig
from rubricsearch.retrieval.runtime.local import LocalRuntime


class AcceleratedRuntime(LocalRuntime):
    """:class:`LocalRuntime` with fused kernels, compiled blocks, packed passes and CUDA graphs where the
    configuration asks for them and they can run."""

    compile_language = True  # the reranker's LM passes go through a KV cache: its runtime compiles its tower alone

    def __init__(self, loaded: LoadedQwen, config: LocalConfig, vision_config: VisionConfig, *, role: str,
                 packages: VisualPackages | None = None, vision: VisionEncoder | None = None) -> None:
        accelerate(loaded, config, language=self.compile_language)
        super().__init__(loaded, config, vision_config, role=role, packages=packages, vision=vision)

    def replays_graphs(self, config: LocalConfig) -> bool:
        return config.cuda_graphs

    def vision_encoder(self, loaded: LoadedQwen, config: LocalConfig, vision_config: VisionConfig) -> VisionEncoder:
        return AcceleratedVisionEncoder(loaded, min_pixels=vision_config.min_pixels,
                                        max_pixels=vision_config.max_pixels, preprocess=vision_config.preprocess,
                                        cuda_graphs=config.cuda_graphs, bulk_graphs=config.bulk_graphs)

    def lm_pass(self) -> LMPass:
        return last_token_states if flash_varlen_works(self.loaded) else super().lm_pass()

    def lm_graphs(self, config: LocalConfig) -> GraphedLM | None:
        if not self.cuda_graphs:
            return None
        return GraphedLM(self.loaded, self.pad_id, bulk_tokens=BULK_TOKENS if config.bulk_graphs else 0)
