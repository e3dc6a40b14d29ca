"""Retrieval quality on generated faces: does the recall stage follow the rubric?

The documents are the held-out ``eval`` split of :mod:`app.demo.faces` (never trained on), embedded as
ingestion embeds references (default instruction); queries come from :mod:`app.demo.rubrics` in the four
kinds a user searches with (criteria only, negative criteria, candidate only, candidate + criteria), with
candidates drawn from the separate ``candidate`` split, and are embedded as search embeds them (rubric text
after the candidate image, under the recall instruction of ``retrieval/search/instructions.py``). The
model goes through the same loader as a real checkpoint (:func:`retrieval.load_embedder`).

Metrics per kind: R@k = |relevant ∩ top k| / min(k, |relevant|) (so 1.0 is reachable when fewer than k
are relevant), and nDCG@10 with graded gains (:meth:`app.demo.rubrics.Query.gain`). A random-weight
checkpoint of the same architecture gives the chance line to compare against (``--baseline``).

    .venv/bin/python bench/quality.py --embedding DIR [--baseline DIR] [--docs 120] [--queries 40]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from app.demo.evaluation import Scores, eval_queries, eval_set, evaluate


def table(name: str, rows: list[Scores]) -> str:
    lines = [f"| {name} | kind | queries | R@1 | R@5 | nDCG@10 |", "|---|---|---:|---:|---:|---:|"]
    lines += [f"| | {s.kind} | {s.queries} | {s.r1:.3f} | {s.r5:.3f} | {s.ndcg10:.3f} |" for s in rows]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--embedding", required=True, help="embedding checkpoint (path or cached hub id)")
    ap.add_argument("--baseline", default=None, help="a random-weight checkpoint of the same size (chance line)")
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--queries", type=int, default=40, help="per kind")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    docs, images = eval_set(args.docs)
    queries = eval_queries(args.queries)
    report: dict[str, list[dict[str, float | int | str]]] = {}
    for name, path in (("model", args.embedding), ("baseline", args.baseline)):
        if path is None:
            continue
        t0 = time.perf_counter()
        rows = evaluate(path, queries, docs, images)
        print(table(name, rows))
        print(f"({name}: {time.perf_counter() - t0:.1f} s)")
        report[name] = [s.__dict__ for s in rows]
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
