"""Which score could give candidate-only searches a `match` for the same subject drawn again (issue 47 item 3,
issue 50 item 2)? Cohort normalisations (Z-norm, symmetric S-norm) and other cheap scores, measured on the demo set.

Every ordered pair of the 40-face demo set (1,560 pairs, 40 of them twins: the same animal drawn again) is scored
through the product's search path (:class:`app.demo.search_eval.SearchBench`: the references ingested as ingestion
embeds them, each face searched as a candidate alone, the whole set ranked, the identical hit left out), and each
score is put through the same-subject fit the refit runs (:func:`rerank.calibration.fit`, its input mapped into
(0, 1) by a sigmoid: Platt on its logit is then logistic regression on the score, and isotonic ignores the map).
Held out as the fit is: five folds of candidates, each fold's verdicts from a fit on the other folds' pairs (the
thresholds too). Then the fit on every pair judges the three offered candidates (not in the set; two twins each in
it) and the uploads that show no animal (``app.demo.set_quality.non_faces``), whose 40 hits must all be `no match`.

The scores (``C`` = ``--cohort``, the cohort never holds the candidate's identical hit):

* ``recall``: the vector score s the fit sees today (candidate-only searches keep the recall order);
* ``z-norm``: (s − mean) / std of the candidate's top-C scores against the set (what candidate-only verdicts read,
  :func:`app.calibration_pairs.cohort_z`, at ``C`` = :data:`~app.calibration_pairs.COHORT`);
* ``s-norm``: the mean of that and the reference's own z, from its top-C scores as a document against the set's
  other faces searched as candidates (precomputable per reference at fit time);
* ``s − mean``: s less the candidate's top-C mean;
* ``doc·doc``: the cosine of the two images both embedded as references are (no query instruction);
* ``profile``: the correlation of the two faces' score rows over the set (second-order similarity).

A normalisation from the candidate's own cohort is monotone within one candidate's hits, so it never changes which
reference it ranks first: ``twin first`` bounds what any of them can make a match.

    .venv/bin/python bench/same_subject_scores.py --embedding DIR/demo-embedding [--cohort 20] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
from numpy.typing import NDArray

from rubricsearch.app.calibration_pairs import COHORT, cohort_z
from rubricsearch.app.demo.faces import ATTRIBUTES, CANDIDATES, Face, candidate_images, demo_faces, demo_images
from rubricsearch.app.demo.search_eval import SET_ID, SearchBench
from rubricsearch.app.demo.set_quality import COUNT, non_faces
from rubricsearch.rerank.calibration import Calibration, fit, reference_folds
from rubricsearch.rerank.metrics import auc, sigmoid
from rubricsearch.retrieval.images import ImageLike, decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content
from rubricsearch.retrieval.search import SearchRequest

Array = NDArray[np.float64]


@dataclass(frozen=True)
class Probe:
    """One candidate's view of the set: its recall scores and document-vector cosines with every reference, and
    which reference is itself (None: not in the set)."""

    recall: Array
    doc: Array
    itself: int | None


@dataclass(frozen=True)
class Row:
    score: str
    auc: float
    twin_first: int  # candidates whose twin is their best-scored other face
    leading_twins: int  # the best-scored pairs of the set before the first non-twin
    twins_at_target: int  # twins above the lowest threshold whose pairs are ≥ 0.9 twins (in sample, no bound)
    top_40_precision: float  # share of twins among the 40 best-scored pairs (as many as there are twins)
    method: str
    held_out_match_precision: float | None
    held_out_matches: int
    held_out_twins_matched: int
    held_out_no_match_precision: float | None
    candidate_twins_matched: int  # of the offered candidates' 6 twins, by the fit on every pair
    # name → (match, uncertain) of its 40 hits, its best probability, twin pairs of the set scored below its best hit
    non_faces: dict[str, tuple[int, int, float, int]]


def probes(bench: SearchBench, images: Sequence[ImageLike], set_shas: list[str]) -> list[Probe]:
    docs = bench.index.vectors(SET_ID, set_shas)
    d = np.stack([docs[s] for s in set_shas]).astype(np.float64)
    own = bench.embedder.embed_contents([Content(images=[i]) for i in images], [None] * len(images),
                                        dimensions=d.shape[1])
    out = []
    for image, vector in zip(images, own, strict=True):
        hits = bench.service.search(SearchRequest(set_id=SET_ID, candidate=image, top_k=len(set_shas),
                                                  top_n=len(set_shas), rerank=False)).hits
        by = {h.sha256: h.ann_score for h in hits}
        itself = set_shas.index(image.sha256) if image.sha256 in set_shas else None
        out.append(Probe(np.array([by[s] for s in set_shas]), d @ np.asarray(vector, np.float64), itself))
    return out


def cohort(row: Array, itself: int | None, size: int) -> tuple[float, float]:
    """Mean and standard deviation of a row's ``size`` best scores, the identical hit left out."""
    kept = np.delete(row, [itself]) if itself is not None else row
    top = np.sort(kept)[::-1][:size]
    return float(top.mean()), float(top.std()) + 1e-6


