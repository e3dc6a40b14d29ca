/* Side-by-side evidence: per criterion, a toggle that asks POST /v1/sets/{set}/evidence for the shown reference
   (and the candidate) and overlays the map on the images. The map is drawn without relying on hue: cells that
   weighed little are veiled (opacity), the cells that weighed most get an outline, solid where they support
   "yes" and dashed where they support "no". Computed on demand, never as part of the search. */
"use strict";

window.RS.evidence = (() => {
  const { api, el } = window.RS;
  const SVG = "http://www.w3.org/2000/svg";
  const cache = new Map(); // "set|sha|criterion|candidate" -> the answer (a promise while in flight)
  let shown = null; // the criterion whose map is on the images

  function svg(tag, attrs) {
    const node = document.createElementNS(SVG, tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, String(v));
    return node;
  }

  function clear(boxes) {
    boxes.forEach((box) => box.querySelectorAll(".evidence-overlay").forEach((n) => n.remove()));
  }

  /* One image's map as an SVG over the image (the box's .zoom-inner: the image is contained in it, so is this). */
  function overlay(box, map) {
    const inner = box.querySelector(".zoom-inner");
    if (!inner) return;
    const peak = Math.max(1e-12, ...map.values.flat().map(Math.abs));
    const layer = svg("svg", { class: "evidence-overlay", viewBox: `0 0 ${map.width} ${map.height}`,
      preserveAspectRatio: "xMidYMid meet", "aria-hidden": "true" });
    const stroke = Math.max(map.width, map.height) / 160;
    map.values.forEach((row, r) => row.forEach((value, c) => {
      const [left, top, right, bottom] = map.boxes[r][c];
      const weight = Math.abs(value) / peak;
      const cell = { x: left, y: top, width: right - left, height: bottom - top };
      layer.append(svg("rect", { ...cell, fill: "#000", "fill-opacity": (0.65 * (1 - weight)).toFixed(3) }));
      if (weight >= 0.5) {
        const dash = value < 0 ? `${stroke * 3} ${stroke * 2}` : "none";
        layer.append(svg("rect", { ...cell, fill: "none", stroke: "#000", "stroke-width": stroke * 2.5 }));
        layer.append(svg("rect", { ...cell, fill: "none", stroke: "#fff", "stroke-width": stroke,
          "stroke-dasharray": dash }));
      }
    }));
    inner.append(layer);
  }

  /* The toggles for one hit, in ``panel``; ``boxes`` are the candidate's and the reference's zoom boxes. */
  function show({ setId, hit, criteria, candidate, apiKey, panel, candBox, refBox }) {
    const boxes = [candBox, refBox];
    clear(boxes);
    const status = el("p", { class: "help evidence-status", role: "status", "aria-live": "polite" });
    const buttons = criteria.map((criterion) => el("button", {
      type: "button", class: "button secondary evidence-toggle", "aria-pressed": "false", text: criterion,
      onclick: (event) => toggle(event.currentTarget, criterion),
    }));
    panel.replaceChildren(
      el("h4", { text: "Where was each criterion judged?" }),
      el("p", { class: "help", text: "Show a criterion's evidence on the images: clear cells weighed most; an outline "
        + "marks the strongest, solid where they support the criterion and dashed where they speak against it." }),
      el("div", { class: "evidence-toggles" }, ...buttons), status);
    shown = null;

    async function toggle(button, criterion) {
      const on = button.getAttribute("aria-pressed") !== "true";
      buttons.forEach((b) => b.setAttribute("aria-pressed", "false"));
      clear(boxes);
      shown = on ? criterion : null;
      if (!on) { status.textContent = ""; return; }
      button.setAttribute("aria-pressed", "true");
      const key = [setId, hit.image.sha256, criterion, JSON.stringify(candidate || null)].join("|");
      if (!cache.has(key)) {
        const body = { image_id: hit.image.sha256, criterion };
        if (candidate) Object.assign(body, { candidate, candidate_map: true });
        cache.set(key, api("POST", `/v1/sets/${encodeURIComponent(setId)}/evidence`, { json: body, apiKey }));
      }
      status.textContent = "Computing the evidence…";
      panel.setAttribute("aria-busy", "true");
      try {
        const answer = await cache.get(key);
        if (shown !== criterion) return; // another toggle (or none) was chosen meanwhile
        if (!answer.available) {
          status.textContent = `Evidence is unavailable: ${answer.reason}`;
          return;
        }
        answer.images.forEach((map) => overlay(map.role === "document" ? refBox : candBox, map));
        const of = answer.of === "positive statement" ? ` (shown for "${answer.statement}", the positive statement)` : "";
        status.textContent = `Evidence for "${criterion}"${of}: ${answer.method.replaceAll("_", " ")}, `
          + `${answer.images[0].rows} × ${answer.images[0].cols} cells, ${answer.vision_encodes} vision encodes.`;
      } catch (err) {
        cache.delete(key);
        if (shown === criterion) status.textContent = `Error: ${err.message}`;
      } finally {
        panel.removeAttribute("aria-busy");
      }
    }
  }

  return { show };
})();
