"""The verdicts the Compare page shows on the demo set, measured against the faces' true attributes.

The demo set is prepared exactly as ``rubricsearch demo`` prepares it (:func:`prepared_state`: the 40 faces
ingested, judged from their attributes, the calibration refitted) and searched through the API's search path
(:func:`app.set_search.search_set`, ``top_k = top_n`` = the whole set). For every criterion the page's candidates
are titled by, each value's absence as users write it ("no ginger fur", "not a fox"), and the issue's wording "no
dark forehead stripes": per criterion, the precision of ``match`` and of ``no match`` and the share ``uncertain``
at the thresholds the page shows. Because the calibration is fitted on these very faces' judgments, the same cells
are also graded held out: five folds of the faces (by reference, as the refit folds them), each fold's verdicts
from a calibration fitted on the other folds' judged cells only.

Then the candidates: each searched alone, where its attribute twins (the same subject drawn again) rank and which
verdict they get; and an uploaded blue square alone, which must be no match.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

from rubricsearch.app.demo.faces import CANDIDATES, Criterion, Face, candidate_images, demo_faces, demo_images
from rubricsearch.app.demo.trust import judged_criteria
from rubricsearch.rerank.calibration import BandMetrics, Verdict, band_metrics, fit, reference_folds
from rubricsearch.rerank.rubric import judged
from rubricsearch.retrieval.images import decode_image, sha256_hex

COUNT = 40
NO_DARK_STRIPES = "no dark forehead stripes"  # the wording issue 50 tried (negation of the judged statement)


def criteria_shown() -> list[Criterion | str]:
    """Every statement a face is judged on, each value's absence, and the issue's "no dark forehead stripes"."""
    presences = [c for c in judged_criteria() if not c.negated]
    said = {c.text for c in presences}  # "no forehead stripes" is a value's statement and an absence
    return [*presences, *(c for c in judged_criteria() if c.negated and c.text not in said), NO_DARK_STRIPES]


def holds(criterion: Criterion | str, face: Face) -> bool:
    return criterion.holds(face) if isinstance(criterion, Criterion) else not face.stripes


def text_of(criterion: Criterion | str) -> str:
    return criterion.text if isinstance(criterion, Criterion) else criterion


def blue_square(size: int = 128) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (size, size), (40, 90, 220)).save(buf, format="PNG")
    return buf.getvalue()


@dataclass(frozen=True)
class CriterionRow:
    criterion: str
    shown: BandMetrics  # the calibration fitted on every judgment: what the page shows
    held_out: BandMetrics  # each face's verdict from a fit that did not see its judgments
    wrong_matches: list[str] = field(default_factory=list)  # faces shown as a match that do not meet it


@dataclass(frozen=True)
class Twin:
    candidate: str
    ranks: list[int]  # where its attribute twins rank in the candidate-alone search
    verdicts: list[str]
    probabilities: list[float]
    title_ranks: list[int]  # where they rank searched by the candidate's title (its five criteria, no image)
    title_verdicts: list[str]


@dataclass(frozen=True)
class SetQuality:
    calibration_version: int
    method: str | None
    match_at: float | None
    no_match_at: float | None
    rows: list[CriterionRow]
    shown: BandMetrics  # pooled over every row
    held_out: BandMetrics
    twins: list[Twin]
    blue_square: list[str]  # the verdict of every hit of the blue square alone
    blue_square_best: float  # its best calibrated probability
    pairs: BandMetrics | None  # the same-subject fit's own held-out band (folds of candidate references)


def prepared_state(embedding: str | Path, reranker: str | Path, data_dir: Path, count: int = COUNT) -> tuple[Any, str]:
    """An AppState over ``data_dir`` serving these models, with the demo set prepared as ``rubricsearch demo``
    prepares it; returns (state, set id). The caller closes the state."""
    from rubricsearch.app.demo.cli import calibrate_demo_set, ensure_demo_set
    from rubricsearch.app.settings import Settings
    from rubricsearch.app.state import AppState

    settings = Settings(_env_file=None, data_dir=data_dir, ingest={"workers": 0},
                        models={"embedding_model": str(embedding), "reranker_model": str(reranker),
                                "dtype": "float32", "engine": "local"})
    state = AppState.preparing(settings)
    try:
        state.load()
        set_id = ensure_demo_set(state, count, out=io.StringIO())
        calibrate_demo_set(state, set_id, count, out=io.StringIO())
    except BaseException:
        state.close()
        raise
    return state, set_id


def search(state: Any, set_id: str, criteria: Sequence[str], candidate: bytes | None = None) -> Any:
    """One search as the API runs it, the whole set ranked."""
    from rubricsearch.app.schemas.search import SearchBody
    from rubricsearch.app.set_search import search_set

    body = SearchBody(set_id=set_id, criteria=list(criteria), top_k=COUNT, top_n=COUNT)
    return search_set(state, body, decode_image(candidate) if candidate is not None else None)


def measure_set(state: Any, set_id: str, count: int = COUNT) -> SetQuality:
    from rubricsearch.app.calibration import current

    found = current(state.catalog, set_id)
    assert found is not None, "the demo set has no calibration"
    calibration = found[0]
    faces = {sha256_hex(data): face for face, (_, data) in zip(demo_faces(count), demo_images(count), strict=True)}
    shas = sorted(faces)
    criteria = criteria_shown()
    raw: dict[str, dict[str, float]] = {}  # criterion -> sha -> the raw cell score search gave
    shown: dict[str, dict[str, Verdict]] = {}  # criterion -> sha -> the verdict the page shows
    for c in criteria:
        result = search(state, set_id, [text_of(c)])
        raw[text_of(c)] = {h.image.sha256: h.criteria[text_of(c)] for h in result.hits}
        shown[text_of(c)] = {h.image.sha256: h.criteria_verdicts[text_of(c)].verdict for h in result.hits}
    held = _held_out_verdicts(calibration.model_key, criteria, raw, faces, shas)
    rows = []
    for c in criteria:
        t = text_of(c)
        truth = [holds(c, faces[s]) for s in shas]
        scores = [raw[t][s] for s in shas]
        rows.append(CriterionRow(t, band_metrics(scores, truth, [shown[t][s] for s in shas]),
                                 band_metrics(scores, truth, [held[t][s] for s in shas]),
                                 [faces[s].name for s in shas if shown[t][s] == "match" and not holds(c, faces[s])]))
    every = [(holds(c, faces[s]), raw[text_of(c)][s], shown[text_of(c)][s], held[text_of(c)][s])
             for c in criteria for s in shas]
    pooled_shown = band_metrics([e[1] for e in every], [e[0] for e in every], [e[2] for e in every])
    pooled_held = band_metrics([e[1] for e in every], [e[0] for e in every], [e[3] for e in every])
    twins = []
    for face, (name, data) in zip(CANDIDATES, candidate_images(), strict=True):
        hits = search(state, set_id, [], data).hits
        at = [(rank, h) for rank, h in enumerate(hits, 1) if faces[h.image.sha256].key == face.key]
        titled = search(state, set_id, face.describe().split("; ")).hits
        by_title = [(rank, h) for rank, h in enumerate(titled, 1) if faces[h.image.sha256].key == face.key]
        twins.append(Twin(name, [r for r, _ in at], [str(h.verdict) for _, h in at],
                          [round(float(h.probability), 4) if h.probability is not None else float("nan")
                           for _, h in at], [r for r, _ in by_title], [str(h.verdict) for _, h in by_title]))
    square = search(state, set_id, [], blue_square()).hits
    pairs = calibration.candidate
    return SetQuality(calibration.version, None if calibration.mapping is None else calibration.mapping.method,
                      calibration.match_at, calibration.no_match_at, rows, pooled_shown, pooled_held, twins,
                      [str(h.verdict) for h in square],
                      max((h.probability for h in square if h.probability is not None), default=float("nan")),
                      None if pairs is None or pairs.held_out is None else pairs.held_out.band)


def _held_out_verdicts(key: str, criteria: Sequence[Criterion | str], raw: dict[str, dict[str, float]],
                       faces: dict[str, Face], shas: list[str]) -> dict[str, dict[str, Verdict]]:
    """Each (criterion, face) verdict from a calibration fitted on the other folds' faces' judged cells (the
    statements the demo derives judgments for: every attribute value), as the refit would fit it."""
    statements = [c for c in judged_criteria() if not c.negated]
    fold = dict(zip(shas, reference_folds(shas), strict=True))
    out: dict[str, dict[str, Verdict]] = {text_of(c): {} for c in criteria}
    for k in sorted(set(fold.values())):
        fitting = [s for s in shas if fold[s] != k]
        cells = [(s, c) for s in fitting for c in statements]
        calibration = fit([raw[c.text][s] for s, c in cells], [c.holds(faces[s]) for s, c in cells],
                          [s for s, _ in cells], [c.text for _, c in cells], model_key=key,
                          max_judgment_id=len(cells), fitted_at=datetime.now(UTC))
        graded = [s for s in shas if fold[s] == k]
        for c in criteria:
            t = text_of(c)
            statement = judged(t).statement if judged(t).negated else None
            found = calibration.cells([raw[t][s] for s in graded], [t] * len(graded), [statement] * len(graded))
            band: list[Verdict] = found[1] if found is not None else ["uncertain"] * len(graded)
            out[t].update(zip(graded, band, strict=True))
    return out


def table(q: SetQuality) -> str:
    def f(x: float | None) -> str:
        return "–" if x is None or (isinstance(x, float) and np.isnan(x)) else f"{x:.3f}"

    def band(b: BandMetrics) -> str:
        return (f"{f(b.match_precision)} ({b.matches}) | {f(b.no_match_precision)} ({b.no_matches}) | "
                f"{b.share_uncertain:.3f}")

    lines = [f"calibration v{q.calibration_version}: {q.method}, match at ≥ {f(q.match_at)}, no match at ≤ "
             f"{f(q.no_match_at)}",
             "| criterion | yes / no | shown: match precision (n) | no-match precision (n) | uncertain | "
             "held out: match precision (n) | no-match precision (n) | uncertain |",
             "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in q.rows:
        lines.append(f"| {r.criterion} | {r.shown.yes} / {r.shown.no} | {band(r.shown)} | {band(r.held_out)} |")
    lines.append(f"| **all** | {q.shown.yes} / {q.shown.no} | {band(q.shown)} | {band(q.held_out)} |")
    for r in q.rows:
        if r.wrong_matches:
            lines.append(f"wrong matches for {r.criterion!r}: {', '.join(r.wrong_matches)}")
    for t in q.twins:
        lines.append(f"{t.candidate} alone: twins at ranks {t.ranks}, {t.verdicts}, probability {t.probabilities}; "
                     f"by its title's criteria: ranks {t.title_ranks}, {t.title_verdicts}")
    lines.append(f"a blue square alone: {sum(v == 'no_match' for v in q.blue_square)} of {len(q.blue_square)} hits "
                 f"no match, {sum(v == 'match' for v in q.blue_square)} match; best probability "
                 f"{f(q.blue_square_best)}")
    if q.pairs is not None:
        lines.append(f"same-subject pairs held out: match precision {f(q.pairs.match_precision)} "
                     f"({q.pairs.matches}), no-match precision {f(q.pairs.no_match_precision)} "
                     f"({q.pairs.no_matches}), uncertain {q.pairs.share_uncertain:.3f}, AUC {f(q.pairs.auc)}")
    return "\n".join(lines)
