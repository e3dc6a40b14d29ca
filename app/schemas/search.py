"""``POST /v1/search``: a rubric and/or a candidate image against one reference set."""

from __future__ import annotations

import json
from typing import Annotated, Any

from fastapi import UploadFile
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic_core import PydanticCustomError

from rubricsearch.app.schemas.calibration import CalibrationUse, CellOut, VerdictOut
from rubricsearch.app.schemas.common import TINY_PNG, Criterion, ImageRef
from rubricsearch.app.schemas.evidence import EXPLAIN_MAX_HITS, EvidenceOut
from rubricsearch.app.schemas.images import IMAGE_EXAMPLE, SHA_EXAMPLE, ImageOut
from rubricsearch.app.schemas.metadata import FILTER_DESCRIPTION, FILTER_EXAMPLE, FilterJSON
from rubricsearch.retrieval.search.provenance import SearchProvenance


class SearchBody(BaseModel):
    """Give a rubric (free text and/or criteria), a candidate image, or both."""

    model_config = ConfigDict(extra="forbid", json_schema_extra={"examples": [
        {"set_id": "cats", "criteria": ["short fur", "triangular ears"], "image": TINY_PNG, "top_k": 50,
         "top_n": 10},
    ]})

    set_id: str = Field(min_length=1, description="The reference set's id or name.")
    rubric: str | None = Field(
        None, max_length=4000, description="What to look for. Several lines without `criteria` are read as "
        "one criterion per line.",
    )
    criteria: list[Criterion] = Field(
        default_factory=list,
        description="Criteria scored one by one (a per-criterion breakdown per hit); at most "
        "12 (MAX_CRITERIA; the server answers more with a 400 that says so).",
    )
    image: ImageRef | None = Field(None, description="The candidate image to compare the references with.")
    top_k: int | None = Field(None, ge=1, le=1000, description="Shortlist size of the vector search "
                              "(default 50).")
    top_n: int | None = Field(None, ge=0, le=1000, description="Hits returned after reranking; 0 = the whole "
                              "shortlist unranked by the reranker (default 10).")
    rerank: bool = Field(True, description="Rerank the shortlist with the reranker (false: vector order).")
    filter: FilterJSON = Field(None, description=FILTER_DESCRIPTION)
    explain: bool | list[Criterion] = Field(False, description="Per-criterion visual evidence for the top "
                                            f"{EXPLAIN_MAX_HITS} hits (`evidence` of each hit): `true` for every "
                                            "criterion of the search, or a list of some of them; at most "
                                            f"{EXPLAIN_MAX_HITS} hits × the criteria. It adds to the search's time "
                                            "(`timings_ms.evidence`); the UI asks `/v1/sets/{set}/evidence` per "
                                            "hit instead.")
    explain_candidate: bool = Field(False, description="With `explain` and `image`, each evidence maps the "
                                    "candidate image too: a backward pass through every whole pair besides the "
                                    "references' maps, which run after the prompt and candidate without one.")


class SearchHitOut(BaseModel):
    rank: int = Field(description="1-based position in the result.")
    score: float = Field(description="The ranking score: when reranked, the geometric mean of the per-criterion "
                         "scores (or, without criteria, the reranker's judgement of the query); when the reranker's "
                         "measured policy steps aside for this kind of query, the vector score's calibrated match "
                         "probability; else the vector score. `provenance.score` says how it was formed.")
    ann_score: float = Field(description="Inner product of the query and reference embeddings.")
    rerank_score: float | None = Field(description="Reranker relevance in [0, 1] (null when not reranked).")
    criteria: dict[str, float] = Field(description="Reranker relevance per criterion (a negative criterion, "
                                       "\"no X\", scores 1 − P(X)).")
    judgments: dict[str, bool] = Field(default_factory=dict, description="The judgment recorded for this "
                                       "reference per criterion of the search (a person's, an API client's or "
                                       "derived; see `/v1/sets/{set_id}/judgments`), beside the model's score in "
                                       "`criteria`; a criterion nobody judged is absent.")
    identical: bool = Field(False, description="The reference is the candidate image itself (the same sha256 of "
                            "its bytes): without criteria it is served first with score 1.0; "
                            "`provenance.identical` says how it was found.")
    verdict: VerdictOut | None = Field(None, description="From the set's calibration (`provenance.calibration`): "
                                       "`match` when every criterion's cell is, `no_match` when any is, else "
                                       "`uncertain`; a candidate alone: the verdict of its recall score, "
                                       "normalised over the candidate's cohort (`provenance.calibration.reads`), "
                                       "on the set's same-subject fit. Null where the calibration does not apply (none "
                                       "fitted, too few judgments, another reranker, or criteria judged against a "
                                       "candidate image).")
    probability: float | None = Field(None, description="The calibrated probability that every criterion holds "
                                      "(the cells' probabilities multiplied; a candidate alone: that the reference "
                                      "shows the same subject); null with `verdict`.")
    criteria_verdicts: dict[str, CellOut] = Field(default_factory=dict, description="Per criterion, beside its raw "
                                                  "score in `criteria`: the calibrated probability and verdict.")
    evidence: list[EvidenceOut] = Field(default_factory=list, description="With `explain`, for the top "
                                        f"{EXPLAIN_MAX_HITS} hits: per criterion asked, where in the reference (and "
                                        "the candidate) the reranker judged it; empty otherwise.")
    image: ImageOut


