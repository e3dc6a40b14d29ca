/* The side-by-side viewer's zoom: the candidate and the reference grow together and pan together, so both keep
   showing the same relative spot of their image. */
"use strict";

window.RS.zoom = (() => {
  const $ = (id) => document.getElementById(id);
  const BOXES = ["sbs-cand-box", "sbs-ref-box"];
  let syncing = false; // true while code (not the user) scrolls the boxes

  function zoomable(img) {
    return window.RS.el("div", { class: "zoom-inner" }, img);
  }

  // Each box keeps looking at the same relative spot (the centre at first) as the images grow.
  function apply() {
    const z = parseFloat($("sbs-zoom").value) || 1;
    $("sbs-zoom-value").textContent = `${Math.round(z * 100)}%`;
    syncing = true;
    BOXES.forEach((id) => {
      const box = $(id);
      const inner = box.querySelector(".zoom-inner");
      if (!inner) return;
      const fx = box.scrollWidth > box.clientWidth ? (box.scrollLeft + box.clientWidth / 2) / box.scrollWidth : 0.5;
      const fy = box.scrollHeight > box.clientHeight ? (box.scrollTop + box.clientHeight / 2) / box.scrollHeight : 0.5;
      inner.style.width = `${z * 100}%`;
      box.scrollLeft = fx * box.scrollWidth - box.clientWidth / 2;
      box.scrollTop = fy * box.scrollHeight - box.clientHeight / 2;
    });
    requestAnimationFrame(() => { syncing = false; });
  }

  // Scrolling one zoomed image scrolls the other to the same relative spot.
  function follow(from, to) {
    from.addEventListener("scroll", () => {
      if (syncing) return;
      syncing = true;
      const fx = from.scrollWidth - from.clientWidth;
      const fy = from.scrollHeight - from.clientHeight;
      to.scrollLeft = fx > 0 ? (from.scrollLeft / fx) * (to.scrollWidth - to.clientWidth) : 0;
      to.scrollTop = fy > 0 ? (from.scrollTop / fy) * (to.scrollHeight - to.clientHeight) : 0;
      requestAnimationFrame(() => { syncing = false; });
    });
  }

  /* Wires the zoom slider and the two boxes' scrolling (once, when the page's script starts). */
  function link() {
    $("sbs-zoom").addEventListener("input", apply);
    const [cand, ref] = BOXES.map($);
    follow(cand, ref);
    follow(ref, cand);
  }

  return { zoomable, apply, link };
})();
