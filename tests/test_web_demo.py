"""``rubricsearch demo`` in a real browser: the UI is up while the demo models train, and the demo's candidate
faces can be picked on the compare page.

The real command runs in a subprocess (:mod:`tests.demo_server_main`) with the configured models absent (an
empty Hugging Face cache, hub offline), so it trains the demo models in its child process, for 2 steps (a
step line at the first and at the last: the banner's pace) instead of the recipe's hundreds; with that plan the
fallback then serves the offline test models. Debian
Chromium is driven by playwright, as in tests/test_web_browser.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_helpers import ADMIN_KEY
from tests.live_server import free_port
from tests.test_web_browser import SHOTS, _require_browser, chromium

pytestmark = [pytest.mark.browser, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
READY_S = 420  # training (2 steps) + loading + indexing 40 faces, on a busy 2-core box


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Path]]:
    """(base URL, data dir) of a demo server that has just started, before its models are trained."""
    _require_browser()
    root = tmp_path_factory.mktemp("demo")
    port = free_port()
    env = {**os.environ, "RUBRICSEARCH_DATA_DIR": str(root / "data"), "HF_HOME": str(root / "hf"),
           "HF_HUB_OFFLINE": "1", "RUBRICSEARCH_MODELS__DTYPE": "float32",
           "RUBRICSEARCH_AUTH__ADMIN_API_KEYS": ADMIN_KEY,
           "RUBRICSEARCH_AUTH__SESSION_SECRET": "s" * 32}
    for name in ("RUBRICSEARCH_MODELS__EMBEDDING_MODEL", "RUBRICSEARCH_MODELS__RERANKER_MODEL",
                 "RUBRICSEARCH_MODELS__FALLBACK_TO_TEST_MODELS"):
        env.pop(name, None)
    log_path = root / "demo.log"
    with log_path.open("wb") as log:
        proc = subprocess.Popen([sys.executable, "-m", "tests.demo_server_main", "2", "--port", str(port)],
                                cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 120
            while True:
                assert proc.poll() is None, log_path.read_text(errors="replace")[-3000:]
                try:
                    if httpx.get(f"{base}/healthz", timeout=5).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, log_path.read_text(errors="replace")[-3000:]
                time.sleep(0.2)
            yield base, root / "data"
        finally:
            proc.send_signal(2)  # Ctrl-C, as a person stops it
            try:
                proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    # a stopped demo leaves no half-trained model behind
    leftovers = list((root / "data" / "demo-models").glob(".demo-train-*"))
    assert not leftovers, leftovers


@pytest.fixture(scope="module")
def browser(demo: tuple[str, Path]) -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    """A desktop-sized page; a script error it raised fails the test."""
    page = browser.new_page(viewport={"width": 1280, "height": 900})
    page.set_default_timeout(60_000)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    yield page
    page.close()
    assert not errors, errors


def _wait_ready(page: Any, base: str) -> None:
    page.goto(base)
    page.get_by_test_id("warmup-banner").wait_for(state="detached", timeout=READY_S * 1000)
    page.locator("#compare-form[data-ready]").wait_for(state="attached")


def test_ui_is_up_while_the_demo_models_train(page: Any, demo: tuple[str, Path]) -> None:
    """The banner shows the training's progress, Compare is disabled and a search gets 503 + Retry-After;
    when the models are ready the page reloads without the banner and with search enabled."""
    base, _ = demo
    page.goto(base)
    banner = page.get_by_test_id("warmup-banner")
    assert banner.is_visible()
    page.wait_for_function("() => /training/i.test(document.getElementById('warmup-text').textContent)")
    assert page.get_by_role("button", name="Run comparison").is_disabled()
    assert page.get_by_label("Criteria, one per line").is_disabled()
    assert "not available yet" in page.get_by_test_id("warmup-notice").inner_text()

    r = httpx.post(f"{base}/v1/search", json={"set_id": "demo-animals", "criteria": ["ginger fur"]}, timeout=30)
    assert r.status_code == 503 and 1 <= int(r.headers["Retry-After"]) <= 30, r.text
    assert r.json()["error"]["type"] == "backend_unavailable" and "warmup" in r.json()["error"]["details"]
    # what needs no model is served meanwhile: an admin prepares a set
    admin = {"Authorization": f"Bearer {ADMIN_KEY}"}
    created = httpx.post(f"{base}/v1/sets", json={"name": "prepared-early"}, headers=admin, timeout=30)
    assert created.status_code == 201, created.text
    listed = httpx.get(f"{base}/v1/sets", headers=admin, timeout=30)
    assert "prepared-early" in [s["name"] for s in listed.json()["data"]], listed.text
    # the banner follows the training (its step lines), without a reload, in minutes and seconds
    progress = ("() => /\\d+ % — about \\d+ (min( \\d+ s)?|s) left/"
                ".test(document.getElementById('warmup-text').textContent)")
    page.wait_for_function(progress, timeout=240_000)
    page.screenshot(path=str(SHOTS / "demo-warmup.png"), full_page=True)

    page.get_by_test_id("warmup-banner").wait_for(state="detached", timeout=READY_S * 1000)
    page.locator("#compare-form[data-ready]").wait_for(state="attached")
    assert page.get_by_role("button", name="Run comparison").is_enabled()
    assert "demo-animals (40 indexed)" in page.locator("#set-select").inner_text()
    r = httpx.post(f"{base}/v1/search", json={"set_id": "demo-animals", "criteria": ["ginger fur"]}, timeout=60)
    assert r.status_code == 200 and r.json()["hits"], r.text


def test_demo_candidates_are_offered(page: Any, demo: tuple[str, Path]) -> None:
    """The demo's candidate faces (not in the set) are a strip on the compare page, titled with their true
    attributes; picking one makes it the candidate that the search sends, without an upload."""
    base, data = demo
    _wait_ready(page, base)
    picks = page.get_by_test_id("demo-candidates").locator(".candidate-pick")
    on_disk = sorted(p.name for p in (data / "candidates").glob("candidate-*.png"))
    assert picks.count() == len(on_disk) == 3
    titles = picks.evaluate_all("bs => bs.map(b => b.title)")
    assert titles[0] == "a cat; ginger fur; triangular ears; dark forehead stripes; green eyes", titles
    assert titles[1].startswith("a fox; brown fur; round ears")
    page.wait_for_function("() => [...document.querySelectorAll('.candidate-pick img')].every(i => i.naturalWidth > 0)")

    sent: list[dict[str, Any]] = []
    page.on("request", lambda r: sent.append(json.loads(r.post_data or "{}")) if r.url.endswith("/v1/search") else None)
    page.get_by_role("button", name=f"Use the demo candidate: {titles[1]}").click()
    assert picks.nth(1).get_attribute("aria-pressed") == "true"
    page.locator("#candidate-preview").wait_for(state="visible")
    assert "demo candidate" in page.locator("#candidate-status").inner_text()
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#cards .card").first.wait_for(timeout=120_000)
    assert sent and str(sent[-1].get("image", "")).startswith("data:image/png;base64,"), sent
    assert sent[-1]["criteria"] == []
    page.locator("#cards .card").first.get_by_role("button", name="Side by side").click()
    assert titles[1] in page.locator("#sbs-cand-caption").inner_text()
    page.screenshot(path=str(SHOTS / "demo-candidates.png"), full_page=True)
    page.get_by_role("button", name="Remove candidate").click()
    assert picks.nth(1).get_attribute("aria-pressed") == "false"


def test_smaller_promises_of_the_compare_page(page: Any, demo: tuple[str, Path]) -> None:
    """Issue 34's smaller items, checked on the demo: the page states the API's own criteria limit and going
    over it gets that clear message; results left on screen after a failed search are marked stale; with
    reranking off, provenance lists no rerank instructions."""
    base, _ = demo
    _wait_ready(page, base)
    help_text = page.locator("#criteria-help").inner_text()
    limit = int(help_text.split("Up to ")[1].split(" ")[0])
    criteria = page.get_by_label("Criteria, one per line")
    criteria.fill("ginger fur\ntriangular ears")
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#cards .card").first.wait_for(timeout=120_000)
    page.locator("#provenance summary").click()
    provenance = page.locator("#provenance-body").inner_text()
    assert "Per-criterion instructions" in provenance  # reranked: the instructions that judged each criterion

    criteria.fill("\n".join(f"criterion {i}" for i in range(limit + 1)))
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#run-status", has_text="Error").wait_for()
    status = page.locator("#run-status").inner_text()
    assert f"at most {limit} criteria are allowed, got {limit + 1}" in status, status
    assert "previous search" in status
    assert page.locator("#results.stale").count() == 1
    assert page.locator("#results-summary").get_attribute("data-stale") == "true"

    criteria.fill("ginger fur")
    page.locator("details.options summary").click()
    page.get_by_label("Rerank the shortlist (precise scores per criterion)").uncheck()
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#run-status", has_text="Done").wait_for(timeout=120_000)
    assert page.locator("#results.stale").count() == 0
    provenance = page.locator("#provenance-body").inner_text()
    assert "did not run" in provenance
    assert "Rerank instruction" not in provenance and "Per-criterion instructions" not in provenance