def scorers(set_probes: list[Probe], size: int) -> dict[str, Callable[[Probe], Array]]:
    s = np.stack([p.recall for p in set_probes])
    n = len(s)
    by_reference = [cohort(s[:, j], j, size) for j in range(n)]  # reference j's scores as a document
    ref_mean = np.array([m for m, _ in by_reference])
    ref_std = np.array([sd for _, sd in by_reference])

    def z(p: Probe) -> Array:  # the product's normalisation (app.calibration_pairs), on the same cohort
        kept = np.delete(p.recall, [p.itself]) if p.itself is not None else p.recall
        return cohort_z(p.recall, np.sort(kept)[::-1][:size])

    def profile(p: Probe) -> Array:
        x = (s - s.mean(1, keepdims=True)) / s.std(1, keepdims=True)
        q = (p.recall - p.recall.mean()) / p.recall.std()
        return np.asarray(x @ q / n, np.float64)

    return {"recall": lambda p: p.recall, "z-norm": z,
            "s-norm": lambda p: 0.5 * (z(p) + (p.recall - ref_mean) / ref_std),
            "s − mean": lambda p: p.recall - cohort(p.recall, p.itself, size)[0],
            "doc·doc": lambda p: p.doc, "profile": profile}


def measure(name: str, score: Callable[[Probe], Array], set_probes: list[Probe], keys: list[tuple[str, ...]],
            candidates: list[tuple[Probe, tuple[str, ...]]], others: list[tuple[str, Probe]]) -> Row:
    n = len(set_probes)
    rows = [score(p) for p in set_probes]
    x, same, owner = [], [], []
    first = 0
    for i, r in enumerate(rows):
        order = [j for j in np.argsort(-r, kind="stable") if j != i]
        first += keys[order[0]] == keys[i]
        for j in range(n):
            if j != i:
                x.append(float(r[j]))
                same.append(keys[j] == keys[i])
                owner.append(str(i))
    xs, y = np.asarray(x), np.asarray(same)
    ranked = y[np.argsort(-xs, kind="stable")]
    precision = np.cumsum(ranked) / np.arange(1, len(ranked) + 1)
    reach = np.flatnonzero(precision >= 0.9)
    at_target = int(np.cumsum(ranked)[reach.max()]) if reach.size else 0
    now = datetime.now(UTC)

    def fitted(at: NDArray[np.bool_]) -> Calibration:
        return fit(sigmoid(xs[at]), y[at], [o for o, a in zip(owner, at, strict=True) if a], ["same"] * int(at.sum()),
                   model_key="bench", max_judgment_id=0, fitted_at=now)

    fold = reference_folds(owner)
    band = np.empty(len(y), dtype=object)
    for k in np.unique(fold):
        test = fold == k
        band[test] = fitted(~test).verdicts(sigmoid(xs[test])) or ["uncertain"] * int(test.sum())
    match, no_match = band == "match", band == "no_match"
    every = fitted(np.ones(len(y), dtype=bool))
    twins = 0
    for probe, key in candidates:
        v = every.verdicts(sigmoid(score(probe))) or []
        twins += sum(v[j] == "match" for j in range(n) if keys[j] == key)
    shown = {}
    for label, probe in others:
        q = sigmoid(score(probe))
        v = every.verdicts(q) or ["uncertain"] * n
        p = every.probability(q)
        shown[label] = (v.count("match"), v.count("uncertain"), round(float(p.max()) if p is not None else 0.0, 4),
                        int((xs[y] < score(probe).max()).sum()))
    return Row(name, round(auc(xs, y), 4), first, int(np.argmin(ranked)) if not ranked.all() else len(ranked),
               at_target, round(float(ranked[:int(y.sum())].mean()), 4),
               every.mapping.method if every.mapping is not None else every.status,
               round(float(y[match].mean()), 4) if match.any() else None, int(match.sum()), int((match & y).sum()),
               round(float((~y[no_match]).mean()), 4) if no_match.any() else None, twins, shown)


