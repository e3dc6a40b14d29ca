/* The Compare page's side-by-side view: the candidate (or the criteria) beside one result, its per-criterion
   scores, zoom, and Previous / Next over the results the page shows. ``RS.sideBySide(page)`` wires it to the page:
   ``page.result()`` the last search response, ``page.image(attrs, url)`` an <img> loaded with the search key,
   ``page.criteria()`` the criteria scored, ``page.shown()`` the indexes of the hits the filter keeps,
   ``page.apiKey()`` the search key typed (evidence.js asks with it). */
"use strict";

(() => {
  const RS = window.RS;
  const { el, fmtBytes, imageName, metaList, scoreRow } = RS;
  const $ = (id) => document.getElementById(id);

  RS.sideBySide = ({ result, image, criteria, shown, apiKey }) => {
    const { zoomable, apply: applyZoom } = RS.zoom;
    let current = -1; // index of the hit shown side by side

    function open(i) {
      current = i;
      const hit = result().hits[i];
      const sbs = $("side-by-side");
      sbs.hidden = false;
      document.querySelectorAll(".card").forEach((c) => c.classList.toggle("selected", c.dataset.index === String(i)));
      const cand = result().candidateSnapshot;
      const candBox = $("sbs-cand-box");
      if (cand) {
        const local = cand.kind !== "ref"; // a file or a demo candidate: shown from the browser's own copy
        const src = local ? cand.url : cand.image.url;
        const name = { file: () => cand.file.name, data: () => cand.name, ref: () => imageName(cand.image) }[cand.kind]();
        candBox.replaceChildren(zoomable(local ? el("img", { src, alt: `Candidate: ${name}` })
          : image({ alt: `Candidate: ${name}` }, src)));
        const meta = cand.kind === "file" ? [["Candidate", name], ["Size", fmtBytes(cand.file.size)]]
          : cand.kind === "data" ? [["Candidate", name], ["True attributes", cand.title]]
          : [["Candidate", name], ["Pixels", `${cand.image.width} × ${cand.image.height}`], ["sha256", cand.image.sha256.slice(0, 16) + "…"]];
        $("sbs-cand-caption").replaceChildren(metaList(meta));
      } else {
        candBox.replaceChildren(el("div", { class: "placeholder" },
          el("p", { text: "No candidate image: the references were scored against these criteria only." }),
          el("ul", {}, criteria().map((c) => el("li", { text: c })))));
        $("sbs-cand-caption").replaceChildren(metaList([["Candidate", "none (criteria only)"]]));
      }
      const img = hit.image;
      $("sbs-ref-box").replaceChildren(zoomable(image({ alt: `Reference rank ${hit.rank}: ${imageName(img)}` }, img.url)));
      $("sbs-ref-caption").replaceChildren(metaList([
        ["Reference", `#${hit.rank} ${imageName(img)}`],
        ["Pixels", `${img.width} × ${img.height}`],
        ["File", fmtBytes(img.byte_size)],
        ["sha256", `${img.sha256.slice(0, 16)}…`],
        ...Object.entries(img.metadata || {}).filter(([k]) => k !== "label")
          .map(([k, v]) => [k, Array.isArray(v) ? v.join(", ") : String(v)]),
      ]));
      renderSbsScores(hit);
      RS.evidence.show({ setId: result().request.set_id, hit, criteria: criteria(), candidate: result().request.image,
        apiKey: apiKey() || undefined, panel: $("sbs-evidence"), candBox, refBox: $("sbs-ref-box") });
      applyZoom();
      $("sbs-prev").disabled = step(-1) === null;
      $("sbs-next").disabled = step(1) === null;
      $("sbs-heading").textContent = `Side by side: ${cand ? "candidate" : "criteria"} vs. rank ${hit.rank}`;
      sbs.scrollIntoView({ block: "start" });
      $("sbs-heading").focus({ preventScroll: true });
    }

    function renderSbsScores(hit) {
      const table = $("sbs-criteria");
      const body = el("tbody");
      body.append(scoreRow("Overall", hit.score));
      criteria().forEach((c) => body.append(scoreRow(c, hit.criteria ? hit.criteria[c] : null)));
      body.append(scoreRow("Embedding similarity (recall stage)", hit.ann_score));
      table.replaceChildren(el("thead", {}, el("tr", {}, el("th", { scope: "col", text: "Criterion" }),
        el("th", { scope: "col" }, el("span", { class: "sr-only", text: "Score bar" })), el("th", { scope: "col", text: "Score" }))), body);
    }

    /* The next shown hit before (-1) or after (+1) the one side by side (null: none), skipping filtered ones. */
    function step(direction) {
      const list = shown();
      const found = direction > 0 ? list.find((i) => i > current) : list.filter((i) => i < current).pop();
      return found === undefined ? null : found;
    }
    $("sbs-prev").addEventListener("click", () => { if (result() && step(-1) !== null) open(step(-1)); });
    $("sbs-next").addEventListener("click", () => { if (result() && step(1) !== null) open(step(1)); });
    function close() {
      $("side-by-side").hidden = true;
      const card = document.querySelector(`.card[data-index="${current}"] button`);
      document.querySelectorAll(".card").forEach((c) => c.classList.remove("selected"));
      if (card) card.focus();
    }
    $("sbs-close").addEventListener("click", close);
    /* From the keyboard: Escape closes the view, ← and → move between results; the zoom slider and the zoomed
       images keep their arrows (they move the slider and pan). */
    $("side-by-side").addEventListener("keydown", (event) => {
      if (event.altKey || event.ctrlKey || event.metaKey || !result()) return;
      const own = event.target.closest("input, select, textarea, .zoom-box");
      let next = null;
      if (event.key === "Escape") {
        event.preventDefault();
        close();
        return;
      }
      if (event.key === "ArrowLeft" && !own) next = step(-1);
      if (event.key === "ArrowRight" && !own) next = step(1);
      if (next === null) return;
      event.preventDefault();
      open(next);
    });

    /* A new search: the view closes without moving the focus (the results heading takes it). */
    function reset() {
      $("side-by-side").hidden = true;
      current = -1;
    }

    return { open, close, reset, current: () => current };
  };
})();
