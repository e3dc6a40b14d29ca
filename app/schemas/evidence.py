"""Per-criterion visual evidence: where in a reference (and the candidate) the reranker judged a criterion."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from rubricsearch.app.schemas.common import Criterion, ImageRef
from rubricsearch.rerank.evidence import (
    DEFAULT_METHOD,
    METHODS,
    OCCLUSION_MAX_TOKENS,
    Method,
)

EXPLAIN_MAX_HITS = 5  # a search explains at most its top 5 hits (each × every criterion asked)
METHOD_DESCRIPTION = (f"How the map is computed, one of {', '.join(f'`{m}`' for m in METHODS)}. By default "
                      f"`{DEFAULT_METHOD}` (chosen on the demo truth and on speed); `occlusion` is refused "
                      f"over {OCCLUSION_MAX_TOKENS} merged tokens. `gradient_x_input` is one backward pass of "
                      "the language model, Σ over channels of ∂logit/∂x · (x − the image's mean token) of each merged "
                      "visual token; `integrated_gradients` the same with the gradient averaged on the path from the "
                      "mean tokens to the image (its values add up to the logit's change along it); `occlusion` "
                      "the logit's drop when the token is replaced by the image's mean token; `attention` the share "
                      "of the last token's attention on each token (unsigned: where the model looked, not which way "
                      "it weighed). All read the cached visual package: the vision tower does not run.")


class EvidenceBody(BaseModel):
    """One reference of the set and one criterion (with the search's candidate image, if it had one)."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"image_id": "9f86d081884c7d65" * 4, "criterion": "dark forehead stripes"}]})

    image_id: str = Field(min_length=1, max_length=80, description="The reference: its catalog id or sha256.")
    criterion: Criterion = Field(min_length=1, description="The criterion as typed in the search; a negated one "
                                 "(\"no X\") is explained by its positive statement \"X\".")
    candidate: ImageRef | None = Field(None, description="The search's candidate image: the criterion is then "
                                       "judged against it.")
    candidate_map: bool = Field(False, description="With `candidate`, the candidate's map too. The reference's "
                                "map runs after the prompt and candidate, which need no gradient; the candidate's "
                                "takes a backward pass through the whole pair besides (docs/performance.md).")
    method: Method | None = Field(None, description=METHOD_DESCRIPTION)


class ImageMapOut(BaseModel):
    sha256: str
    role: Literal["document", "query"] = Field(description="`document`: the reference judged; `query`: the "
                                               "candidate image the criterion was judged against.")
    width: int = Field(description="The original image's width in pixels (the boxes' space).")
    height: int
    rows: int = Field(description="Rows of the merged-token grid (the package's grid after the 2×2 merge).")
    cols: int
    boxes: list[list[list[float]]] = Field(description="Per cell `[row][col]`: `[left, top, right, bottom]` of the "
                                           "original image the cell covers (the preprocessing resizes the whole "
                                           "image, so a cell scales back proportionally).")
    values: list[list[float]] = Field(description="Per cell `[row][col]`: positive supports \"yes\" (the statement "
                                      "holds), negative \"no\"; the magnitude is how much the cell weighed.")


class EvidenceOut(BaseModel):
    """The evidence of one criterion on one reference, or why there is none (never an empty map)."""

    available: bool = Field(description="False when this server cannot compute evidence; `reason` says why.")
    reason: str | None = Field(None, description="Why evidence is unavailable (null when available).")
    criterion: str
    method: Method | None = Field(None, description=METHOD_DESCRIPTION)
    statement: str | None = Field(None, description="The statement the reranker judged.")
    of: Literal["statement", "positive statement"] | None = Field(
        None, description="`positive statement` for a negated criterion (\"no X\"): the maps explain P(X), which "
        "its score is 1 minus.")
    instruction: str | None = None
    p_yes: float | None = Field(None, description="The reranker's raw P(yes) of the statement (before calibration "
                                "and negation): the judgement the maps explain.")
    images: list[ImageMapOut] = Field(default_factory=list)
    vision_encodes: int = Field(0, description="Vision-tower runs the evidence needed: 0 for ingested references "
                                "(their packages are cached); 1 for a candidate image not seen before.")
    timings_ms: dict[str, float] = Field(default_factory=dict)
