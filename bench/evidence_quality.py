"""Per-criterion evidence on the demo truth: does the map point at where the faces draw the attribute?

Held-out ``eval`` faces (:mod:`app.demo.faces`, never trained on) know where their ears, forehead stripes and eyes
are drawn (:func:`app.demo.faces.regions`). For each face and attribute, the criterion the face meets ("round
ears", "dark forehead stripes" or "no forehead stripes", "blue eyes") is explained on the face with each method
of :mod:`rerank.evidence`, and the map (its magnitude |value|: where the judgement was made, whichever way) is
scored against the drawn region:

- pointing game: the map's largest cell overlaps the region;
- mass: the share of the map's magnitude on the region (each cell weighted by the share of it the region
  covers), beside the region's share of the image (what a map without information gets).

Beside them: a random map (its expected pointing game is the share of cells that overlap the region; its expected
mass is the area share), and the same maps from a reranker of the same architecture with random weights. Faces
are rendered at ``--sizes`` (the demo models train at 128 px: 16 merged tokens); the time per map is the median
wall time of one ``explain`` (one hit × one criterion) on this machine, beside its CPU time (the process's, which
other work on a shared machine moves less). The measurement itself is
:mod:`app.demo.evidence_eval`. For the trained reranker, a line per method times a search's evidence (5 faces x
their 3 criteria) computed together beside one map per call, with the ratio and the largest difference of a cell.

    .venv/bin/python bench/evidence_quality.py --reranker DIR/demo-reranker [--faces 60] [--sizes 128 256] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from dataclasses import asdict
from pathlib import Path

import torch

from rubricsearch.app.demo.evaluation import EVAL_SEED
from rubricsearch.app.demo.evidence_eval import Row, criterion_of, measure_evidence
from rubricsearch.app.demo.faces import REGION_ATTRIBUTES, draw_face, faces, png_bytes
from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.evidence import METHODS, Evidence, Method, explain, explain_many
from rubricsearch.rerank.local import LocalScoringRuntime
from rubricsearch.retrieval.images import decode_image
from rubricsearch.retrieval.qwen.model.prompts import Content


def random_weights(reranker_dir: Path, out: Path, seed: int = 0) -> Path:
    """The reranker's architecture (and tokenizer, processor) with freshly initialised weights."""
    from transformers import AutoConfig, Qwen3VLForConditionalGeneration

    torch.manual_seed(seed)
    model = Qwen3VLForConditionalGeneration._from_config(AutoConfig.from_pretrained(reranker_dir))
    model.save_pretrained(out)
    for path in reranker_dir.iterdir():
        if path.suffix in (".json", ".jinja") and not (out / path.name).exists() and path.name != "config.json":
            (out / path.name).write_bytes(path.read_bytes())
    (out / "rubricsearch-policy.json").unlink(missing_ok=True)
    return out


def table(rows: list[Row]) -> str:
    lines = ["| reranker | method | px | attribute | maps | pointing game | random map | mass on region | region "
             "area | judgement right | ms per map | CPU ms per map |", "|---|---|---:|---|" + "---:|" * 8]
    lines += [f"| {r.model} | {r.method} | {r.size} | {r.attribute} | {r.maps} | {r.pointing:.3f} | "
              f"{r.pointing_random:.3f} | {r.mass:.3f} | {r.area:.3f} | {r.agrees:.3f} | {r.ms_per_map:.0f} | "
              f"{r.cpu_ms_per_map:.0f} |"
              for r in rows]
    return "\n".join(lines)


def batched_line(runtime: LocalScoringRuntime, method: Method, size: int, hits: int = 5) -> str:
    """A search's evidence on the demo: ``hits`` faces × their 3 attributes' criteria, all maps in one
    :func:`rerank.evidence.explain_many` beside one ``explain`` per map (median of 3 runs each, after a warm-up);
    the maps must agree."""
    eval_faces = faces("eval", hits, seed=EVAL_SEED)
    images = [decode_image(png_bytes(draw_face(f, size=size, seed=EVAL_SEED))) for f in eval_faces]
    runtime.packages.get_or_encode(images)
    sizes = {image.sha256: (size, size) for image in images}
    asks = [(criterion_of(face, attribute), Content(images=[image]))
            for face, image in zip(eval_faces, images, strict=True) for attribute in REGION_ATTRIBUTES]

    def together() -> list[Evidence]:
        return explain_many(runtime, asks, sizes, method=method)

    def alone() -> list[Evidence]:
        return [explain(runtime, criterion, document, sizes, method=method) for criterion, document in asks]

    timed = {}
    for name, run in (("batched", together), ("one by one", alone)):
        run()
        runs = []
        for _ in range(3):
            started = time.perf_counter()
            found = run()
            runs.append(time.perf_counter() - started)
        timed[name] = (1000 * statistics.median(runs), found)
    worst = max(abs(a - b) for x, y in zip(timed["batched"][1], timed["one by one"][1], strict=True)
                for mx, my in zip(x.images, y.images, strict=True)
                for ra, rb in zip(mx.values, my.values, strict=True) for a, b in zip(ra, rb, strict=True))
    (batched, _), (one, _) = timed["batched"], timed["one by one"]
    return (f"{method} at {size} px, {len(asks)} maps ({hits} faces x {len(REGION_ATTRIBUTES)} criteria): batched "
            f"{batched:.0f} ms, one by one {one:.0f} ms, one by one / batched {one / max(batched, 1e-9):.2f}; "
            f"largest |difference| of a cell {worst:.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reranker", type=Path, required=True)
    parser.add_argument("--faces", type=int, default=60)
    parser.add_argument("--sizes", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    print(f"settings: faces={args.faces} sizes={','.join(map(str, args.sizes))} methods={','.join(args.methods)} "
          f"device=cpu dtype=float32 torch_threads={torch.get_num_threads()}   (held-out eval faces; ms per map: "
          "median wall and CPU time of one explain, one hit x one criterion)", flush=True)
    rows: list[Row] = []
    lines: list[str] = []
    with tempfile.TemporaryDirectory() as tmp:
        models = {"trained": args.reranker, "random weights": random_weights(args.reranker, Path(tmp) / "random")}
        for name, path in models.items():
            reranker = load_reranker(path, device="cpu", dtype="float32", fused_kernels=False)
            runtime = reranker.runtime
            assert isinstance(runtime, LocalScoringRuntime)
            for size in args.sizes:
                for method in args.methods:
                    rows += measure_evidence(runtime, name, method, size, args.faces)
                    print(table(rows[-len(REGION_ATTRIBUTES):]), flush=True)
                    if name == "trained":
                        lines.append(batched_line(runtime, method, size))
                        print(lines[-1], flush=True)
            reranker.close()
    print("\n".join(["", *lines, "", table(rows)]))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
