"""What fine-tuning either model from cached packages shares: the settings, the judgments and their split by
reference, LoRA on the language model, the counted tower, the early-stopped loop and the atomic version folder.

The reranker's trainer (``rerank/tuning``) and the embedder's (:mod:`retrieval.tuning.embedder`) use these
modules; nothing here imports torch at package import, so the CLI reads :class:`~retrieval.tuning.settings.
TuningSettings`' defaults without it."""
