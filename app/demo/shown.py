"""What the Compare page shows, measured: the demo set's faces judged at the match threshold.

The floors of :mod:`app.demo.trust` read the held-out faces by their top 5; a user reads the demo set that
``rubricsearch demo`` ingests and the verdict each hit gets (a match at or above the threshold). Over that set,
through the product's search path (``top_k = top_n`` = the whole set):

- every single criterion, presence and absence ("dark forehead stripes", "no forehead stripes", "not a fox"):
  the precision of "match" and of "no match" over every face, and the faces judged wrongly;
- each candidate the page offers, with the criteria of its title that a person checks (fur, ears, stripes):
  where its attribute twins in the set rank, and whether they are matches.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from rubricsearch.app.demo.faces import CANDIDATES, Criterion, candidate_images, demo_faces, demo_images
from rubricsearch.app.demo.search_eval import SearchBench
from rubricsearch.app.demo.trust import THRESHOLD, judged_criteria, served
from rubricsearch.retrieval.images import decode_image

TWIN_CRITERIA = ("fur", "ears", "stripes")  # what the page's first candidate is compared by in the README


@dataclass
class Shown:
    """The demo set at the threshold (see the module docstring)."""

    match_precision: float  # of the faces judged a match, the share that meets the criterion
    no_match_precision: float  # of the faces judged no match, the share that does not
    pairs: int  # (criterion, face) verdicts judged
    wrong: dict[str, list[str]] = field(default_factory=dict)  # criterion -> faces judged wrongly
    twins: list[tuple[str, int, float]] = field(default_factory=list)  # candidate, its best twin's rank and score


def demo_set_bench(embedding: str, reranker: str | None) -> SearchBench:
    """The demo set (the faces and pixels ``rubricsearch demo`` ingests) in a :class:`SearchBench`."""
    return SearchBench(embedding, reranker, demo_faces(), [decode_image(data) for _, data in demo_images()])


def measure_shown(bench: SearchBench) -> Shown:
    everyone = len(bench.docs)
    tp = fp = tn = fn = 0
    wrong: dict[str, list[str]] = {}
    criteria = judged_criteria()
    for c in criteria:
        for hit in served(bench, [c.text], everyone):
            face = bench.docs[bench.position[hit.sha256]]
            match, holds = hit.score >= THRESHOLD, c.holds(face)
            tp, fp = tp + (match and holds), fp + (match and not holds)
            tn, fn = tn + (not match and not holds), fn + (not match and holds)
            if match != holds:
                wrong.setdefault(c.text, []).append(face.name)
    twins: list[tuple[str, int, float]] = []
    for face, (name, data) in zip(CANDIDATES, candidate_images(), strict=True):
        texts = [Criterion(a, face.value(a)).text for a in TWIN_CRITERIA]
        hits = served(bench, texts, everyone, candidate=decode_image(data))
        ranked = [(rank, h.score) for rank, h in enumerate(hits, 1)
                  if bench.docs[bench.position[h.sha256]].key == face.key]
        if ranked:
            twins.append((name, *ranked[0]))
    return Shown(tp / max(tp + fp, 1), tn / max(tn + fn, 1), tp + fp + tn + fn, wrong, twins)


def shown_table(s: Shown) -> str:
    lines = [f"demo set at the threshold {THRESHOLD}: precision of 'match' {s.match_precision:.3f}, of 'no match' "
             f"{s.no_match_precision:.3f} ({s.pairs} criterion-face verdicts)"]
    lines += [f"  wrong on {c!r}: {len(faces)} ({', '.join(faces[:4])}{' …' if len(faces) > 4 else ''})"
              for c, faces in sorted(s.wrong.items(), key=lambda cf: -len(cf[1]))]
    lines += [f"  twin of {name}: rank {rank}, score {score:.3f} ({'match' if score >= THRESHOLD else 'no match'})"
              for name, rank, score in s.twins]
    return "\n".join(lines)
