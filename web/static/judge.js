/* Judgments on the Compare page: in each (result, criterion) cell a person marks whether the criterion holds
   (✓ / ✗), recorded through /v1/sets/{set}/judgments as the signed-in admin (session cookie + CSRF token).
   Pressing the pressed button again deletes the cell's judgment (undo). A recorded judgment comes with the
   search hit (``hit.judgments``), so it shows whenever results load; the cell's markup leaves room for a
   verdict beside the judgment. */
"use strict";

(() => {
  const { api, el, csrfToken } = window.RS;
  const WORD = { true: "yes", false: "no" };

  /* Only an admin session can write; its CSRF token is on the page exactly when one is signed in. */
  const canJudge = () => Boolean(csrfToken());

  /* What the cell says now, as glyph and word (never colour alone) and on each button's aria-pressed. */
  function show(group, holds) {
    group.querySelectorAll("button[data-holds]").forEach((b) => {
      b.setAttribute("aria-pressed", String(holds !== undefined && String(holds) === b.dataset.holds));
    });
    const state = group.querySelector(".judgment-state");
    state.textContent = holds === undefined ? "" : `judged ${WORD[holds]}`;
    group.dataset.judged = holds === undefined ? "" : WORD[holds];
  }

  /* The controls of one cell: ``hit.judgments`` is read and kept up to date, so a re-render shows the change.
     ``report(message)`` shows an error (null clears it); ``busy`` requests never overlap in one cell. */
  function cell(setId, hit, criterion, report) {
    const judged = hit.judgments || (hit.judgments = {});
    const where = `rank ${hit.rank}, ${criterion}`;
    const group = el("div", { class: "judge", role: "group", "aria-label": `Judgment: ${where}` });
    const state = el("span", { class: "judgment-state" });
    if (!canJudge()) {
      group.append(state);
      show(group, judged[criterion]);
      return group;
    }
    const base = `/v1/sets/${encodeURIComponent(setId)}/judgments`;
    let busy = false;
    const press = async (holds) => {
      if (busy) return;
      busy = true;
      group.setAttribute("aria-busy", "true");
      try {
        if (judged[criterion] === holds) {
          const params = new URLSearchParams({ image: String(hit.image.id), criterion });
          await api("DELETE", `${base}?${params}`);
          delete judged[criterion];
        } else {
          await api("POST", base, { json: { image_id: hit.image.id, criterion, holds, source: "person" } });
          judged[criterion] = holds;
        }
        report(null);
      } catch (err) {
        report(`Could not record the judgment (${where}): ${err.message}`);
      } finally {
        busy = false;
        group.removeAttribute("aria-busy");
        show(group, judged[criterion]);
      }
    };
    const button = (holds, glyph, label) => el("button", {
      type: "button", class: "judge-button", dataset: { holds: String(holds) }, "aria-pressed": "false",
      "aria-label": `${label}: ${where}`, title: `${label} (press again to undo)`, onclick: () => press(holds),
    }, glyph);
    group.append(button(true, "✓", "Holds"), button(false, "✗", "Does not hold"), state);
    show(group, judged[criterion]);
    return group;
  }

  window.RS.judge = { canJudge, cell };
})();
