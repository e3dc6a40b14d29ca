"""Visual packages as the API returns them: whose tower serves them, and their vLLM ``image_embeds`` form."""

from __future__ import annotations

import base64
import io
from typing import Literal

import torch

from rubricsearch.app.model_loading import ModelKind
from rubricsearch.app.schemas.packages import FingerprintOut, VisualPackageResponse
from rubricsearch.app.state import AppState
from rubricsearch.retrieval.errors import BackendUnavailable, NotFound
from rubricsearch.retrieval.packages import ModelPackages, VisualPackage

OutDtype = Literal["auto", "float32", "bfloat16", "float16"]


def _tensor_b64(tensor: torch.Tensor) -> str:
    """base64 of ``torch.save`` (what vLLM reads with ``torch.load(weights_only=True)``; keeps bf16)."""
    buf = io.BytesIO()
    torch.save(tensor.detach().to("cpu").contiguous().clone(), buf)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def model_view(state: AppState, model: str | None) -> tuple[ModelPackages, str]:
    """Whose tower: the embedder's (default) or the reranker's, by kind or by model name."""
    kind: ModelKind
    if model in (None, "embedding", "reranker"):
        kind = "reranker" if model == "reranker" else "embedding"
    else:
        try:
            state.resolve_model("embedding", model)
            kind = "embedding"
        except NotFound:
            state.resolve_model("reranker", model)
            kind = "reranker"
    served = state.model(kind)
    if not served.packages.local:
        raise BackendUnavailable(f"the {kind} backend has no local vision encoder to compute packages with")
    return served.packages, served.model_id


def layout(package: VisualPackage, dtype: OutDtype) -> torch.Tensor:
    """vLLM's ``image_embeds`` tensor of a package, in the requested dtype."""
    tensor = package.to_vllm_layout()
    return tensor if dtype == "auto" else tensor.to(getattr(torch, dtype))


def package_response(sha: str, package: VisualPackage, model_id: str, dtype: OutDtype,
                     cached: bool) -> VisualPackageResponse:
    """The JSON (vLLM) form of one package; ``POST /v1/visual-packages`` returns a list of these."""
    package.validate()
    tensor = layout(package, dtype)
    grid = [int(v) for v in package.grid_thw]
    fp = package.fingerprint
    return VisualPackageResponse(
        image_sha256=sha, model=model_id, image_embeds=_tensor_b64(tensor), image_grid_thw=grid,
        image_grid_thw_b64=_tensor_b64(torch.tensor(grid, dtype=torch.int64)), tokens=package.tokens,
        hidden_size=package.hidden_size, deepstack_levels=package.levels, width=int(tensor.shape[1]),
        dtype=str(tensor.dtype).removeprefix("torch."), cached=cached,
        fingerprint=FingerprintOut(digest=fp.digest(), tower=fp.tower, min_pixels=fp.min_pixels,
                                   max_pixels=fp.max_pixels, patch_size=fp.patch_size, merge_size=fp.merge_size,
                                   temporal_patch_size=fp.temporal_patch_size),
    )
