"""Why a collar version's two-criterion rubrics miss in the top 5 (docs/fine-tuning.md, the learning test).

From the raw P(yes) of every criterion over the held-out collar faces (:meth:`app.demo.learning.Learning.
collar_scores`), before and after training: each criterion's AUC on those faces (an attribute the demo learned may
read worse on a face wearing a collar), the collar colours' confusions by fur (a red band next to ginger fur), and
per rubric the top 5 by the product's aggregate (the geometric mean of the two P(yes)), each wrong face named by
the criterion it fails, next to what the top 5 would be with either criterion answered by the truth or the two
aggregated by their minimum. Measurement only: nothing here is served.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from rubricsearch.app.demo.faces import COLLARS, VALUES, Face
from rubricsearch.app.demo.rubrics import Query
from rubricsearch.app.demo.search_eval import auc

Scores = Mapping[str, np.ndarray]  # criterion statement -> P(yes) per held-out face


def _top5(values: np.ndarray) -> list[int]:
    return [int(i) for i in np.argsort(-values, kind="stable")[:5]]


def _truth(docs: Sequence[Face], q: Query) -> list[np.ndarray]:
    return [np.array([c.holds(f) for f in docs], dtype=np.float64) for c in q.criteria]


def rubric_misses(docs: Sequence[Face], scores: Scores, queries: Sequence[Query]) -> tuple[list[str], dict[str, Any]]:
    """Per rubric (another attribute, then a collar): the top 5 by the geometric mean, the wrong faces by the
    criterion they fail; the shares all right as served, with the collar or the other criterion answered by the
    truth, and with the minimum as the aggregate."""
    lines: list[str] = []
    shares = {"served": 0, "collar truth": 0, "other truth": 0, "min aggregate": 0}
    causes = {"other": 0, "collar": 0, "both": 0}
    for q in queries:
        other, collar = (scores[c.text] for c in q.criteria)
        t_other, t_collar = _truth(docs, q)
        met = t_other * t_collar
        top = _top5(np.sqrt(other * collar))
        shares["served"] += all(met[top])
        shares["collar truth"] += all(met[_top5(np.sqrt(other * t_collar))])
        shares["other truth"] += all(met[_top5(np.sqrt(t_other * collar))])
        shares["min aggregate"] += all(met[_top5(np.minimum(other, collar))])
        slots = []
        for i in top:
            if met[i]:
                slots.append("ok")
                continue
            cause = "both" if not (t_other[i] or t_collar[i]) else ("other" if not t_other[i] else "collar")
            causes[cause] += 1
            slots.append(f"MISS {cause} ({docs[i].value('fur')} fur, {docs[i].collar} collar: "
                         f"{other[i]:.2f}/{collar[i]:.2f})")
        lines.append(f"  {' + '.join(c.text for c in q.criteria)} ({int(met.sum())} meet both): " + "; ".join(slots))
    n = max(1, len(queries))
    summary = {k: v / n for k, v in shares.items()}
    lines.insert(0, "rubric top 5 all meet both: " + ", ".join(f"{k} {v:.2f}" for k, v in summary.items())
                 + f"; wrong slots by the criterion failed: {causes}")
    return lines, {"top5": summary, "causes": causes}


def collar_confusions(docs: Sequence[Face], scores: Scores) -> tuple[list[str], dict[str, Any]]:
    """Per collar colour and fur: mean P(yes) on faces wearing that colour and on faces not, and the AUC
    within the fur; and the mean P(yes) on faces wearing the other colour and on faces with no collar."""
    lines, out = [], {}
    for colour in COLLARS:
        p = scores[f"a {colour} collar"]
        wears = np.array([f.collar == colour for f in docs])
        bare = np.array([f.collar == "none" for f in docs])
        row = {"other colour": float(p[~wears & ~bare].mean()), "no collar": float(p[bare].mean()),
               "wearing": float(p[wears].mean())}
        by_fur = {}
        for fur in VALUES["fur"]:
            of = np.array([f.value("fur") == fur for f in docs])
            by_fur[fur] = {"yes": float(p[of & wears].mean()) if (of & wears).any() else float("nan"),
                           "no": float(p[of & ~wears].mean()) if (of & ~wears).any() else float("nan"),
                           "auc": auc(p[of].tolist(), wears[of].tolist())}
        out[colour] = {**row, "by_fur": by_fur}
        lines.append(f"  a {colour} collar: mean P wearing {row['wearing']:.2f}, other colour {row['other colour']:.2f}"
                     f", no collar {row['no collar']:.2f}; by fur (P wearing / not, AUC): "
                     + ", ".join(f"{fur} {v['yes']:.2f}/{v['no']:.2f} ({v['auc']:.2f})" for fur, v in by_fur.items()))
    return lines, out


def diagnose(docs: Sequence[Face], base: Scores, tuned: Scores, queries: Sequence[Query]
             ) -> tuple[list[str], dict[str, Any]]:
    """The whole diagnosis of one version against the base, as printable lines and a JSON-able dict."""
    labels = {k: [c.holds(f) for f in docs] for k, c in
              {c.text: c for q in queries for c in q.criteria}.items()}
    aucs = {k: (auc(base[k].tolist(), labels[k]), auc(tuned[k].tolist(), labels[k])) for k in labels}
    lines = ["criteria AUC on the held-out collar faces, base -> version: "
             + ", ".join(f"{k} {a:.3f}->{b:.3f}" for k, (a, b) in aucs.items())]
    report: dict[str, Any] = {"collar_faces_auc": aucs}
    for name, scores in (("base", base), ("version", tuned)):
        conf_lines, conf = collar_confusions(docs, scores)
        rub_lines, rub = rubric_misses(docs, scores, queries)
        lines += [f"{name}: collar confusions", *conf_lines, f"{name}: {rub_lines[0]}"]
        if name == "version":
            lines += rub_lines[1:]
        report[name] = {"confusions": conf, "rubrics": rub}
    return lines, report
