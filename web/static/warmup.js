/* While the models are being prepared (the demo's first run trains them) the banner follows /warmup;
   once the models are ready the page reloads, with search enabled. */
"use strict";

(() => {
  const text = document.getElementById("warmup-text");
  const bar = document.getElementById("warmup-progress");
  const notice = document.querySelector("[data-testid=warmup-notice]");
  if (!text) return;
  const capital = (s) => s.charAt(0).toUpperCase() + s.slice(1);

  async function poll() {
    let status;
    try {
      const response = await fetch("/warmup", { headers: { Accept: "application/json" }, credentials: "same-origin" });
      status = await response.json();
    } catch (err) {
      text.textContent = "The server cannot be reached (was it stopped?); retrying…";
      setTimeout(poll, 3000);
      return;
    }
    if (status.ready) {
      window.location.reload();
      return;
    }
    if (status.failure) {
      text.textContent = `The models could not be prepared: ${status.failure}`;
      return;
    }
    const progress = status.progress;
    if (progress) {
      text.textContent = `${capital(progress.text)}.`;
      if (typeof progress.percent === "number") bar.value = progress.percent; else bar.removeAttribute("value");
      if (notice) notice.textContent = `Comparisons are not available yet: ${progress.text}. This page reloads when the models are ready.`;
    }
    setTimeout(poll, 2000);
  }
  setTimeout(poll, 1000);
})();