def table(rows: list[Row], size: int) -> str:
    def f(v: float | None) -> str:
        return "–" if v is None else f"{v:.3f}"

    names = list(rows[0].non_faces)
    lines = [f"cohort C = {size}; 1,560 ordered pairs of the demo set, 40 twins",
             "| score | AUC | twin first (of 40) | leading twins | twins at ≥ 0.9 in sample | top-40 precision | fit | "
             "held out: match precision (n) | twins match | no-match precision | candidates' twins match (of 6) | "
             + " | ".join(f"{n}: match / uncertain (best p; twins below)" for n in names) + " |",
             "|---|---:|---:|---:|---:|---:|---|---:|---:|---:|---:|" + "---|" * len(names)]
    for r in rows:
        nf = " | ".join(f"{m} / {u} ({p:.3f}; {b})" for m, u, p, b in r.non_faces.values())
        lines.append(f"| {r.score} | {r.auc:.3f} | {r.twin_first} | {r.leading_twins} | {r.twins_at_target} | "
                     f"{r.top_40_precision:.3f} | {r.method} | "
                     f"{f(r.held_out_match_precision)} ({r.held_out_matches}) | {r.held_out_twins_matched} | "
                     f"{f(r.held_out_no_match_precision)} | {r.candidate_twins_matched} | {nf} |")
    return "\n".join(lines)


def confusions(set_probes: list[Probe], faces: list[Face]) -> str:
    """What the recall score's best-scored other face differs in where it is not the candidate's twin."""
    counts: Counter[str] = Counter()
    for i, p in enumerate(set_probes):
        best = max((j for j in range(len(faces)) if j != i), key=lambda j: p.recall[j])
        differ = [a for a in ATTRIBUTES if faces[best].value(a) != faces[i].value(a)]
        if differ:
            counts[" + ".join(differ)] += 1
    return ("recall score, the best-scored other face where it is not the twin differs in: "
            + ", ".join(f"{k} {v}" for k, v in counts.most_common()))


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", required=True)
    ap.add_argument("--cohort", type=int, default=COHORT)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    faces = demo_faces(COUNT)
    images: list[ImageLike] = [decode_image(data) for _, data in demo_images(COUNT)]
    bench = SearchBench(args.embedding, None, faces, images)
    try:
        shas = [i.sha256 for i in images]
        set_probes = probes(bench, images, shas)
        offered = probes(bench, [decode_image(data) for _, data in candidate_images()], shas)
        uploads = non_faces()
        blank = probes(bench, [decode_image(data) for _, data in uploads], shas)
    finally:
        bench.close()
    keys = [f.key for f in faces]
    candidates = [(p, c.key) for p, c in zip(offered, CANDIDATES, strict=True)]
    others = [(name, p) for (name, _), p in zip(uploads, blank, strict=True)]
    rows = [measure(name, score, set_probes, keys, candidates, others)
            for name, score in scorers(set_probes, args.cohort).items()]
    print(table(rows, args.cohort))
    print(confusions(set_probes, faces))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
