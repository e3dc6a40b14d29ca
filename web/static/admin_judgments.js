/* Admin page, judgments: each set's count with a JSONL export link (a cell of the sets table), and deriving
   judgments from a metadata field: a dry run lists each value's statement (editable) with its yes/no counts,
   then Apply records them with the wording shown. */
"use strict";

(() => {
  const { api, el } = window.RS;
  const $ = (id) => document.getElementById(id);
  const base = (setId) => `/v1/sets/${encodeURIComponent(setId)}/judgments`;

  /* The sets table's Judgments cell: the count (one small page asks for the total) and the export link. */
  function judgmentsCell(s) {
    const count = el("span", { class: "judgment-count", text: "…" });
    const td = el("td", { "data-label": "Judgments" }, count, " ",
      el("a", { href: `${base(s.id)}?format=jsonl`, download: `${s.id}-judgments.jsonl`,
        "aria-label": `Export the judgments of ${s.name} (JSONL)` }, "Export"));
    api("GET", `${base(s.id)}?limit=1`)
      .then((page) => { count.textContent = String(page.total); })
      .catch((err) => { count.textContent = `? (${err.message})`; });
    return td;
  }

  window.RS.judgmentsCell = judgmentsCell;
  const form = $("derive-form");
  if (!form) return;
  const status = $("derive-status");
  let previewed = null; // {setId, key}: what Apply records

  function body(dryRun) {
    const statements = {};
    $("derive-preview").querySelectorAll("input[data-value]").forEach((input) => {
      if (input.value.trim() && input.value.trim() !== input.dataset.initial) statements[input.dataset.value] = input.value.trim();
    });
    return { key: previewed.key, statements, dry_run: dryRun, overwrite: $("derive-overwrite").checked };
  }

  function showPreview(out) {
    const rows = out.statements.map((s) => el("tr", {},
      el("td", { text: s.value }),
      el("td", {}, (() => {
        const input = el("input", { type: "text", maxlength: "500", "aria-label": `Statement for ${out.key} = ${s.value}`,
          dataset: { value: s.value, initial: s.statement } });
        input.value = s.statement;
        return input;
      })()),
      el("td", { class: "num", text: s.yes }),
      el("td", { class: "num", text: s.no })));
    $("derive-preview").replaceChildren(
      el("thead", {}, el("tr", {}, ...["Value", "Statement (editable)", "Yes", "No"].map((h) => el("th", { scope: "col", text: h })))),
      el("tbody", {}, rows));
    $("derive-summary").textContent = `${out.judgments} judgments for ${out.images} images`
      + (out.skipped_images ? `; ${out.skipped_images} images hold none of the values` : "")
      + (out.kept ? `; ${out.kept} cells judged by a person or client are kept` : "") + ".";
    $("derive-result").hidden = false;
  }

  function fail(prefix, err) {
    $("derive-error").textContent = `${prefix}: ${err.message}`;
    $("derive-error").hidden = false;
    status.textContent = `${prefix}.`;
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    $("derive-error").hidden = true;
    const setId = form.elements.set_id.value;
    const key = form.elements.key.value.trim();
    if (!setId || !key) { status.textContent = "Choose a set and name a metadata field."; return; }
    // edited wording belongs to the field it was previewed for
    if (!previewed || previewed.setId !== setId || previewed.key !== key) $("derive-preview").replaceChildren();
    previewed = { setId, key };
    try {
      showPreview(await api("POST", `${base(setId)}/derive`, { json: body(true) }));
      status.textContent = "Preview ready: nothing recorded yet.";
    } catch (err) {
      $("derive-result").hidden = true;
      fail("Could not derive judgments", err);
    }
  });

  $("derive-apply").addEventListener("click", async () => {
    if (!previewed) return;
    $("derive-error").hidden = true;
    try {
      const out = await api("POST", `${base(previewed.setId)}/derive`, { json: body(false) });
      status.textContent = `Recorded ${out.judgments} judgments from “${out.key}”.`;
      $("derive-result").hidden = true;
      document.dispatchEvent(new CustomEvent("rs:sets-changed"));
    } catch (err) {
      fail("Could not record the judgments", err);
    }
  });
})();
