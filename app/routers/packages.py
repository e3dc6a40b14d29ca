"""``GET /v1/images/{sha256}/visual-package``: cached vision-encoder output, shaped for vLLM.

vLLM exposes no API that returns vision-encoder outputs, so clients that want to reuse an image across
many instructions (one vision run, many prompts) had no way to get them (seed 000). Here they come
from the package store, computed from the ingested blob on a miss, in exactly the layout vLLM's
Qwen3-VL takes with ``--enable-mm-embeds``: ``[tokens, H * (1 + L)]`` plus a 1-D ``image_grid_thw``.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

import torch
from fastapi import APIRouter, Path, Query
from fastapi.responses import Response
from safetensors.torch import save as save_safetensors

from rubricsearch.app.deps import SearchAccess, StateDep
from rubricsearch.app.jsonbody import BoundedJsonRoute
from rubricsearch.app.package_views import OutDtype, layout, model_view, package_response
from rubricsearch.app.schemas.common import error_responses
from rubricsearch.app.schemas.packages import VisualPackageResponse
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import record_package
from rubricsearch.retrieval.packages import ModelPackages, VisualPackage

router = APIRouter(prefix="/v1", tags=["packages"], route_class=BoundedJsonRoute)

DESCRIPTION = """\
The visual package of an ingested image: what the model's vision encoder makes of it, computed once and
cached. `format=vllm` (JSON) gives `image_embeds` as base64 `torch.save` of a `[tokens, H*(1+L)]` tensor
(merged features, then the L deepstack levels) and `image_grid_thw` as `[t, h, w]`. Pass them to a vLLM
server started with `--enable-mm-embeds`, one content part per image:

```python
pkg = httpx.get(f"{base}/v1/images/{sha}/visual-package").json()
part = {"type": "image_embeds",
        "image_embeds": {"image_embeds": pkg["image_embeds"], "image_grid_thw": pkg["image_grid_thw"]}}
```

(vLLM before JSON grids: use `image_grid_thw_b64`.) `format=safetensors` downloads the same tensor as
`image_embeds` plus `image_grid_thw` (int64 `[3]`). `model` picks whose vision tower: the embedder
(default) or the reranker (`model=reranker`, or its id); use the one the vLLM server runs.
"""

Sha256Path = Annotated[str, Path(pattern=r"^[0-9a-fA-F]{64}$", description="sha256 of an ingested image")]



def _package(state: AppState, sha: str, view: ModelPackages) -> tuple[VisualPackage, bool]:
    """From the store, or computed from the blob (and recorded in the catalog) on a miss."""
    image = state.ingested_image(sha)
    cached = view.find([image])
    if sha in cached:
        return cached[sha], True
    package = view.get_or_encode([image])[0]  # counted as a reference encode: its package was missing
    with state.catalog.write() as session:
        record_package(session, sha, package.fingerprint.digest(), package.nbytes)
    return package, False


@router.get("/images/{sha256}/visual-package", summary="Cached vision-encoder output of an ingested image",
            description=DESCRIPTION, response_model=VisualPackageResponse,
            responses={200: {"content": {"application/octet-stream": {}},
                             "description": "JSON (format=vllm) or a safetensors file (format=safetensors)"},
                       **error_responses(400, 401, 403, 404, 409, 422, 429, 503)})
def visual_package(
    sha256: Sha256Path,
    state: StateDep,
    _: SearchAccess,
    format: Annotated[Literal["vllm", "safetensors"], Query(description="JSON for vLLM, or a file")] = "vllm",
    dtype: Annotated[OutDtype, Query(description="auto = as stored (the model's compute dtype)")] = "auto",
    model: Annotated[str | None, Query(description="embedding (default), reranker, or a model id")] = None,
) -> Any:
    sha = sha256.lower()
    view, model_id = model_view(state, model)
    package, cached = _package(state, sha, view)
    if format == "safetensors":
        package.validate()
        tensor = layout(package, dtype)
        grid = [int(v) for v in package.grid_thw]
        fp = package.fingerprint
        meta = {"image_sha256": sha, "model": model_id, "layout": "vllm", "grid_thw": json.dumps(grid),
                "fingerprint": fp.to_json(), "deepstack_levels": str(package.levels)}
        blob = save_safetensors({"image_embeds": tensor.contiguous(),
                                 "image_grid_thw": torch.tensor(grid, dtype=torch.int64)}, metadata=meta)
        return Response(blob, media_type="application/octet-stream",
                        headers={"Content-Disposition": f'attachment; filename="{sha}.safetensors"'})
    return package_response(sha, package, model_id, dtype, cached)


