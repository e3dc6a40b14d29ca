/* Admin page: sets, uploads, URL imports and live job progress (EventSource on /v1/jobs/{id}/events). */
"use strict";

(() => {
  const { api, el, fmtBytes, dropzone } = window.RS;
  const $ = (id) => document.getElementById(id);
  if (!$("create-set-form")) return;

  const FINISHED = new Set(["succeeded", "completed_with_errors", "failed", "cancelled"]);
  const status = $("admin-status");
  const say = (text) => { status.textContent = text; };
  /* A refused request as an error notice, with each row the error lists (a manifest's bad rows: line and why). */
  const MAX_ROWS = 50;
  function fail(prefix, err) {
    const rows = Array.isArray(err.details && err.details.errors) ? err.details.errors : [];
    const where = (e) => ["line", "file", "name", "url"].filter((k) => e[k] != null).map((k) => `${k} ${e[k]}`).join(", ");
    $("admin-error-text").textContent = `${prefix}: ${err.message}`;
    $("admin-error-rows").replaceChildren(...rows.slice(0, MAX_ROWS).map((e) => el("li", {}, where(e) ? el("strong", { text: `${where(e)}: ` }) : null, String(e.error ?? ""))),
      ...(rows.length > MAX_ROWS ? [el("li", { text: `… and ${rows.length - MAX_ROWS} more` })] : []));
    $("admin-error").hidden = false;
    say(`${prefix}.`);
  }
  const clearError = () => { $("admin-error").hidden = true; };
  const jobs = new Map(); // id -> {job, node, source}
  let sets = [];
  let browsing = null; // {set, after}

  /* ---- sets ------------------------------------------------------------------------------------ */
  async function loadSets() {
    try {
      const data = await api("GET", "/v1/sets");
      sets = data.data || [];
    } catch (err) {
      say(`Could not load the sets: ${err.message}`);
      return;
    }
    const body = $("sets-table").querySelector("tbody");
    body.replaceChildren(...sets.map((s) => {
      const c = s.counts || {};
      return el("tr", { dataset: { setId: s.id } },
        el("td", { "data-label": "Name" }, el("span", { class: "set-name", text: s.name }), el("span", { class: "set-id", text: s.id })),
        el("td", { "data-label": "Indexed", text: c.indexed ?? 0 }),
        el("td", { "data-label": "Pending", text: c.pending ?? 0 }),
        el("td", { "data-label": "Failed", text: c.failed ?? 0 }),
        el("td", { "data-label": "Dims", text: s.dimensions ?? "–" }),
        window.RS.judgmentsCell(s),
        el("td", { "data-label": "Actions" }, el("div", { class: "actions" },
          el("a", { class: "button small secondary", href: `/?set=${encodeURIComponent(s.id)}`, "aria-label": `Compare against ${s.name}` }, "Compare"),
          el("button", { type: "button", class: "button small secondary", "aria-label": `Browse images of ${s.name}`, onclick: () => browse(s) }, "Browse"),
          el("button", { type: "button", class: "button small danger", "aria-label": `Delete set ${s.name}`, onclick: () => deleteSet(s) }, "Delete"))));
    }));
    $("sets-empty").hidden = sets.length > 0;
    window.RS.qualityPanels(sets);
    ["upload-set", "derive-set"].forEach((id) => {
      const select = $(id);
      const keep = select.value;
      select.replaceChildren(...sets.map((s) => el("option", { value: s.id, text: s.name })));
      if (sets.some((s) => s.id === keep)) select.value = keep;
    });
  }

  $("create-set-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const f = ev.currentTarget;
    const name = f.elements.name.value.trim();
    if (!name) { say("A set needs a name."); f.elements.name.focus(); return; }
    const body = { name };
    if (f.elements.description.value.trim()) body.description = f.elements.description.value.trim();
    if (f.elements.dimensions.value) body.dimensions = parseInt(f.elements.dimensions.value, 10);
    try {
      const created = await api("POST", "/v1/sets", { json: body });
      say(`Created set “${created.name}”.`);
      f.reset();
      await loadSets();
      $("upload-set").value = created.id;
    } catch (err) {
      say(`Could not create the set: ${err.message}`);
    }
  });

  async function deleteSet(s) {
    if (!window.confirm(`Delete the set “${s.name}” with its images, index and cached features?`)) return;
    try {
      await api("DELETE", `/v1/sets/${encodeURIComponent(s.id)}`);
      say(`Deleted set “${s.name}”.`);
      if (browsing && browsing.set.id === s.id) { $("browse").hidden = true; browsing = null; }
      await loadSets();
    } catch (err) {
      say(`Could not delete the set: ${err.message}`);
    }
  }

  /* ---- browsing a set's images ----------------------------------------------------------------- */
  async function browse(s, more = false) {
    if (!more) browsing = { set: s, after: null };
    const params = new URLSearchParams({ limit: "48" });
    if (browsing.after) params.set("after", browsing.after);
    try {
      const page = await api("GET", `/v1/sets/${encodeURIComponent(s.id)}/images?${params}`);
      const grid = $("browse-grid");
      if (!more) grid.replaceChildren();
      (page.data || []).forEach((img) => {
        const name = window.RS.imageName(img);
        const caption = img.status === "failed" ? `${name} — failed: ${img.error || "unknown error"}` : `${name} (${img.status})`;
        grid.append(el("li", {}, el("figure", {},
          img.status === "indexed" ? el("img", { src: img.thumbnail_url, alt: name, loading: "lazy" }) : null,
          el("figcaption", { text: `${caption}, ${fmtBytes(img.byte_size)}` })), metadataEditor(s, img, name)));
      });
      browsing.after = page.next_after;
      $("browse-more").hidden = !page.next_after;
      $("browse").hidden = false;
      $("browse-heading").textContent = `Images in “${s.name}” (${page.total})`;
      if (!more) $("browse-heading").focus();
    } catch (err) {
      say(`Could not list the images: ${err.message}`);
    }
  }
  /* The image's metadata as editable JSON; Save replaces it (PATCH, 422s shown as they come). */
  function metadataEditor(s, img, name) {
    const area = el("textarea", { rows: "4", spellcheck: "false", "aria-label": `Metadata of ${name} (JSON)` });
    area.value = JSON.stringify(img.metadata || {}, null, 1);
    const status = el("p", { class: "help", "aria-live": "polite" });
    const save = el("button", { type: "button", class: "button small secondary", onclick: async () => {
      let metadata;
      try { metadata = JSON.parse(area.value || "{}"); } catch (err) { status.textContent = `Not JSON: ${err.message}`; return; }
      try {
        const out = await api("PATCH", `/v1/sets/${encodeURIComponent(s.id)}/images/${img.sha256}`,
          { json: { metadata, replace: true } });
        area.value = JSON.stringify(out.metadata, null, 1);
        status.textContent = "Saved.";
      } catch (err) {
        status.textContent = `Not saved: ${err.message}`;
      }
    } }, "Save metadata");
    return el("details", { class: "metadata" }, el("summary", { text: "Metadata" }), area, save, status);
  }
  $("browse-more").addEventListener("click", () => { if (browsing) browse(browsing.set, true); });

  /* ---- uploads and imports --------------------------------------------------------------------- */
  const fileInput = $("upload-files");
  let chosen = [];
  dropzone($("upload-drop"), fileInput, (files) => {
    chosen = files;
    const total = files.reduce((n, f) => n + f.size, 0);
    $("upload-chosen").textContent = files.length
      ? `${files.length} file${files.length === 1 ? "" : "s"} chosen (${fmtBytes(total)}): ${files.slice(0, 3).map((f) => f.name).join(", ")}${files.length > 3 ? ", …" : ""}`
      : "No files chosen.";
  });

  $("upload-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const setId = $("upload-set").value;
    if (!setId) { say("Create a set first."); return; }
    if (!chosen.length) { say("Choose images or a .zip archive first."); fileInput.focus(); return; }
    const form = new FormData();
    chosen.forEach((f) => form.append("files", f, f.name));
    say(`Uploading ${chosen.length} file${chosen.length === 1 ? "" : "s"}…`);
    try {
      const job = await api("POST", `/v1/sets/${encodeURIComponent(setId)}/images`, { form });
      clearError();
      say("Upload accepted; ingestion is running.");
      chosen = [];
      fileInput.value = "";
      $("upload-chosen").textContent = "No files chosen.";
      track(job, true);
    } catch (err) {
      fail("Upload failed", err);
    }
  });

  $("import-form").addEventListener("submit", async (ev) => {
    ev.preventDefault();
    const setId = $("upload-set").value;
    const urls = $("import-urls").value.split("\n").map((s) => s.trim()).filter(Boolean);
    if (!setId) { say("Create a set first."); return; }
    if (!urls.length) { say("Enter at least one URL."); $("import-urls").focus(); return; }
    try {
      const job = await api("POST", `/v1/sets/${encodeURIComponent(setId)}/imports`, { json: { urls } });
      clearError();
      say(`Importing ${urls.length} URL${urls.length === 1 ? "" : "s"}.`);
      $("import-urls").value = "";
      track(job, true);
    } catch (err) {
      fail("Import failed", err);
    }
  });

  /* ---- jobs ------------------------------------------------------------------------------------ */
  function setName(id) {
    const s = sets.find((x) => x.id === id);
    return s ? s.name : id;
  }

  function jobNode(job) {
    const node = el("li", { class: "job", dataset: { jobId: job.id } });
    node.append(
      el("div", { class: "job-head" },
        el("span", { class: "job-title", text: `${job.kind} → ${setName(job.set_id)}` },
          el("span", { class: "job-source muted", text: ` · ${job.source || ""}` })),
        el("span", { class: "state" })),
      el("progress", { max: "1", value: "0", "aria-label": `Progress of the ${job.kind} job for ${setName(job.set_id)}` }),
      el("div", { class: "job-head" },
        el("span", { class: "job-counts" }),
        el("button", { type: "button", class: "button small secondary job-cancel", onclick: () => cancel(job.id) }, "Cancel")),
      el("p", { class: "job-times muted" }),
      el("p", { class: "job-note", hidden: true }),
      el("details", { class: "job-errors", hidden: true }, el("summary"), el("ul")),
      el("details", { class: "job-ignored", hidden: true }, el("summary"), el("ul")));
    return node;
  }

  function update(job) {
    const entry = jobs.get(job.id);
    if (!entry) return;
    entry.job = job;
    const n = entry.node;
    const pct = Math.round((job.progress || 0) * 100);
    const stateEl = n.querySelector(".state");
    stateEl.textContent = job.state.replace(/_/g, " ");
    stateEl.className = `state state-${job.state}`;
    const bar = n.querySelector("progress");
    bar.value = job.progress || 0;
    bar.setAttribute("aria-valuetext", `${pct}%`);
    bar.dataset.percent = String(pct);
    bar.dataset.state = job.state;  // a finished job with failures is coloured as such, not as a success
    // Screen readers hear quarter steps, not every item.
    const step = Math.floor(pct / 25) * 25;
    if (!FINISHED.has(job.state) && step > (entry.announced ?? -1)) {
      entry.announced = step;
      $("job-announcer").textContent = `${job.kind} → ${setName(job.set_id)}: ${step}%`;
    }
    const processed = (job.done || 0) + (job.failed || 0) + (job.skipped || 0);
    n.querySelector(".job-counts").textContent =
      `${pct}% · ${processed} / ${job.total} processed · ${job.done} indexed · ${job.skipped} skipped · ${job.failed} failed`;
    n.querySelector(".job-cancel").hidden = FINISHED.has(job.state);
    const when = (t) => (t ? new Date(t).toLocaleString() : "—");
    n.querySelector(".job-times").textContent =
      `created ${when(job.created_at)} · started ${when(job.started_at)} · ended ${when(job.finished_at)}`;
    const ignored = job.ignored_entries || [];
    const note = n.querySelector(".job-note");
    const notes = [];
    if (job.manifest) notes.push(`${job.manifest.name} applied: metadata for ${job.manifest.images} image${job.manifest.images === 1 ? "" : "s"}`);
    if (job.skipped) notes.push(`${job.skipped} skipped: already in the set (duplicate)`);
    if (FINISHED.has(job.state) && job.total === 0) {
      notes.unshift(job.ignored ? `No images found: ${job.ignored} entr${job.ignored === 1 ? "y" : "ies"} ignored (see below).`
        : "No images found in the source.");
    }
    note.hidden = notes.length === 0;
    note.textContent = notes.join(" · ");
    const ign = n.querySelector(".job-ignored");
    ign.hidden = ignored.length === 0;
    if (ignored.length) {
      ign.querySelector("summary").textContent = `${job.ignored} ignored entr${job.ignored === 1 ? "y" : "ies"}`
        + (job.ignored > ignored.length ? ` (first ${ignored.length})` : "");
      ign.querySelector("ul").replaceChildren(...ignored.map((e) => el("li", {}, el("code", { text: e.ref }), `: ${e.reason}`)));
    }
    const errors = job.errors || [];
    const box = n.querySelector(".job-errors");
    box.hidden = errors.length === 0;
    if (errors.length) {
      box.querySelector("summary").textContent = `${errors.length} item error${errors.length === 1 ? "" : "s"}`
        + (job.failed > errors.length ? ` (first ${errors.length} of ${job.failed})` : "");
      box.querySelector("ul").replaceChildren(...errors.map((e) => el("li", {}, el("code", { text: e.ref }), `: ${e.error}`)));
    }
  }

  function track(job, prepend = false) {
    if (jobs.has(job.id)) { update(job); return; }
    const node = jobNode(job);
    const list = $("jobs");
    if (prepend) list.prepend(node); else list.append(node);
    $("jobs-empty").hidden = true;
    jobs.set(job.id, { job, node, source: null });
    update(job);
    if (!FINISHED.has(job.state)) watch(job.id);
  }

  function finished(job) {
    const entry = jobs.get(job.id);
    if (entry && entry.source) { entry.source.close(); entry.source = null; }
    update(job);
    say(`Job ${job.kind} → ${setName(job.set_id)} ${job.state.replace(/_/g, " ")}: ${job.done} indexed, ${job.skipped} skipped, ${job.failed} failed.`);
    loadSets();
  }

  function watch(id) {
    const entry = jobs.get(id);
    const source = new EventSource(`/v1/jobs/${encodeURIComponent(id)}/events`);
    entry.source = source;
    source.addEventListener("progress", (ev) => update(JSON.parse(ev.data)));
    source.addEventListener("done", (ev) => finished(JSON.parse(ev.data)));
    source.onerror = () => {
      // The stream ended or broke: stop the browser's automatic reconnects and poll instead.
      source.close();
      entry.source = null;
      poll(id);
    };
  }

  async function poll(id) {
    try {
      const job = await api("GET", `/v1/jobs/${encodeURIComponent(id)}`);
      if (FINISHED.has(job.state)) { finished(job); return; }
      update(job);
    } catch (err) { /* transient; try again */ }
    setTimeout(() => poll(id), 1000);
  }

  async function cancel(id) {
    try {
      update(await api("POST", `/v1/jobs/${encodeURIComponent(id)}/cancel`));
      say("Cancellation requested.");
    } catch (err) {
      say(`Could not cancel: ${err.message}`);
    }
  }

  async function loadJobs() {
    try {
      const data = await api("GET", "/v1/jobs?limit=20");
      (data.data || []).forEach((job) => track(job));
      $("jobs-empty").hidden = jobs.size > 0;
    } catch (err) {
      say(`Could not load the jobs: ${err.message}`);
    }
  }

  document.addEventListener("rs:sets-changed", loadSets); // judgments recorded: their counts changed
  loadSets().then(loadJobs).then(() => { $("create-set-form").dataset.ready = "true"; });
})();
