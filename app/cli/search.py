"""``rubricsearch search SET --rubric TEXT [--criteria C ...] [--image PATH]``: a search in this process."""

from __future__ import annotations

import argparse
import json
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rubricsearch.app.cli.remote import add_server_options, candidate_ref, client
from rubricsearch.app.cli.sets import cli_settings, table

if TYPE_CHECKING:
    from rubricsearch.app.schemas.calibration import CalibrationUse
    from rubricsearch.app.schemas.search import SearchHitOut, SearchResponse

SHA_RE = re.compile(r"^[0-9a-fA-F]{64}$")
IDENTICAL = "[identical image]"


def register(sub: Any) -> None:
    p = sub.add_parser("search", help="search a set with a rubric and/or a candidate image")
    p.add_argument("set", help="the set's id or name")
    p.add_argument("--rubric", default=None, help="what to look for (several lines = one criterion per line)")
    p.add_argument("--criteria", nargs="+", default=[], metavar="C", help="criteria scored one by one")
    p.add_argument("--image", default=None, help="candidate image: a file, or the sha256 of an ingested image")
    p.add_argument("--top-k", type=int, default=None, help="vector shortlist size (default 50)")
    p.add_argument("--top-n", type=int, default=None, help="results shown (default 10)")
    p.add_argument("--no-rerank", action="store_true", help="vector order only (no reranker is loaded)")
    p.add_argument("--filter", default=None, metavar="JSON",
                   help="only references whose metadata passes this Qdrant-style filter (JSON, or @FILE)")
    p.add_argument("--json", action="store_true", help="print the API's JSON response")
    add_server_options(p)
    p.set_defaults(func=run)


def _candidate(state: Any, value: str | None) -> Any:
    from rubricsearch.retrieval.images import image_handle

    if value is None:
        return None
    path = Path(value)
    if not path.is_file() and SHA_RE.match(value):
        return state.ingested_image(value.lower())
    from rubricsearch.retrieval.errors import NotFound

    if not path.is_file():
        raise NotFound(f"no such image file: {value}")
    return image_handle(path.read_bytes(), max_bytes=state.settings.image_bytes,
                        max_pixels=state.settings.image_pixels)


def _filter_arg(value: str | None) -> Any:
    """``--filter``: the filter's JSON, or ``@path`` of a file holding it."""
    from rubricsearch.retrieval.errors import InvalidMetadata

    if value is None:
        return None
    text = Path(value[1:]).read_text() if value.startswith("@") else value
    try:
        return json.loads(text)
    except json.JSONDecodeError as exc:
        raise InvalidMetadata(f"--filter is not JSON: {exc}") from None


def print_results(response: SearchResponse) -> None:
    prov = response.provenance
    headers = ["rank", "score", "ann", "rerank", *prov.criteria, "verdict", "name", "sha256", "id"]
    rows = []
    for hit in response.hits:
        rerank = "-" if hit.rerank_score is None else f"{hit.rerank_score:.4f}"
        per = [_cell(hit, c) for c in prov.criteria]
        name = hit.image.metadata.get("label") or hit.image.original_name
        rows.append([hit.rank, f"{hit.score:.4f}", f"{hit.ann_score:.4f}", rerank, *per, _verdict(hit),
                     f"{name} {IDENTICAL}" if hit.identical else name, hit.image.sha256[:12], hit.image.id])
    reason = prov.filter.reason if prov.filter is not None else None
    print(table(rows, headers) if rows else f"no hits{f' ({reason})' if reason else ''}")
    if any(hit.identical for hit in response.hits):
        print(f"{IDENTICAL}: the candidate image itself (the same bytes, sha256, as --image)")
    emb, rr = prov.embedding_model, prov.reranker_model
    print()
    print(f"set: {prov.set.name} ({prov.set.id}), dimensions {prov.dimensions}")
    print(f"embedding model: {emb.id} @ {emb.revision}")
    print(f"reranker model: {rr.id if rr else '-'} @ {rr.revision if rr else '-'}; rerank: {prov.rerank_status}")
    print(f"query instruction: {prov.instructions.query}")
    print(f"score: {prov.score.formed}")
    for judged in prov.score.judged:
        if judged.score != "P(statement)":
            print(f"  {judged.criterion!r} scored {judged.score} of {judged.statement!r}")
    print(f"vision encoder runs: {prov.vision_encodes} (query images {prov.vision.query}, "
          f"references {prov.vision.reference}); timings (ms): "
          + ", ".join(f"{k} {v:.1f}" for k, v in response.timings_ms.items()))
    print(f"calibration: {_calibration(prov.calibration)}")
    if response.models_label:
        print(f"NOTE: {response.models_label}")


def _cell(hit: SearchHitOut, criterion: str) -> str:
    """``0.8123 match``: the criterion's raw score and, where the set's calibration gives one, its verdict."""
    if criterion not in hit.criteria:
        return "-"
    cell = hit.criteria_verdicts.get(criterion)
    return f"{hit.criteria[criterion]:.4f}" + ("" if cell is None else f" {cell.verdict}")


def _verdict(hit: SearchHitOut) -> str:
    """``match 0.93``: the hit's verdict and the calibrated probability that every criterion holds."""
    return "-" if hit.verdict is None or hit.probability is None else f"{hit.verdict} {hit.probability:.2f}"


def _calibration(use: CalibrationUse | None) -> str:
    if use is None:
        return "none (the set has no calibration: no verdicts)"
    fitted = f"version {use.version}, {use.status}, {use.method or 'no fit'} on {use.judgments} judgments"
    stale = f"; {use.stale.new} new, {use.stale.gone} gone since" if use.stale.stale else ""
    return f"{fitted}{stale}" + ("" if use.applied else f"; not applied: {use.reason}")


def run(args: argparse.Namespace) -> int:
    from pydantic import ValidationError

    from rubricsearch.app.schemas.search import SearchBody
    from rubricsearch.app.set_search import search_set
    from rubricsearch.app.state import open_state
    from rubricsearch.retrieval.errors import InvalidInput

    try:
        body = SearchBody(set_id=args.set, rubric=args.rubric, criteria=args.criteria, top_k=args.top_k,
                          top_n=args.top_n, rerank=not args.no_rerank, filter=_filter_arg(args.filter))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise InvalidInput(f"{'.'.join(str(p) for p in first['loc'])}: {first['msg']}") from None
    rs = client(args)
    if rs is not None:
        with rs:
            response = rs.search(args.set, image=candidate_ref(args.image),
                                 **body.model_dump(exclude={"set_id", "image"}, exclude_none=True))
    else:
        state = open_state(cli_settings(), embedder=True, reranker=not args.no_rerank)
        try:
            response = search_set(state, body, _candidate(state, args.image))
        finally:
            state.close()
    if args.json:
        print(json.dumps(response.model_dump(mode="json"), indent=2))
    else:
        print_results(response)
    return 0
