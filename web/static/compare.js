/* Compare page: POST /v1/search, then cards, a criteria × results heatmap, a side-by-side view (side_by_side.js)
   and provenance. */
"use strict";

(() => {
  const RS = window.RS;
  const { api, el, fmtScore, dropzone, readAsDataUrl, imageName } = RS;
  const $ = (id) => document.getElementById(id);
  const form = $("compare-form");
  if (!form) return;
  const runStatus = $("run-status");
  const runButton = $("run-button");

  /* ---- optional search key (when the server requires one) --------------------------------------- */
  const keyInput = $("api-key");
  const apiKey = () => (keyInput ? keyInput.value.trim() : "");

  // <img> cannot send a key, so with one the image is fetched and shown from a blob: URL.
  function image(attrs, url) {
    const node = el("img", attrs);
    if (!apiKey()) {
      node.src = url;
    } else {
      fetch(url, { headers: { Authorization: `Bearer ${apiKey()}` }, credentials: "same-origin" })
        .then((r) => (r.ok ? r.blob() : Promise.reject(new Error(String(r.status)))))
        .then((b) => { node.src = URL.createObjectURL(b); })
        .catch(() => { node.alt = `${node.alt} (could not be loaded)`; });
    }
    return node;
  }

  async function loadSetsWithKey() {
    if (!apiKey()) return;
    try {
      const data = await api("GET", "/v1/sets", { apiKey: apiKey() });
      const select = $("set-select");
      select.replaceChildren(...(data.data || []).map((s) => el("option", { value: s.id, text: `${s.name} (${(s.counts || {}).indexed ?? 0} indexed)` })));
      runStatus.textContent = `${select.options.length} reference set${select.options.length === 1 ? "" : "s"} loaded.`;
      loadMetadataCounts();
    } catch (err) {
      runStatus.textContent = `Could not load the sets: ${err.message}`;
    }
  }
  if (keyInput) keyInput.addEventListener("change", loadSetsWithKey);

  /* Metadata values of the chosen set as buttons; one adds `key = value` to the filter's `must`. Only values that
     several images share, of keys with few values: a chip that picks one image is no filter. */
  const CHIP_VALUES = 12; // most distinct values a key may have to get chips
  async function loadMetadataCounts() {
    const box = $("metadata-counts");
    box.replaceChildren();
    const setId = $("set-select").value;
    if (!setId) return;
    let counts;
    try {
      counts = await api("GET", `/v1/sets/${encodeURIComponent(setId)}/metadata/counts?per_key=${CHIP_VALUES + 1}`, { apiKey: apiKey() || undefined });
    } catch (err) {
      return; // the filter box still works by hand
    }
    Object.entries(counts.fields || {}).forEach(([key, values]) => {
      if (values.length > CHIP_VALUES) return; // a name, a price: nearly every image its own value
      values.filter(({ count }) => count > 1).forEach(({ value, count }) => {
        box.append(el("button", { type: "button", class: "chip", "aria-label": `Filter ${key} = ${value} (${count} images)`,
          onclick: () => addCondition(key, value) }, `${key}: ${value} (${count})`));
      });
    });
    loadFacetCounts(setId, box);
  }

  /* Computed facets (chosen value at the default confidence) as chips too, filtering on `facets.<attribute>`. */
  async function loadFacetCounts(setId, box) {
    let facets;
    try {
      facets = await api("GET", `/v1/sets/${encodeURIComponent(setId)}/facets/counts`, { apiKey: apiKey() || undefined });
    } catch (err) {
      return;
    }
    if ($("set-select").value !== setId) return; // another set was chosen meanwhile
    Object.entries(facets.attributes || {}).forEach(([attr, values]) => Object.entries(values).forEach(([value, count]) => {
      if (!count) return;
      const key = `facets.${attr}`;
      box.append(el("button", { type: "button", class: "chip facet", "aria-label": `Filter facet ${attr} = ${value} (${count} images)`,
        onclick: () => addCondition(key, value) }, `${attr}: ${value} (${count}, computed)`));
    }));
  }

  function addCondition(key, value) {
    let current = {};
    try { current = JSON.parse($("filter").value.trim() || "{}"); } catch (err) { current = {}; }
    const must = Array.isArray(current.must) ? current.must : [];
    must.push({ key, match: { value } });
    $("filter").value = JSON.stringify({ ...current, must });
  }
  $("set-select").addEventListener("change", loadMetadataCounts);
  loadMetadataCounts();

  let candidate = null; // {kind: "file", file, url} | {kind: "ref", image} | {kind: "data", name, title, url}
  let result = null; // last search response

  /* ---- candidate image ------------------------------------------------------------------------- */
  const preview = $("candidate-preview");
  const candStatus = $("candidate-status");
  const clearBtn = $("candidate-clear");

  function showCandidate() {
    document.querySelectorAll(".candidate-pick").forEach((b) => b.setAttribute("aria-pressed",
      String(Boolean(candidate) && candidate.kind === "data" && b.dataset.name === candidate.name)));
    if (!candidate) {
      preview.hidden = true;
      preview.removeAttribute("src");
      preview.alt = "";
      candStatus.textContent = "No candidate: criteria only.";
      clearBtn.hidden = true;
      return;
    }
    if (candidate.kind === "data") {
      preview.src = candidate.url;
      preview.alt = `Candidate image: demo candidate ${candidate.title}`;
      preview.hidden = false;
      candStatus.textContent = `Candidate: demo candidate (${candidate.title})`;
      clearBtn.hidden = false;
      return;
    }
    const name = candidate.kind === "file" ? candidate.file.name : (candidate.image.original_name || candidate.image.sha256.slice(0, 12));
    preview.src = candidate.kind === "file" ? candidate.url : candidate.image.thumbnail_url;
    preview.alt = `Candidate image: ${name}`;
    preview.hidden = false;
    candStatus.textContent = candidate.kind === "file" ? `Candidate: ${name}` : `Candidate: reference ${name}`;
    clearBtn.hidden = false;
  }

  function setFileCandidate(files) {
    const file = files.find((f) => f.type.startsWith("image/")) || files[0];
    if (!file) return;
    if (candidate && candidate.kind === "file") URL.revokeObjectURL(candidate.url);
    candidate = { kind: "file", file, url: URL.createObjectURL(file) };
    RS.zoom.link();
    showCandidate();
  }

  dropzone($("candidate-drop"), $("candidate-file"), setFileCandidate);
  // The demo's candidate faces, inlined as data: URLs, are sent as they are.
  document.querySelectorAll(".candidate-pick").forEach((button) => button.addEventListener("click", () => {
    if (candidate && candidate.kind === "file") URL.revokeObjectURL(candidate.url);
    candidate = { kind: "data", name: button.dataset.name, title: button.title, url: button.dataset.src };
    $("candidate-file").value = "";
    RS.zoom.link();
    showCandidate();
  }));
  clearBtn.addEventListener("click", () => {
    if (candidate && candidate.kind === "file") URL.revokeObjectURL(candidate.url);
    candidate = null;
    $("candidate-file").value = "";
    RS.zoom.link();
    showCandidate();
    $("candidate-file").focus();
  });

  /* ---- running a search ------------------------------------------------------------------------ */

  function numberField(id, fallback) {
    const v = parseInt($(id).value, 10);
    return Number.isFinite(v) && v > 0 ? v : fallback;
  }

  async function buildRequest() {
    const criteria = $("criteria").value.split("\n").map((s) => s.trim()).filter(Boolean);
    const body = {
      set_id: $("set-select").value,
      criteria,
      top_k: numberField("top-k", parseInt(form.dataset.defaultTopK, 10) || 50),
      top_n: numberField("top-n", parseInt(form.dataset.defaultTopN, 10) || 10),
      rerank: $("rerank").checked,
    };
    if (candidate && candidate.kind === "file") body.image = await readAsDataUrl(candidate.file);
    if (candidate && candidate.kind === "ref") body.image = { image_id: candidate.image.sha256 };
    if (candidate && candidate.kind === "data") body.image = candidate.url;
    const filterText = $("filter").value.trim();
    if (filterText) body.filter = JSON.parse(filterText);  // a SyntaxError is reported by the submit handler
    return body;
  }

  form.addEventListener("submit", async (ev) => {
    ev.preventDefault();
    if (!$("set-select").value) {
      runStatus.textContent = "Choose a reference set first.";
      return;
    }
    let body;
    try {
      body = await buildRequest();
    } catch (err) {
      runStatus.textContent = `The metadata filter is not JSON: ${err.message}`;
      $("filter").focus();
      return;
    }
    if (!body.criteria.length && !body.image) {
      runStatus.textContent = "Add at least one criterion or a candidate image.";
      $("criteria").focus();
      return;
    }
    runButton.disabled = true;
    runStatus.textContent = "Running…";
    const started = performance.now();
    try {
      result = await api("POST", "/v1/search", { json: body, apiKey: apiKey() || undefined });
      result.clientMs = performance.now() - started;
      result.request = body;
      result.candidateSnapshot = candidate;
      rememberQuery(body);
      render();
      runStatus.textContent = `Done: ${result.hits.length} result${result.hits.length === 1 ? "" : "s"}.`;
    } catch (err) {
      const shown = !$("results").hidden;
      runStatus.textContent = `Error: ${err.message}` + (shown ? " (the results below are from the previous search)" : "");
      $("results").classList.toggle("stale", shown);
      $("results-summary").dataset.stale = shown ? "true" : "";
    } finally {
      runButton.disabled = false;
    }
  });

  function rememberQuery(body) {
    const params = new URLSearchParams({ set: body.set_id });
    if (body.criteria.length) params.set("criteria", body.criteria.join("\n"));
    history.replaceState(null, "", `?${params.toString()}`);
  }

  /* ---- rendering ------------------------------------------------------------------------------- */
  function threshold() {
    const t = parseFloat($("threshold").value);
    return Number.isFinite(t) ? t : 0.5;
  }

  function render() {
    const { hits, provenance } = result;
    $("results").hidden = false;
    $("results").classList.remove("stale");
    $("results-summary").dataset.stale = "";
    const status = (provenance && provenance.rerank_status) || "unknown";
    // the reranker's measured policy kept the recall order: scores are calibrated match probabilities
    const steppedAside = status.startsWith("stepped aside");
    const probabilities = Boolean(provenance && provenance.reranked) || steppedAside;
    const degraded = $("degraded");
    if (steppedAside && hits.length) {
      degraded.hidden = false;
      degraded.replaceChildren(...RS.explained("For this kind of search the reranker ranked worse than the first "
        + "stage when it was tested, so results keep the first stage's order; each score is the chance of a match "
        + "estimated from that stage's similarity.", `Reranking ${status}.`));
    } else if (!probabilities && hits.length) {
      degraded.hidden = false;
      degraded.replaceChildren(...RS.explained("Reranking did not run, so results are in the first stage's order "
        + "and scores are similarities, not chances of a match.", `Reranking did not run (${status}).`));
    } else {
      degraded.hidden = true;
    }
    const weak = probabilities ? hits.filter((h) => h.score < threshold()).length : 0;
    let summary = `${hits.length} reference${hits.length === 1 ? "" : "s"} ranked`;
    if (probabilities) summary += `; ${hits.length - weak} at or above the match threshold ${threshold().toFixed(2)}`;
    if (probabilities && hits.length && weak === hits.length) summary += ". No good match in this set";
    $("results-summary").textContent = `${summary}.`;
    renderCards(probabilities);
    renderHeatmap();
    renderVerdicts();
    $("provenance-body").replaceChildren(RS.provenanceList(result));
    sideBySide.reset();
    $("results-heading").focus();
  }

  function renderCards(probabilities) {
    const list = $("cards");
    list.replaceChildren();
    if (!result.hits.length) {
      const reason = result.provenance && result.provenance.filter && result.provenance.filter.reason;
      list.append(el("li", { class: "muted", text: reason ? `No references: ${reason}.` : "No references found. Is the set indexed?" }));
      return;
    }
    result.hits.forEach((hit, i) => {
      const isWeak = probabilities && hit.score < threshold();
      const name = imageName(hit.image);
      list.append(el("li", { class: `card${isWeak ? " weak" : ""}`, dataset: { index: String(i) } },
        image({ class: "card-img", alt: `Rank ${hit.rank}: ${name}` }, hit.image.thumbnail_url),
        el("div", { class: "card-body" },
          el("span", { class: "card-rank", text: `#${hit.rank}` }),
          el("span", { class: "card-score", text: fmtScore(hit.score), "aria-label": `Score ${fmtScore(hit.score)}` }),
          el("meter", { min: "0", max: "1", value: String(Math.max(0, Math.min(1, hit.score))), "aria-hidden": "true" }),
          el("span", { class: "card-name", text: name }),
          window.RS.metadataText(hit.image) ? el("span", { class: "card-meta muted", text: window.RS.metadataText(hit.image) }) : null,
          RS.identicalBadge(hit),
          RS.verdict.card(hit),
          isWeak ? el("span", { class: "card-flag", text: "Below threshold" }) : null,
          el("button", { type: "button", class: "button small secondary", "aria-label": `Side by side: rank ${hit.rank}, ${name}`,
            onclick: () => openSideBySide(i) }, "Side by side"),
          el("button", { type: "button", class: "button link small", "aria-label": `Use ${name} as the candidate`,
            onclick: () => useAsCandidate(hit.image) }, "Use as candidate"))));
    });
  }

  function useAsCandidate(image) {
    if (candidate && candidate.kind === "file") URL.revokeObjectURL(candidate.url);
    candidate = { kind: "ref", image };
    $("candidate-file").value = "";
    RS.zoom.link();
    showCandidate();
    runStatus.textContent = `Candidate set to ${imageName(image)}. Run the comparison again to use it.`;
    runButton.focus();
  }

  function renderHeatmap() {
    const setId = result.request.set_id;
    $("heatmap").replaceChildren(...RS.heatmap(result, criteriaOf(), $("heat-stretch").checked, openSideBySide,
      (hit) => image({ class: "col-thumb", alt: "" }, hit.image.thumbnail_url),
      (hit, criterion) => [RS.verdict.cell(hit, criterion), RS.judge.cell(setId, hit, criterion, reportJudgment)]));
    applyFilter();
    $("judge-signin").hidden = RS.judge.canJudge();
    const details = RS.scoreDetails(result);
    $("score-details").replaceChildren(...(details ? [details] : []));
  }

  /* The calibration's line and disclosure under the results; the "uncertain only" filter when verdicts exist. */
  function renderVerdicts() {
    const { line, detail } = RS.verdict.note(result);
    $("verdict-note").textContent = line;
    $("verdict-note").hidden = !line;
    $("verdict-details-text").textContent = detail || "";
    $("verdict-details").hidden = !detail;
    $("verdict-filter").hidden = !result.hits.some((h) => h.verdict);
    applyFilter();
  }

  /* Hits the filter keeps, by index: cards and heatmap columns of the others are hidden. */
  const uncertainOnly = () => !$("verdict-filter").hidden && $("uncertain-only").checked;
  const shown = () => RS.verdict.kept(result.hits, uncertainOnly());
  function applyFilter() {
    const keep = new Set(shown().map(String));
    document.querySelectorAll("#cards .card, #heatmap [data-index]").forEach((node) => {
      node.hidden = !keep.has(node.dataset.index);
    });
    $("verdict-count").textContent = `${keep.size} of ${result.hits.length} shown`;
  }
  $("uncertain-only").addEventListener("change", () => {
    if (!result) return;
    applyFilter();
    const at = sideBySide.current();
    if (at >= 0 && !shown().includes(at)) sideBySide.close();
    else if (at >= 0) sideBySide.open(at); // its Previous / Next follow the filter
  });

  function reportJudgment(message) {
    $("judge-error").hidden = !message;
    $("judge-error").textContent = message || "";
  }

  function criteriaOf() {
    const fromProv = result.provenance && Array.isArray(result.provenance.criteria) ? result.provenance.criteria : [];
    return fromProv.length ? fromProv : result.request.criteria;
  }

  /* ---- side by side (side_by_side.js) ----------------------------------------------------------- */
  const sideBySide = RS.sideBySide({ result: () => result, image, criteria: criteriaOf, shown, apiKey });
  const openSideBySide = sideBySide.open;

  $("threshold").addEventListener("change", () => { if (result) { render(); } });
  $("heat-stretch").addEventListener("change", () => { if (result) renderHeatmap(); });

  RS.zoom.link();
  showCandidate();
  form.dataset.ready = "true"; // the script ran to the end (tests wait for this)
})();
