"""Retrieval quality on generated faces: do recall, reranking and the per-criterion breakdown follow the rubric?

The documents are the held-out ``eval`` split of :mod:`app.demo.faces` (never trained on), ingested as
ingestion ingests references; every query runs through the product's :class:`retrieval.search.SearchService`
with the reranker behind :class:`rerank.rubric.RubricReranker` (:mod:`app.demo.search_eval`), once in recall
order (``rerank=False``) and once as served (the top ``--shortlist`` of recall reranked, unless the reranker's
recorded policy, ``rubricsearch-policy.json``, steps aside for the query's kind; the policy is printed). The
nDCG@10 lines compare, per kind, the recall order, the reranked order (whatever the policy), fusions of the two,
and the order served. Query kinds: criteria only,
negative criteria, candidate only, candidate + criteria (candidates from a separate split), and every attribute
value as a single criterion. Both models load through the same loaders as real checkpoints.

Then the promises a user relies on (:mod:`app.demo.trust`, ``top_k = top_n = --trust-shortlist``): the share of
criteria met by the top 5 of two-criterion rubrics, in the product's order beside the recall order and the
other aggregates of the breakdown (mean, min; how the overall score's aggregate was chosen); single-criterion
precision@5 and breakdown AUC; the share of the top 5 without X for "no X"; and the match threshold (0.5)
on the identical image as candidate, statements no face meets, and every criterion some reference meets.
Last, what the Compare page shows (:mod:`app.demo.shown`): the demo set's faces judged at the threshold, every
single criterion over every face (precision of "match" and of "no match"), and the offered candidates' twins.

Metrics: R@k = |relevant ∩ top k| / min(k, |relevant|), nDCG@10 with graded gains
(:meth:`app.demo.rubrics.Query.gain`), and the per-criterion breakdown's AUC (does ``hit.criteria[c]`` separate
references that meet ``c`` from those that do not) over rubrics of two or three criteria. ``--baseline``: an
untrained embedder of the same size (the chance line of recall).

    .venv/bin/python bench/quality.py --embedding DIR/demo-embedding --reranker DIR/demo-reranker \
        [--baseline UNTRAINED] [--docs 120] [--queries 25] [--shortlist 20] [--rubrics 12] [--trust-rubrics 16] \
        [--trust-shortlist 40] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import asdict
from pathlib import Path

from rubricsearch.app.demo.evaluation import eval_queries, eval_set
from rubricsearch.app.demo.search_eval import Measurement, SearchBench, measure
from rubricsearch.app.demo.shown import demo_set_bench, measure_shown, shown_table
from rubricsearch.app.demo.trust import Trust, measure_trust, ndcg_by_order


def table(m: Measurement) -> str:
    lines = ["| kind | queries | R@1 | R@5 | nDCG@10 | served R@1 | R@5 | nDCG@10 |",
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


def trust_table(t: Trust) -> str:
    orders = " | ".join(f"{name} {value:.3f}" for name, value in t.criteria_met_top5.items())
    return "\n".join([
        f"two-criterion rubrics ({t.rubrics}), share of criteria met by the top 5: {orders}",
        f"single criteria: precision@5 {t.single_precision5:.3f}, breakdown AUC {t.single_auc:.3f}",
        f"'no X': share of the top 5 without X {t.negative_without_top5:.3f} ("
        + ", ".join(f"{c} {v:.1f}" for c, v in t.negative_by_criterion.items()) + ")",
        "best hit score: statements no face meets " + ", ".join(f"{c} {v:.3f}" for c, v in t.absent_best.items())
        + "; the weakest single criteria " + ", ".join(f"{c} {v:.3f}" for c, v in sorted(
            t.best_match.items(), key=lambda cv: cv[1])[:3]),
        f"threshold 0.5: identical candidate first and a match {t.identical_candidate_matches:.3f} (other "
        f"references above it per search {t.identical_others_above:.2f}); hits above it "
        f"for statements no face meets {t.absent_hits_above}; criteria some reference meets without a match "
        f"{t.criteria_without_match or 'none'}",
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--embedding", required=True, help="embedding checkpoint (path or cached hub id)")
    ap.add_argument("--reranker", default=None, help="reranker checkpoint (without it: recall only)")
    ap.add_argument("--baseline", default=None, help="an untrained embedding checkpoint of the same size")
    ap.add_argument("--docs", type=int, default=120)
    ap.add_argument("--queries", type=int, default=25, help="per kind")
    ap.add_argument("--shortlist", type=int, default=20, help="recall hits the reranker reorders")
    ap.add_argument("--rubrics", type=int, default=12, help="multi-criterion rubrics for the breakdown AUC")
    ap.add_argument("--trust-rubrics", type=int, default=16, help="two-criterion rubrics for the top-5 share")
    ap.add_argument("--trust-shortlist", type=int, default=40, help="top_k = top_n of the trust measurements")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    print(f"settings: docs {args.docs}, queries per kind {args.queries}, shortlist {args.shortlist}, rubrics "
          f"{args.rubrics}, trust rubrics {args.trust_rubrics}, trust shortlist {args.trust_shortlist}")
    docs, images = eval_set(args.docs)
    if args.reranker:
        from rubricsearch.rerank.rubric import read_policy

        for kind, p in read_policy(args.reranker).kinds.items():
            print(f"policy {kind}: rerank {p.rerank}, measured nDCG@10 {p.measured}, calibration {p.calibration}")
    report: dict[str, object] = {}
    for name, emb, rr in (("model", args.embedding, args.reranker), ("baseline", args.baseline, None)):
        if emb is None:
            continue
        t0 = time.perf_counter()
        bench = SearchBench(emb, rr, docs, images)
        try:
            m = measure(bench, per_kind=args.queries, rubrics=args.rubrics, shortlist=args.shortlist)
            t = measure_trust(bench, rubrics=args.trust_rubrics, shortlist=args.trust_shortlist) if rr else None
            orders = ndcg_by_order(bench, eval_queries(args.queries), shortlist=args.shortlist) if rr else {}
        finally:
            bench.close()
        print(f"## {name}\n{table(m)}")
        if t is not None:
            print(trust_table(t))
        for kind, by in orders.items():
            print(f"nDCG@10 {kind}: " + " | ".join(f"{order} {value:.3f}" for order, value in by.items()))
        print(f"({time.perf_counter() - t0:.1f} s)")
        report[name] = asdict(m) | ({"trust": asdict(t), "ndcg_by_order": orders} if t is not None else {})
    if args.reranker:  # what the Compare page shows: the demo set, each verdict at the threshold
        bench = demo_set_bench(args.embedding, args.reranker)
        try:
            shown = measure_shown(bench)
        finally:
            bench.close()
        print(f"## demo set\n{shown_table(shown)}")
        report["demo_set"] = asdict(shown)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
