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
verdict they get; and uploads that show no animal (a blue square, noise, a photo-like and a white image) alone,
which must be no match. :func:`judged_alone` measures why the
twins get no better: the reranker's own judgement of a candidate alone on every pair of the set's faces, asked
whatever the rerank policy decides.
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
from rubricsearch.retrieval.images import ImageLike, decode_image, sha256_hex

COUNT = 40
NO_DARK_STRIPES = "no dark forehead stripes"  # the wording issue 50 tried (negation of the judged statement)
PIXEL_NOISE = "pixel noise"


def criteria_shown() -> list[Criterion | str]:
    """Every statement a face is judged on, each value's absence, and the issue's "no dark forehead stripes"."""
    presences = [c for c in judged_criteria() if not c.negated]
    said = {c.text for c in presences}  # "no forehead stripes" is a value's statement and an absence
    return [*presences, *(c for c in judged_criteria() if c.negated and c.text not in said), NO_DARK_STRIPES]


def holds(criterion: Criterion | str, face: Face) -> bool:
    return criterion.holds(face) if isinstance(criterion, Criterion) else not face.stripes


def text_of(criterion: Criterion | str) -> str:
    return criterion.text if isinstance(criterion, Criterion) else criterion


def _png(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def blue_square(size: int = 128) -> bytes:
    return _png(Image.new("RGB", (size, size), (40, 90, 220)))


def non_faces(size: int = 128) -> list[tuple[str, bytes]]:
    """Uploads that show no animal: a blue square, pixel noise, a photo-like image (smooth colour waves under
    grain) and a plain white image; searched alone, each should be no match with every reference."""
    rng = np.random.default_rng(0)
    y, x = np.mgrid[0:size, 0:size] / size
    waves = 0.5 + 0.3 * np.sin(6 * x[..., None] + 3 * y[..., None] + np.arange(3))
    photo = np.clip(255 * waves + rng.normal(0, 25, (size, size, 3)), 0, 255).astype(np.uint8)
    noise = rng.integers(0, 256, (size, size, 3), dtype=np.uint8)
    return [("a blue square", blue_square(size)), (PIXEL_NOISE, _png(Image.fromarray(noise))),
            ("a photo-like image", _png(Image.fromarray(photo))),
            ("a plain white image", _png(Image.new("RGB", (size, size), (255, 255, 255))))]


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
class NonFace:
    name: str
    verdicts: list[str]  # of every hit
    best: float  # the best calibrated probability


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
    non_faces: list[NonFace]  # each of :func:`non_faces` searched alone
    pairs: BandMetrics | None  # the same-subject fit's own held-out band (folds of candidate references)


@dataclass(frozen=True)
class JudgedAlone:
    """The reranker's judgement of a candidate alone (:data:`rerank.rubric.RERANK_CANDIDATE_ONLY`) on every ordered
    pair of the demo set's faces, reranked whatever the policy says, beside the recall score of the same pairs: AUC of
    "the same animal drawn again" and the mean P(yes) of twins, of the other faces, and of the face itself as the
    document (search matches that by rule and never asks the reranker; a judgement that compares the two images
    says yes to it)."""

    pairs: int
    twins: int
    recall_auc: float
    reranker_auc: float
    p_twin: float
    p_other: float
    p_identical: float
    p_spread: float  # the standard deviation of P(yes) over the pairs


def judged_alone(embedding: str | Path, reranker: str | Path, count: int = COUNT) -> JudgedAlone:
    from rubricsearch.app.demo.search_eval import SET_ID, SearchBench, auc
    from rubricsearch.rerank.protocol import Pair
    from rubricsearch.rerank.rubric import rubric_instructions
    from rubricsearch.retrieval.qwen.model.prompts import Content
    from rubricsearch.retrieval.search import SearchRequest
    from rubricsearch.retrieval.search.instructions import Rubric

    faces = demo_faces(count)
    images: list[ImageLike] = [decode_image(data) for _, data in demo_images(count)]
    bench = SearchBench(str(embedding), str(reranker), faces, images)
    recall: list[float] = []
    judged_p: list[float] = []
    same: list[bool] = []
    try:
        for i, image in enumerate(images):
            request = SearchRequest(set_id=SET_ID, candidate=image, top_k=count, top_n=count, rerank=True)
            for hit in bench.reranking.search(request).hits:
                j = bench.position[hit.sha256]
                if j != i:
                    recall.append(hit.ann_score)
                    judged_p.append(hit.score)
                    same.append(faces[j].key == faces[i].key)
        instruction = rubric_instructions(Rubric.parse(None, []), True).overall
        itself = bench.reranker.score_pairs([Pair(Content(images=[image]), Content(images=[image]), instruction)
                                             for image in images])
    finally:
        bench.close()
    p, y = np.asarray(judged_p), np.asarray(same)
    return JudgedAlone(len(y), int(y.sum()), round(auc(recall, same), 4), round(auc(judged_p, same), 4),
                       round(float(p[y].mean()), 4), round(float(p[~y].mean()), 4), round(float(np.mean(itself)), 4),
                       round(float(p.std()), 4))


def judged_alone_line(j: JudgedAlone) -> str:
    return (f"the reranker's judgement of a candidate alone on the set's {j.pairs} pairs ({j.twins} twins): AUC "
            f"{j.reranker_auc:.3f} (recall score {j.recall_auc:.3f}); mean P(yes) twins {j.p_twin:.3f}, other faces "
            f"{j.p_other:.3f}, the face itself {j.p_identical:.3f}, spread {j.p_spread:.3f}")


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
    alone = []
    for name, data in non_faces():
        hits = search(state, set_id, [], data).hits
        alone.append(NonFace(name, [str(h.verdict) for h in hits],
                             max((h.probability for h in hits if h.probability is not None), default=float("nan"))))
    pairs = calibration.candidate
    return SetQuality(calibration.version, None if calibration.mapping is None else calibration.mapping.method,
                      calibration.match_at, calibration.no_match_at, rows, pooled_shown, pooled_held, twins,
                      alone,
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
    for n in q.non_faces:
        lines.append(f"{n.name} alone: {sum(v == 'no_match' for v in n.verdicts)} of {len(n.verdicts)} hits no match, "
                     f"{sum(v == 'match' for v in n.verdicts)} match; best probability {f(n.best)}")
    if q.pairs is not None:
        lines.append(f"same-subject pairs held out: match precision {f(q.pairs.match_precision)} "
                     f"({q.pairs.matches}), no-match precision {f(q.pairs.no_match_precision)} "
                     f"({q.pairs.no_matches}), uncertain {q.pairs.share_uncertain:.3f}, AUC {f(q.pairs.auc)}")
    return "\n".join(lines)
