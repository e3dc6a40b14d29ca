/* The set's calibrated verdicts on the Compare page: a result's band (match / uncertain / no match) as a word with
   a glyph and an outline of its own (colour only adds), the calibrated chance beside the raw score, each criterion
   cell's band, why there is none when the calibration does not apply, and the "uncertain only" filter. */
"use strict";

(() => {
  const { el } = window.RS;
  /* Word, glyph and CSS class per band: the word carries the meaning, the glyph and outline tell the bands apart
     at a glance without colour. */
  const BANDS = {
    match: { word: "Match", glyph: "✓" },
    uncertain: { word: "Uncertain", glyph: "?" },
    no_match: { word: "No match", glyph: "✗" },
  };

  const pct = (p) => `${Math.round(100 * p)} %`;

  function badge(verdict, cls, label) {
    const band = BANDS[verdict];
    if (!band) return null;
    return el("span", { class: `verdict verdict-${verdict} ${cls}`, dataset: { verdict }, "aria-label": label || band.word },
      el("span", { class: "verdict-glyph", "aria-hidden": "true", text: band.glyph }), " ",
      el("span", { class: "verdict-word", text: band.word }));
  }

  /* A result card's verdict and its calibrated chance in words (null: no verdict); a hit without criterion cells
     is a candidate-alone search's, whose chance is that it shows the same subject. */
  function card(hit) {
    if (!hit.verdict) return null;
    const chance = typeof hit.probability === "number" ? pct(hit.probability) : null;
    const what = Object.keys(hit.criteria_verdicts || {}).length ? "Chance all criteria hold" : "Chance it shows the same subject";
    return el("div", { class: "card-verdict" }, badge(hit.verdict, "verdict-hit"),
      chance ? el("span", { class: "verdict-chance", text: `${what}: ${chance}` }) : null);
  }

  /* A criterion cell's verdict (the heatmap's ``extra``), with its calibrated chance. */
  function cell(hit, criterion) {
    const c = hit.criteria_verdicts && hit.criteria_verdicts[criterion];
    if (!c) return null;
    const where = `rank ${hit.rank}, ${criterion}`;
    return el("span", { class: "cell-verdict" }, badge(c.verdict, "verdict-cell", `${BANDS[c.verdict].word}: ${where}`),
      el("span", { class: "verdict-chance", text: pct(c.probability) }));
  }

  const num = (x, digits = 3) => (typeof x === "number" ? x.toFixed(digits) : "–");

  /* One plain line under the results about the set's calibration, and its numbers behind a disclosure. */
  function note(result) {
    const use = result.provenance ? result.provenance.calibration : null;
    const anyVerdict = result.hits.some((h) => h.verdict);
    if (!use) {
      return { line: result.hits.length ? "No verdicts: this set has no calibration yet. Record judgments (✓ / ✗): the set's calibration follows them." : "", detail: null };
    }
    let line = "";
    if (!use.applied) line = `No verdicts for this search: ${use.reason}.`;
    else if (use.status === "no_separation") line = "The reranker does not tell yes from no on this set's judgments, so every result is uncertain.";
    else if (anyVerdict) line = `Verdicts from the set's calibration (version ${use.version}, fitted on ${use.judgments} judgments).`;
    if (use.stale && use.stale.stale) line += ` Judgments changed since the fit (${use.stale.new} new, ${use.stale.gone} replaced or deleted): refit on the Admin page.`;
    const held = use.held_out;
    const pairs = use.fitted_to === "same_subject";
    const methods = { platt: "Platt scaling, sigmoid(a · logit(score) + b)", isotonic: "isotonic regression", raw: "the raw score itself" };
    const parts = [
      `Calibration version ${use.version} (${use.status.replace(/_/g, " ")}), fitted ${new Date(use.fitted_at).toLocaleString()} on ${use.judgments} judgments for ${use.model_key}.`,
      use.method ? `Method: ${methods[use.method] || use.method} of ${pairs ? `${use.reads === "cohort_z" ? "how far each result's recall score stands out of the candidate's nearest references (its distance above their mean, in their standard deviations)" : "the overall score"}, on pairs of references that the judgments say show the same subject or not` : "each criterion's raw score"}.` : null,
      `A ${pairs ? "result" : "cell"} is “Match” at a calibrated chance of at least ${num(use.match_at)} and “No match” at or below ${num(use.no_match_at)}; between them “Uncertain” (– : no threshold reached the target precision).`,
      pairs ? "The candidate's identical image is a match by rule. The raw score stays the search's."
        : "A result is “Match” when every criterion is, “No match” when any is, else “Uncertain”; its chance is the product of its criteria's chances. The raw score stays the reranker's.",
      held ? `Held-out log-loss ${num(held.log_loss_raw)} raw, ${num(held.log_loss_calibrated)} calibrated; calibration error ${num(held.ece_raw)} raw, ${num(held.ece_calibrated)} calibrated; precision of “Match” ${num(held.band.match_precision, 2)}, of “No match” ${num(held.band.no_match_precision, 2)}, share uncertain ${num(held.band.share_uncertain, 2)}.` : null,
    ].filter(Boolean);
    return { line, detail: parts.join(" ") };
  }

  /* Indexes of the hits the "uncertain only" filter keeps (all of them when it is off). */
  function kept(hits, uncertainOnly) {
    return hits.map((h, i) => i).filter((i) => !uncertainOnly || hits[i].verdict === "uncertain");
  }

  window.RS.verdict = { badge, card, cell, note, kept };
})();
