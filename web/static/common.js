/* Shared helpers: API calls with the error envelope and CSRF header, a tiny DOM builder, drop zones.
   Text from the server is only ever set with textContent, never parsed as HTML. */
"use strict";

window.RS = (() => {
  function csrfToken() {
    const meta = document.querySelector('meta[name="csrf-token"]');
    return meta ? meta.getAttribute("content") : null;
  }

  class ApiError extends Error {
    constructor(status, type, message, details) {
      super(message);
      this.status = status;
      this.type = type;
      this.details = details || {};
    }
  }

  /* fetch() with the session cookie, X-CSRF-Token on mutations and {"error": {...}} turned into ApiError. */
  async function api(method, url, { json, form, apiKey } = {}) {
    const headers = { Accept: "application/json" };
    let body;
    if (json !== undefined) {
      headers["Content-Type"] = "application/json";
      body = JSON.stringify(json);
    } else if (form !== undefined) {
      body = form;
    }
    const token = csrfToken();
    if (token && method !== "GET") headers["X-CSRF-Token"] = token;
    if (apiKey) headers.Authorization = `Bearer ${apiKey}`;
    let response;
    try {
      response = await fetch(url, { method, headers, body, credentials: "same-origin" });
    } catch (err) {
      throw new ApiError(0, "network_error", "The server could not be reached. Is it running?");
    }
    if (response.status === 204) return null;
    const text = await response.text();
    let data = null;
    try { data = text ? JSON.parse(text) : null; } catch (err) { data = null; }
    if (!response.ok) {
      const e = data && data.error ? data.error : {};
      throw new ApiError(response.status, e.type || "http_error", e.message || `HTTP ${response.status}`, e.details);
    }
    return data;
  }

  /* el("p", {class: "x", text: "hi"}, child, ...) — attributes, properties (text/html never), children. */
  function el(tag, attrs = {}, ...children) {
    const node = document.createElement(tag);
    for (const [key, value] of Object.entries(attrs)) {
      if (value === undefined || value === null || value === false) continue;
      if (key === "text") node.textContent = String(value);
      else if (key === "class") node.className = value;
      else if (key.startsWith("on") && typeof value === "function") node.addEventListener(key.slice(2), value);
      else if (key === "dataset") Object.assign(node.dataset, value);
      else node.setAttribute(key, value === true ? "" : String(value));
    }
    for (const child of children.flat()) {
      if (child === null || child === undefined || child === false) continue;
      node.append(child instanceof Node ? child : document.createTextNode(String(child)));
    }
    return node;
  }

  function fmtScore(value) {
    return typeof value === "number" && Number.isFinite(value) ? value.toFixed(2) : "–";
  }

  function fmtBytes(n) {
    if (typeof n !== "number") return "–";
    if (n < 1024) return `${n} B`;
    if (n < 1024 * 1024) return `${(n / 1024).toFixed(1)} KiB`;
    return `${(n / 1024 / 1024).toFixed(1)} MiB`;
  }

  /* Drag and drop onto `zone` fills `input` (the keyboard- and screen-reader path) and calls onFiles. */
  function dropzone(zone, input, onFiles) {
    const stop = (ev) => { ev.preventDefault(); ev.stopPropagation(); };
    ["dragenter", "dragover"].forEach((t) => zone.addEventListener(t, (ev) => { stop(ev); zone.classList.add("dragover"); }));
    ["dragleave", "dragend"].forEach((t) => zone.addEventListener(t, (ev) => { stop(ev); zone.classList.remove("dragover"); }));
    zone.addEventListener("drop", (ev) => {
      stop(ev);
      zone.classList.remove("dragover");
      const files = ev.dataTransfer && ev.dataTransfer.files;
      if (!files || !files.length) return;
      try { input.files = files; } catch (err) { /* older browsers: keep our own copy */ }
      onFiles(Array.from(files));
    });
    input.addEventListener("change", () => onFiles(Array.from(input.files || [])));
  }

  function readAsDataUrl(file) {
    return new Promise((resolve, reject) => {
      const reader = new FileReader();
      reader.onload = () => resolve(reader.result);
      reader.onerror = () => reject(new Error("the file could not be read"));
      reader.readAsDataURL(file);
    });
  }

  /* ---- result rendering helpers shared by the pages ------------------------------------------- */
  function heat(score, lo = 0, hi = 1) {
    // ColorBrewer "Blues" endpoints: sequential, colour-blind safe; numbers are printed in every cell too.
    const span = hi - lo > 1e-9 ? hi - lo : 1;
    const s = Math.max(0, Math.min(1, ((Number(score) || 0) - lo) / span));
    const light = [239, 246, 255];
    const dark = [8, 48, 107];
    const c = light.map((v, i) => Math.round(v + (dark[i] - v) * s));
    return { bg: `rgb(${c.join(",")})`, fg: s > 0.5 ? "#ffffff" : "#10233f" };
  }

  /* A reference's title: its metadata label, else its original name, else its hash. */
  function imageName(image) {
    const label = image.metadata && typeof image.metadata.label === "string" ? image.metadata.label : "";
    return label || image.original_name || `${image.sha256.slice(0, 12)}…`;
  }

  /* A reference's metadata fields other than its label, as "key: value" text. */
  function metadataText(image) {
    return Object.entries(image.metadata || {}).filter(([k]) => k !== "label")
      .map(([k, v]) => `${k}: ${Array.isArray(v) ? v.join(", ") : String(v)}`).join("; ");
  }

  function metaList(pairs) {
    return el("dl", { class: "meta" }, pairs.flatMap(([k, v]) => [el("dt", { text: k }), el("dd", { text: v })]));
  }

  function scoreRow(label, value) {
    const pct = Math.max(0, Math.min(1, Number(value) || 0)) * 100;
    return el("tr", {},
      el("th", { scope: "row", text: label }),
      el("td", { class: "bar" }, el("div", { class: "bar-track", "aria-hidden": "true" }, (() => {
        const fill = el("div", { class: "bar-fill" });
        fill.style.width = `${typeof value === "number" ? pct : 0}%`;
        return fill;
      })())),
      el("td", { class: "num", text: fmtScore(value) }));
  }

  return { api, ApiError, csrfToken, el, fmtScore, fmtBytes, dropzone, readAsDataUrl, heat, imageName, metadataText, metaList,
    scoreRow };
})();
