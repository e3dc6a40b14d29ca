"""Liger's fused Triton kernels for the Qwen3-VL passes (``LocalConfig.fused_kernels``).

The transformers code runs each RMSNorm and rotary embedding as a chain of small element-wise kernels with
float32 round trips; on a fast GPU those, not the matrix products, bound the LM pass. Liger-Kernel
(the ``gpu`` extra) replaces them with one fused kernel each. Unlike ``torch.compile`` it needs no warm-up and
does not specialise on shapes, so mixed image sizes and the reranker's KV-cache passes gain as much as one
size does. Results move at bf16 rounding level (``tests/test_gpu_tower.py``); packages keep their
fingerprint, as they do across devices.

The rotary functions are module globals of ``modeling_qwen3_vl`` (its attention ``forward`` looks them up by
name), so they are switched for the whole process; the RMSNorms are switched per loaded model, and so is the
tower's patch embedding (:func:`linear_patch_embed`) and the LM's MLPs (:func:`fused_swiglu`).
:func:`use_reference_kernels` puts the transformers functions back (tests compare both in one process).
"""

from __future__ import annotations

from functools import partial
from typing import Any, Literal

import torch

from rubricsearch.retrieval.errors import BackendUnavailable

_ORIGINAL: dict[str, Any] = {}


def _modeling() -> Any:
    from transformers.models.qwen3_vl import modeling_qwen3_vl

    return modeling_qwen3_vl


def fused_kernels_problem(device: torch.device) -> str | None:
    """Why the fused kernels cannot run here, or None when they can."""
    if device.type != "cuda":
        return f"the fused kernels need a CUDA device (the models run on {device.type})"
    try:  # every name use_fused_kernels and fused_swiglu take, so that "auto" never half-switches a model
        from liger_kernel.ops.swiglu import LigerSiLUMulFunction  # noqa: F401
        from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module  # noqa: F401
        from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision  # noqa: F401
    except ImportError as exc:
        return f"the fused kernels need liger-kernel (pip install 'rubricsearch[gpu]'): {exc}"
    return None


def fused_kernels_wanted(setting: bool | Literal["auto"], device: torch.device) -> bool:
    """``auto`` (the server's default): on wherever they can run, a CUDA device with liger-kernel installed,
    since they cut the passes' element-wise time at rounding-level deviation; ``True`` asks for them (and is
    refused where they cannot run), ``False`` keeps transformers'."""
    return fused_kernels_problem(device) is None if setting == "auto" else setting


def use_fused_kernels(model: Any) -> int:
    """Switch ``model`` (a ``Qwen3VLModel``) to Liger's RMSNorm, the LM's rotary function to Liger's and the tower's
    to :mod:`retrieval.plugins.accelerated.kernels.rope_kernel`'s; returns how many RMSNorm modules were switched."""
    problem = fused_kernels_problem(next(model.parameters()).device)
    if problem:
        raise BackendUnavailable(problem)
    from liger_kernel.transformers.monkey_patch import _patch_rms_norm_module
    from liger_kernel.transformers.rope import liger_rotary_pos_emb, liger_rotary_pos_emb_vision

    from rubricsearch.retrieval.plugins.accelerated.kernels import rope_kernel

    modeling = _modeling()
    for name in ("apply_rotary_pos_emb", "apply_rotary_pos_emb_vision"):
        _ORIGINAL.setdefault(name, getattr(modeling, name))
    modeling.apply_rotary_pos_emb = liger_rotary_pos_emb
    # the tower's rotary as one kernel of ours, bit-identical to transformers' (Liger's casts took a large share of
    # a tower pass: docs/performance.md, "Measurements behind the code")
    modeling.apply_rotary_pos_emb_vision = partial(rope_kernel.rotary_vision, fallback=liger_rotary_pos_emb_vision)
    # Qwen3's norms compute in float32 and cast back ("llama" casting), with no offset on the weight
    patch = partial(_patch_rms_norm_module, offset=0.0, casting_mode="llama")
    text = model.language_model
    norms = [text.norm]
    for layer in text.layers:
        norms += [layer.input_layernorm, layer.post_attention_layernorm, layer.self_attn.q_norm,
                  layer.self_attn.k_norm]
    for norm in norms:
        patch(norm)
    linear_patch_embed(model.visual.patch_embed)
    if str(text.config.hidden_act) == "silu":
        for layer in text.layers:
            fused_swiglu(layer.mlp)
    return len(norms)


def fused_swiglu(mlp: Any) -> None:
    """``down(silu(gate(x)) * up(x))`` with the SiLU and the product as one Liger kernel: transformers runs them as
    two element-wise passes over ``[tokens, intermediate]``, each a full read and write of the largest activation.
    The same bf16 roundings in the same order: bit-identical outputs."""
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    def forward(x: torch.Tensor) -> torch.Tensor:
        out: torch.Tensor = mlp.down_proj(LigerSiLUMulFunction.apply(mlp.gate_proj(x), mlp.up_proj(x)))
        return out

    mlp.forward = forward


def linear_patch_embed(embed: Any) -> None:
    """Run the tower's patch embedding (a Conv3d whose stride equals its kernel: one product per patch) as
    one matrix product. cuDNN picks an implicit-GEMM convolution for it, well below GEMM speed; cuBLAS does the
    same product at GEMM speed. Same arithmetic, other summation order (rounding level); the weight is shared,
    not copied."""
    proj = embed.proj
    weight = proj.weight.detach().view(proj.weight.shape[0], -1)  # [embed_dim, C*T*P*P], same layout
    bias = None if proj.bias is None else proj.bias.detach()

    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.linear(hidden_states.reshape(-1, weight.shape[1]).to(weight.dtype), weight, bias)

    embed.forward = forward


def use_reference_kernels() -> None:
    """Put the transformers rotary functions back (models switched by :func:`use_fused_kernels` keep their
    fused RMSNorms)."""
    modeling = _modeling()
    for name, fn in _ORIGINAL.items():
        setattr(modeling, name, fn)
