/* Admin page, "Does it work on my images?": per set a Quality disclosure that loads GET /v1/sets/{set}/quality
   when opened (per criterion: yes/no judgments, AUC, precision of match, share uncertain, too few judgments said
   plainly; the same for a candidate image searched alone, on the set's same-subject pairs) and a Refit button (POST /v1/sets/{set}/calibration) that shows held-out log-loss and calibration
   error before (raw scores) and after calibration. Every failure is shown in the panel. */
"use strict";

(() => {
  const { api, el } = window.RS;
  const $ = (id) => document.getElementById(id);
  const panels = new Map(); // set id -> its <details>, kept across reloads of the sets so an open one stays open
  const base = (setId) => `/v1/sets/${encodeURIComponent(setId)}`;
  const num = (x, digits = 2) => (typeof x === "number" ? x.toFixed(digits) : "–");
  const share = (x) => (typeof x === "number" ? `${Math.round(100 * x)} %` : "–");
  const STATUS = {
    calibrated: "Calibrated: results get match / uncertain / no match verdicts.",
    too_few: "Too few judgments: nothing fitted, results get no verdicts.",
    no_separation: "The reranker does not tell yes from no on these judgments: every result is uncertain.",
    not_fitted: "Not fitted yet: record judgments; the calibration follows them.",
  };

  function criteriaTable(rows) {
    const head = ["Criterion", "Judgments (yes / no)", "AUC", "Precision of match", "Share uncertain", "Note"];
    return el("div", { class: "table-scroll" }, el("table", { class: "data-table quality-table" },
      el("thead", {}, el("tr", {}, head.map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, rows.map((r) => el("tr", { dataset: { criterion: r.criterion } },
        el("td", { "data-label": "Criterion", text: r.criterion }),
        el("td", { "data-label": "Judgments (yes / no)", text: `${r.yes} / ${r.no}` }),
        el("td", { "data-label": "AUC", text: num(r.auc) }),
        el("td", { "data-label": "Precision of match", text: r.matches ? num(r.match_precision) : "– (no match given)" }),
        el("td", { "data-label": "Share uncertain", text: share(r.share_uncertain) }),
        el("td", { "data-label": "Note", text: r.too_few ? "Too few judgments to tell (fewer than 4 yes or 4 no)" : "–" }))))));
  }

  /* Candidate-only searches: their pairs, and the band on held-out pairs or why there is none. */
  function sameSubject(s) {
    if (!s) return "";
    const counted = `${s.pairs} pairs of judged references (${s.same} of the same subject, ${s.different} not)`;
    const h = s.held_out;
    if (!h) return `A candidate image alone: ${counted}; too few to tell: ${s.reason}.`;
    return `A candidate image alone, on ${counted}, held out: AUC ${num(h.auc)}, precision of match `
      + `${h.matches ? num(h.match_precision) : "– (no match given)"}, of no match `
      + `${h.no_matches ? num(h.no_match_precision) : "– (no no-match given)"}, share uncertain ${share(h.share_uncertain)}.`
      + (s.status === "no_separation" ? " The reranker does not tell the same subject from another here: every result is uncertain." : "");
  }

  function showQuality(node, q) {
    const follow = q.stale && q.stale.refit_pending ? "a refit is under way." : "refit to include them.";
    const stale = q.stale && q.stale.stale
      ? ` Judgments changed since (${q.stale.new} new, ${q.stale.gone} replaced or deleted): ${follow}` : "";
    const version = q.calibration_version ? `Version ${q.calibration_version}, ${q.judgments} judgments. ` : "";
    node.querySelector(".quality-status").textContent = `${STATUS[q.status] || q.status} ${version}${stale}`;
    node.querySelector(".quality-status").dataset.status = q.status;
    node.querySelector(".quality-reason").textContent = q.reason;
    const o = q.overall;
    node.querySelector(".quality-overall").textContent = o
      ? `All criteria, held out: AUC ${num(o.auc)}, precision of match ${o.matches ? num(o.match_precision) : "– (no match given)"}, `
        + `of no match ${o.no_matches ? num(o.no_match_precision) : "– (no no-match given)"}, share uncertain ${share(o.share_uncertain)}.`
      : "";
    node.querySelector(".quality-criteria").replaceChildren(q.per_criterion.length ? criteriaTable(q.per_criterion) : "");
    node.querySelector(".quality-same-subject").textContent = sameSubject(q.same_subject);
  }

  function fail(node, prefix, err) {
    const box = node.querySelector(".quality-error");
    box.textContent = `${prefix}: ${err.message}`;
    box.hidden = false;
  }

  async function load(node, setId) {
    node.querySelector(".quality-error").hidden = true;
    try {
      showQuality(node, await api("GET", `${base(setId)}/quality`));
      node.dataset.loaded = "true";
    } catch (err) {
      fail(node, "Could not load the quality report", err);
    }
  }

  async function refit(node, setId, button) {
    node.querySelector(".quality-error").hidden = true;
    const result = node.querySelector(".refit-result");
    button.disabled = true;
    result.textContent = "Refitting…";
    try {
      const fit = await api("POST", `${base(setId)}/calibration`);
      const h = fit.held_out;
      result.textContent = h
        ? `Refitted (version ${fit.version}, ${fit.mapping ? fit.mapping.method : "no"} calibration). Held-out log-loss: `
          + `before ${num(h.log_loss_raw, 3)}, after ${num(h.log_loss_calibrated, 3)}. Calibration error: before `
          + `${num(h.ece_raw, 3)}, after ${num(h.ece_calibrated, 3)}.`
        : `Refitted (version ${fit.version}): nothing fitted, ${fit.reason}.`;
      await load(node, setId);
    } catch (err) {
      result.textContent = "";
      fail(node, "Could not refit", err);
    } finally {
      button.disabled = false;
    }
  }

  function panel(s) {
    const refitButton = el("button", { type: "button", class: "button small primary", "aria-label": `Refit the calibration of ${s.name}` }, "Refit");
    const node = el("details", { class: "quality", dataset: { setId: s.id } },
      el("summary", { text: `Quality: ${s.name}` }),
      el("div", { class: "quality-actions" }, refitButton, el("span", { class: "refit-result status", role: "status" })),
      el("p", { class: "quality-error notice notice-error", role: "alert", hidden: true }),
      el("p", { class: "quality-status" }),
      el("p", { class: "quality-reason help" }),
      el("p", { class: "quality-overall" }),
      el("div", { class: "quality-criteria" }),
      el("p", { class: "quality-same-subject" }));
    refitButton.addEventListener("click", () => refit(node, s.id, refitButton));
    node.addEventListener("toggle", () => { if (node.open) load(node, s.id); });
    return node;
  }

  /* The panels of the listed sets, in their order; an existing one is kept as it is (open, loaded). */
  function qualityPanels(sets) {
    const list = $("quality-list");
    if (!list) return;
    const keep = new Set(sets.map((s) => s.id));
    [...panels.keys()].filter((id) => !keep.has(id)).forEach((id) => panels.delete(id));
    list.replaceChildren(...sets.map((s) => {
      if (!panels.has(s.id)) panels.set(s.id, panel(s));
      return panels.get(s.id);
    }));
    $("quality-empty").hidden = sets.length > 0;
  }

  window.RS.qualityPanels = qualityPanels;
})();