class CandidateOut(BaseModel):
    sha256: str


class SetRef(BaseModel):
    id: str
    name: str


class Provenance(SearchProvenance):
    """The search's provenance, the set it searched, and the set's calibration."""

    set: SetRef
    calibration: CalibrationUse | None = Field(None, description="The set's calibration (version, fit, held-out "
                                               "metrics) and whether this search's verdicts came from it (null: the "
                                               "set has none).")


class SearchResponse(BaseModel):
    model_config = ConfigDict(json_schema_extra={"examples": [{
        "hits": [{"rank": 1, "score": 0.91, "ann_score": 0.62, "rerank_score": 0.91,
                  "criteria": {"short fur": 0.88, "triangular ears": 0.95},
                  "image": IMAGE_EXAMPLE}],
        "provenance": {"embedding_model": {"id": "Qwen/Qwen3-VL-Embedding-2B", "revision": "main"},
                       "reranker_model": {"id": "Qwen/Qwen3-VL-Reranker-2B", "revision": "main"},
                       "instructions": {"query": "Retrieve reference images that match the given image on these "
                                                 "criteria: short fur; triangular ears",
                                        "document": "Represent the user's input.", "rerank": None,
                                        "per_criterion": [
                                            "Judge whether the Document image matches the Query image on this "
                                            "criterion: short fur",
                                            "Judge whether the Document image matches the Query image on this "
                                            "criterion: triangular ears"]},
                       "criteria": ["short fur", "triangular ears"],
                       "score": {"formed": "geometric mean of the per-criterion scores", "judged": [
                           {"criterion": "short fur", "statement": "short fur", "score": "P(statement)"},
                           {"criterion": "triangular ears", "statement": "triangular ears",
                            "score": "P(statement)"}]},
                       "reranked": True, "rerank_status": "ok",
                       "rerank_policy": {"kind": "candidate+criteria", "rerank": True, "measured_ndcg10": None,
                                         "calibration": None, "source": None},
                       "dimensions": 1024, "top_k": 50, "top_n": 10, "vision_encodes": 1,
                       "vision": {"total": 1, "ingest": 0, "reference": 0, "query": 1,
                                  "by_model": {"embedding": {"query": 1}}, "towers_shared": True},
                       "filter": None, "identical": None, "set": {"id": "3f2c9a", "name": "cats"}},
        "timings_ms": {"query_embedding": 41.2, "ann": 0.4, "rerank": 310.5},
        "candidate": {"sha256": SHA_EXAMPLE}, "test_models": False,
    }]})

    hits: list[SearchHitOut]
    provenance: Provenance = Field(
        description="Models and revisions, the exact instructions used, criteria, whether and how reranking "
        "ran (`rerank_policy`: the query's kind, whether the reranker's measured policy reranks it, and the "
        "nDCG@10 it was decided by), and the vision-encoder runs this search needed: `vision_encodes` in total, "
        "and `vision` by purpose (`query`: the candidate, once per distinct vision tower; `reference`: 0 unless "
        "a reference's package was missing, e.g. while a backfill job runs) and by model, with `towers_shared`; "
        "`identical`: the hit whose bytes are the candidate's (same sha256), its recall rank and how it was scored "
        "(null when no reference is the candidate).",
    )
    timings_ms: dict[str, float]
    candidate: CandidateOut | None = Field(description="The candidate image's sha256, when one was given.")
    test_models: bool = Field(description="True when the configured models could not be loaded and demo or "
                              "random-weight test checkpoints serve (`models_label` says which).")
    models_label: str | None = Field(None, description="What the serving models are when they are not the "
                                     "configured ones (the UI banner's wording); null otherwise.")


