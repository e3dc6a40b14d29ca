"""Retrieval quality on generated faces: do recall, reranking and the per-criterion breakdown follow the rubric?

The documents are the held-out ``eval`` split of :mod:`app.demo.faces` (never trained on), ingested as
ingestion ingests references; every query runs through the product's :class:`retrieval.search.SearchService`
with the reranker behind :class:`rerank.rubric.RubricReranker` (:mod:`app.demo.search_eval`), once in recall
order (``rerank=False``) and once reranked (the top ``--shortlist`` of recall). Query kinds: criteria only,
negative criteria, candidate only, candidate + criteria (candidates from a separate split), and every attribute
value as a single criterion. Both models load through the same loaders as real checkpoints.

Metrics: R@k = |relevant ∩ top k| / min(k, |relevant|), nDCG@10 with graded gains
(:meth:`app.demo.rubrics.Query.gain`), and the per-criterion breakdown's AUC (does ``hit.criteria[c]`` separate
references that meet ``c`` from those that do not) over rubrics of two or three criteria. ``--baseline``: an
untrained embedder of the same size (the chance line of recall).

    .venv/bin/python bench/quality.py --embedding DIR/demo-embedding --reranker DIR/demo-reranker \
        [--baseline UNTRAINED] [--docs 120] [--queries 25] [--shortlist 20] [--rubrics 12] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from app.demo.evaluation import eval_set
from app.demo.search_eval import Measurement, SearchBench, measure


def table(m: Measurement) -> str:
    lines = ["| kind | queries | R@1 | R@5 | nDCG@10 | reranked R@1 | R@5 | nDCG@10 |",
             "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for q in (m.kinds, m.single):
        for kind, b in q.before.items():
            name = "single criterion" if q is m.single else kind
            row = f"| {name} | {b.queries} | {b.r1:.3f} | {b.r5:.3f} | {b.ndcg10:.3f} |"
            a = q.after.get(kind)
            lines.append(row + (f" {a.r1:.3f} | {a.r5:.3f} | {a.ndcg10:.3f} |" if a else " – | – | – |"))
    b = m.breakdown
    lines.append(f"\nper-criterion breakdown AUC: {b.mean:.3f} (present {b.present:.3f}, absent {b.absent:.3f}; "
                 f"{b.pairs} query-criterion pairs)")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", required=True, help="embedding checkpoint (path or cached hub id)")
    ap.add_argument("--reranker", default=None, help="reranker checkpoint (without it: recall only)")
    ap.add_argument("--baseline", default=None, help="an untrained embedding checkpoint of the same size")
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--queries", type=int, default=25, help="per kind")
    ap.add_argument("--shortlist", type=int, default=20, help="recall hits the reranker reorders")
    ap.add_argument("--rubrics", type=int, default=12, help="multi-criterion rubrics for the breakdown AUC")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    docs, images = eval_set(args.docs)
    report: dict[str, object] = {}
    for name, emb, rr in (("model", args.embedding, args.reranker), ("baseline", args.baseline, None)):
        if emb is None:
            continue
        t0 = time.perf_counter()
        bench = SearchBench(emb, rr, docs, images)
        try:
            m = measure(bench, per_kind=args.queries, rubrics=args.rubrics, shortlist=args.shortlist)
        finally:
            bench.close()
        print(f"## {name}\n{table(m)}\n({time.perf_counter() - t0:.1f} s)")
        report[name] = asdict(m)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
