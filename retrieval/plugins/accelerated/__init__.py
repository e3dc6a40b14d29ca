"""The accelerated local engine, a plug-in (the runtime registry loads :mod:`.runtime` by name; no core module
imports anything here): fused and Triton kernels, cuDNN and FlashAttention paths, packed variable-length LM
passes, CUDA graphs of the tower and the LM, compiled blocks and preprocessing on the GPU. Each layers on the
plain reference runtime (:mod:`retrieval.runtime.local`, :mod:`retrieval.qwen.engine`) through the hooks it owns."""
