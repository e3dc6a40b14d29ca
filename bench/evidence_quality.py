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
:mod:`app.demo.evidence_eval`.

    .venv/bin/python bench/evidence_quality.py --reranker DIR/demo-reranker [--faces 60] [--sizes 128 256] \
        [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import tempfile
from dataclasses import asdict
from pathlib import Path

import torch

from rubricsearch.app.demo.evidence_eval import Row, measure_evidence
from rubricsearch.app.demo.faces import REGION_ATTRIBUTES
from rubricsearch.rerank import load_reranker
from rubricsearch.rerank.evidence import METHODS
from rubricsearch.rerank.local import LocalScoringRuntime


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
            reranker.close()
    print("\n" + table(rows))
    if args.json:
        args.json.write_text(json.dumps([asdict(r) for r in rows], indent=2))


if __name__ == "__main__":
    main()