def _blank_is_absent(value: Any) -> Any:
    """A form field left blank (or only spaces) was not given."""
    return None if isinstance(value, str) and not value.strip() else value


def _stripped(value: Any) -> Any:
    return value.strip() if isinstance(value, str) else value


def _flag(value: Any) -> Any:
    """A checkbox-style flag: blank is the default (true)."""
    return (value.strip() or True) if isinstance(value, str) else value


def _criteria_lines(value: Any) -> Any:
    """Each ``criteria`` field holds one criterion per line; the field may also be repeated."""
    fields = [value] if isinstance(value, str) else value
    if not isinstance(fields, list):
        return value
    return [line.strip() for field in fields if isinstance(field, str) for line in field.splitlines() if line.strip()]


def _filter_json(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise PydanticCustomError("json_invalid", "the filter is not JSON: {reason}", {"reason": str(exc)}) from None


# pydantic runs "before" validators from the last listed: a blank field is absent, any other is trimmed
FormInt = Annotated[int | None, BeforeValidator(_stripped), BeforeValidator(_blank_is_absent)]


class SearchForm(BaseModel):
    """The search as an HTML form (`multipart/form-data` or urlencoded): the JSON body's fields as text, with
    `criteria` one per line (the field may repeat), `image` a file or the sha256 of an ingested image, and `filter`
    the filter's JSON."""

    set_id: Annotated[str, BeforeValidator(_stripped)] = Field(min_length=1, description="The reference set's id "
                                                              "or name.")
    rubric: Annotated[str | None, BeforeValidator(_blank_is_absent)] = Field(None, max_length=4000,
                                                                            description="What to look for.")
    criteria: Annotated[list[Criterion], BeforeValidator(_criteria_lines)] = Field(
        default_factory=list, description="One criterion per line.")
    image: UploadFile | str | None = Field(None, description="The candidate image file, or the sha256 of an "
                                           "ingested image (or a `data:` URL) as text.")
    top_k: FormInt = Field(None, ge=1, le=1000)
    top_n: FormInt = Field(None, ge=0, le=1000)
    rerank: Annotated[bool, BeforeValidator(_flag)] = True
    filter: Annotated[FilterJSON, BeforeValidator(_filter_json), BeforeValidator(_blank_is_absent)] = Field(
        None, description="The filter's JSON (see the JSON body's `filter`).")

    def query(self) -> SearchBody:
        """The search without its image (resolved by the route: a file, or a reference as text)."""
        return SearchBody(set_id=self.set_id, rubric=self.rubric, criteria=self.criteria, top_k=self.top_k,
                          top_n=self.top_n, rerank=self.rerank, filter=self.filter)


OPENAPI_EXAMPLES: dict[str, Any] = {
    "rubric_and_image": {
        "summary": "Criteria plus a candidate image (data: URL)",
        "value": {"set_id": "cats", "criteria": ["short fur", "triangular ears"], "image": TINY_PNG,
                  "top_k": 50, "top_n": 10},
    },
    "ingested_candidate": {
        "summary": "An already ingested image as the candidate (no bytes sent, no vision-encoder run)",
        "value": {"set_id": "cats", "rubric": "same coat pattern", "image": {"image_id": SHA_EXAMPLE}},
    },
    "text_only": {
        "summary": "A text rubric only",
        "value": {"set_id": "cats", "rubric": "a grey cat with dark forehead stripes", "top_n": 5},
    },
    "filtered": {
        "summary": "Only references whose metadata passes a filter (Qdrant's filter JSON)",
        "value": {"set_id": "shoes", "rubric": "ankle boots with a buckle", "filter": FILTER_EXAMPLE},
    },
    "recall_only": {
        "summary": "Vector search without reranking",
        "value": {"set_id": "cats", "rubric": "striped tail", "rerank": False, "top_n": 20},
    },
}
