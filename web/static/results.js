/* The Compare page's views of one search response that depend on nothing else on the page: the per-criterion
   heatmap and how its overall score is formed, the provenance panel and a card's "identical image" badge. */
"use strict";

(() => {
  const { el, fmtScore, heat } = window.RS;

  /* The heatmap's rows (overall, then one per criterion) over the ranked hits, as the children of its table; a column
     header opens that hit side by side (``open(i)``), ``thumb(hit)`` draws its thumbnail. ``stretch`` spreads each
     row's colours over that row's own range instead of 0..1. ``extra(hit, criterion)`` adds to a criterion's cell
     (its verdict and the judgment controls) after its score; each hit's column carries ``data-index``. */
  function heatmap(result, criteria, stretch, open, thumb, extra) {
    const hits = result.hits;
    const caption = el("caption", { class: "sr-only", text: "Scores per criterion for each ranked reference" });
    const head = el("tr", {}, el("th", { scope: "col", text: "Criterion" }));
    hits.forEach((hit, i) => {
      head.append(el("th", { scope: "col", dataset: { index: String(i) } },
        el("button", { type: "button", class: "col-button", "aria-label": `Side by side: rank ${hit.rank}`, onclick: () => open(i) },
          thumb(hit), `#${hit.rank}`)));
    });
    const body = el("tbody");
    const row = (label, values, cls, criterion) => {
      const tr = el("tr", { class: cls }, el("th", { scope: "row", text: label }));
      const nums = values.filter((v) => typeof v === "number");
      const lo = stretch && nums.length ? Math.min(...nums) : 0;
      const hi = stretch && nums.length ? Math.max(...nums) : 1;
      values.forEach((v, i) => {
        const td = el("td", { class: "cell", dataset: { index: String(i) } }, el("span", { class: "cell-score", text: fmtScore(v) }),
          criterion !== undefined && extra ? extra(hits[i], criterion) : null);
        if (typeof v === "number") {
          const c = heat(v, lo, hi);
          td.style.backgroundColor = c.bg;
          td.style.color = c.fg;
        }
        tr.append(td);
      });
      body.append(tr);
    };
    row("Overall", hits.map((h) => h.score), "overall");
    criteria.forEach((c) => row(c, hits.map((h) => (h.criteria && typeof h.criteria[c] === "number" ? h.criteria[c] : null)), undefined, c));
    return [caption, el("thead", {}, head), body];
  }

  /* Plain words first, the formula or measurement behind them in a "Details" disclosure. */
  function explained(text, detail) {
    return [text, detail ? el("details", { class: "detail" }, el("summary", { text: "Details" }), el("p", { text: detail })) : null];
  }

  /* How the overall score was formed, as the API states it (formulas, calibration), behind a disclosure. */
  function scoreDetails(result) {
    const formed = result.provenance && result.provenance.score ? result.provenance.score.formed : "";
    return formed ? el("details", { class: "detail", dataset: { testid: "score-details" } },
      el("summary", { text: "How the overall score is formed" }), el("p", { text: formed })) : null;
  }

  /* A hit whose bytes are the candidate's (same sha256) is that image: say so on its card. */
  function identicalBadge(hit) {
    return hit.identical
      ? el("span", { class: "card-flag identical", title: "same bytes (sha256) as the candidate", text: "Identical image" })
      : null;
  }

  function modelText(m) {
    if (!m) return "none";
    return m.revision ? `${m.id} @ ${m.revision}` : m.id;
  }

  /* The provenance panel of a search response: models, instructions, how the score was formed, encodes, timings. */
  function provenanceList(result) {
    const p = result.provenance || {};
    const instr = p.instructions || {};
    const items = [
      ["Embedding model", modelText(p.embedding_model)],
      ["Reranker model", modelText(p.reranker_model)],
      ["Reranking", p.reranked ? "ran" : `did not run (${p.rerank_status || "unknown"})`],
      ["Rerank policy", p.rerank_policy && p.rerank_policy.measured_ndcg10
        ? `${p.rerank_policy.kind} searches: ${p.rerank_policy.rerank ? "reranked" : "recall order kept"} (measured `
          + `nDCG@10 ${p.rerank_policy.measured_ndcg10.reranked.toFixed(3)} reranked, `
          + `${p.rerank_policy.measured_ndcg10.recall.toFixed(3)} recall order)`
        : null],
      ["Query instruction", instr.query],
      ["Document instruction", instr.document],
      ["Overall score", p.score ? p.score.formed : null],
      ["Negated criteria", p.score && p.score.judged && p.score.judged.some((j) => j.score !== "P(statement)")
        ? p.score.judged.filter((j) => j.score !== "P(statement)").map((j) => `${j.criterion}: 1 − P(“${j.statement}”)`)
        : null],
      ["Identical image", p.identical
        ? `${p.identical.found}; score: ${p.identical.score}`
          + (p.identical.recall_rank ? ` (recall rank ${p.identical.recall_rank})` : " (taken from the set: recall missed it)")
        : null],
      ["Rerank instruction", instr.rerank],
      ["Per-criterion instructions", Array.isArray(instr.per_criterion) && instr.per_criterion.length ? instr.per_criterion : null],
      ["Dimensions", p.dimensions],
      ["Shortlist (top K) / shown (top N)", `${p.top_k ?? "–"} / ${p.top_n ?? "–"}`],
      ["Vision encoder runs", p.vision
        ? `${p.vision.total} (query images: ${p.vision.query}, references: ${p.vision.reference}` +
          `${p.vision.towers_shared === false ? "; the models have different vision towers" : ""})`
        : p.vision_encodes],
      ["Models", result.models_label || "the configured models"],
    ];
    const timings = result.timings_ms || {};
    const timingItems = Object.entries(timings).map(([k, v]) => `${k.replace(/_/g, " ")}: ${Number(v).toFixed(1)} ms`);
    timingItems.push(`round trip in the browser: ${result.clientMs.toFixed(0)} ms`);
    items.push(["Timings", timingItems]);
    const dl = el("dl", { class: "prov-list" });
    items.forEach(([k, v]) => {
      if (v === undefined || v === null || v === "") return;
      dl.append(el("dt", { text: k }));
      dl.append(el("dd", {}, Array.isArray(v) ? el("ul", {}, v.map((x) => el("li", { text: x }))) : String(v)));
    });
    return dl;
  }

  Object.assign(window.RS, { heatmap, scoreDetails, explained, provenanceList, identicalBadge });
})();
