"""The accelerated local scoring runtime: the plain :class:`~rerank.local.LocalScoringRuntime` with the GPU paths.

On top of :class:`~retrieval.plugins.accelerated.runtime.AcceleratedRuntime` (fused kernels, compiled tower
blocks, packed passes, CUDA graphs), shortlists run packed (:mod:`.packed_prefix`: every group's prefix and
continuations in one variable-length pass, graphed when the configuration asks) where FlashAttention's
variable-length kernel runs, and so do the passes with gradients (:mod:`.packed_rows`); elsewhere the padded
passes serve.
"""

from __future__ import annotations

from rubricsearch.rerank.local import LocalScoringRuntime, ShortlistPass
from rubricsearch.rerank.plugins.accelerated.packed_prefix import PackedPrefixes
from rubricsearch.rerank.plugins.accelerated.packed_rows import PackedRows
from rubricsearch.rerank.prefix import RowPasses
from rubricsearch.retrieval.plugins.accelerated.graphed_lm import GraphCache
from rubricsearch.retrieval.plugins.accelerated.packed import flash_varlen_grad_works, flash_varlen_works
from rubricsearch.retrieval.plugins.accelerated.runtime import AcceleratedRuntime
from rubricsearch.retrieval.runtime.config import LocalConfig


class AcceleratedScoringRuntime(LocalScoringRuntime, AcceleratedRuntime):
    """:class:`LocalScoringRuntime` with CUDA graphs and packed shortlist passes."""

    # The LM's passes through the shared-prefix KV cache index it by layer number, which torch.compile
    # specialises on (each layer would compile on its own): its tower alone is compiled.
    compile_language = False
    _packed: PackedPrefixes | None = None
    _rows: PackedRows | None = None

    def shortlist_pass(self, config: LocalConfig) -> ShortlistPass:
        if not (config.packed and flash_varlen_works(self.loaded)):
            return super().shortlist_pass(config)
        self._packed = PackedPrefixes(self.loaded, self.pad_id, max_bytes=self.prefix_batch_bytes,
                                      cuda_graphs=self.cuda_graphs)
        # an evidence shape is captured when it comes back (a set's images mostly share a size)
        graphs = GraphCache(self.loaded.device, max_graphs=4, capture_after=2) if self.cuda_graphs else None
        self._rows = PackedRows(self.loaded, graphs=graphs)
        return self._packed.run

    def row_passes(self) -> RowPasses:
        """Packed where the shortlists run packed and FlashAttention differentiates, so trainers and evidence maps
        run the kernels a search does."""
        if self._rows is not None and flash_varlen_grad_works(self.loaded):
            return self._rows
        return super().row_passes()

    def load(self) -> tuple[int, dict[str, int]]:
        pending, stats = super().load()
        return pending, {**stats, **(self._packed.stats if self._packed is not None else {})}
