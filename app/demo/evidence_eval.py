"""Per-criterion evidence measured on the demo truth (``bench/evidence_quality.py`` prints it, the evidence tests
guard it): does the map of a criterion point at where :mod:`app.demo.faces` drew the attribute?

For each held-out ``eval`` face and each attribute drawn at one place (ears, forehead stripes, eyes), the criterion
the face meets ("round ears", "dark forehead stripes" or "no forehead stripes", "blue eyes") is explained on the
face (:func:`rerank.evidence.explain`), and the map's magnitude (where the judgement was made, whichever way) is
scored against the drawn region (:func:`app.demo.faces.regions`):

- pointing game: the map's largest cell overlaps the region;
- mass: the share of the map's magnitude on the region (each cell weighted by the share of it the region covers),
  beside the region's share of the image (what a map without information gets).

A random map's expected pointing game is the share of cells that overlap the region, its expected mass the area
share; both are reported beside the map's. The maps are those of the face's own judgement: the share of them whose
P(yes) agrees with the truth is reported too (the faces share a layout, so a map of another face would still point
near the attribute; it would not explain this face's judgement).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import numpy as np

from rubricsearch.app.demo.evaluation import EVAL_SEED
from rubricsearch.app.demo.faces import REGION_ATTRIBUTES, Criterion, Face, draw_face, faces, png_bytes, regions
from rubricsearch.rerank.evidence import ImageEvidence, Method, explain
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content


@dataclass(frozen=True)
class Row:
    model: str
    method: str
    size: int
    attribute: str
    maps: int
    pointing: float
    pointing_random: float
    mass: float
    area: float
    agrees: float  # share of maps whose judgement (P(yes) of the statement vs 0.5) agrees with the truth
    ms_per_map: float  # median wall time of one map
    cpu_ms_per_map: float  # median CPU time of the process for one map (what other work on the machine moves less)


def coverage(image: ImageEvidence, boxes: list[tuple[float, float, float, float]]) -> np.ndarray:
    """Per cell, the share of it the union of ``boxes`` covers (rasterised at the image's pixels)."""
    width, height = image.size
    mask = np.zeros((height, width), dtype=np.float64)
    for left, top, right, bottom in boxes:
        mask[max(0, round(top)):min(height, round(bottom)), max(0, round(left)):min(width, round(right))] = 1.0
    rows, cols = image.grid
    out = np.zeros((rows, cols))
    for r in range(rows):
        for c in range(cols):
            left, top, right, bottom = image.boxes[r][c]
            cell = mask[round(top):round(bottom), round(left):round(right)]
            out[r, c] = float(cell.mean()) if cell.size else 0.0
    return out


def criterion_of(face: Face, attribute: str) -> str:
    return Criterion(attribute, face.value(attribute)).text


def measure_evidence(runtime: LocalScoringRuntime, model: str, method: Method, size: int, count: int) -> list[Row]:
    eval_faces = faces("eval", count, seed=EVAL_SEED)
    images = [decode_image(png_bytes(draw_face(f, size=size, seed=EVAL_SEED))) for f in eval_faces]
    runtime.packages.get_or_encode(images)  # the references' packages, as ingestion leaves them
    rows = []
    for attribute in REGION_ATTRIBUTES:
        hits, chance, mass, area, agrees, seconds, cpu = [], [], [], [], [], [], []
        for face, image in zip(eval_faces, images, strict=True):
            started, cpu_started = time.perf_counter(), time.process_time()
            found = explain(runtime, criterion_of(face, attribute), Content(images=[image]),
                            {image.sha256: (size, size)}, method=method)
            seconds.append(time.perf_counter() - started)
            cpu.append(time.process_time() - cpu_started)
            assert found.vision_encodes == 0
            agrees.append(float((found.p_yes > 0.5) != found.negated))
            (mapped,) = found.images
            cover = coverage(mapped, regions(face, size=size, seed=EVAL_SEED)[attribute])
            weight = np.abs(np.asarray(mapped.values))
            hits.append(float(cover.flat[int(weight.argmax())] > 0))
            chance.append(float((cover > 0).mean()))
            mass.append(float((weight * cover).sum() / max(weight.sum(), 1e-30)))
            area.append(float(cover.mean()))
        rows.append(Row(model, method, size, attribute, len(hits), statistics.mean(hits), statistics.mean(chance),
                        statistics.mean(mass), statistics.mean(area), statistics.mean(agrees),
                        1000 * statistics.median(seconds), 1000 * statistics.median(cpu)))
    return rows


