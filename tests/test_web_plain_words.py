"""The Compare page in plain words, in real Chromium at 375 px against a server whose reranker carries a measured
policy (as the demo reranker does): the overall score's formula and the policy's measurements (nDCG)
are behind "details" disclosures, never in a row header or a note's text."""

from __future__ import annotations

import json
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from rubricsearch.app.demo.faces import candidate_images, demo_images
from rubricsearch.app.main import create_app
from rubricsearch.rerank.rubric import POLICY_FILE
from tests.api_helpers import ADMIN_KEY, api_settings, bearer, serve_in_thread, wait_job
from tests.test_web_browser import CRITERIA, TIMEOUT_MS, _no_horizontal_overflow, chromium

pytestmark = pytest.mark.browser

# reranking lost for a candidate alone (recall order kept), won with criteria
WON = {"recall_ndcg10": 0.58, "reranked_ndcg10": 0.75, "recall_calibration": {"slope": 4.0, "intercept": -1.0}}
POLICY = {"measured_on": "a test", "kinds": {
    "criteria": WON, "candidate+criteria": WON,
    "candidate": {"recall_ndcg10": 0.754, "reranked_ndcg10": 0.703,
                  "recall_calibration": {"slope": 12.0, "intercept": -3.0}}}}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
           ) -> Iterator[str]:
    root = tmp_path_factory.mktemp("plain-words")
    reranker = shutil.copytree(tiny_reranker_dir, root / "reranker")
    (reranker / POLICY_FILE).write_text(json.dumps(POLICY))
    app = create_app(api_settings(root / "data", tiny_embedding_dir, reranker, auth={"search_api_keys": []}))
    with serve_in_thread(app) as base:
        with httpx.Client(base_url=base, headers=bearer(ADMIN_KEY), timeout=60) as c:
            c.post("/v1/sets", json={"name": "plain"}).raise_for_status()
            files = [("files", (name, data, "image/png")) for name, data in demo_images(6, seed=5)]
            job = c.post("/v1/sets/plain/images", files=files).raise_for_status().json()
            assert wait_job(c, job["id"])["done"] == 6
        yield base


@pytest.fixture
def page(server: str) -> Iterator[Any]:
    with chromium() as browser:
        context = browser.new_context(viewport={"width": 375, "height": 812}, is_mobile=True, has_touch=True)
        page = context.new_page()
        page.set_default_timeout(TIMEOUT_MS)
        errors: list[str] = []
        page.on("pageerror", lambda exc: errors.append(str(exc)))
        page.goto(f"{server}/?set=plain")
        page.locator("#compare-form[data-ready]").wait_for(state="attached")
        yield page
        context.close()
        assert not errors, errors


def _run(page: Any, criteria: list[str]) -> None:
    page.get_by_label("Criteria, one per line").fill("\n".join(criteria))
    name, data = candidate_images()[0]
    page.set_input_files("#candidate-file", files=[{"name": name, "mimeType": "image/png", "buffer": data}])
    page.get_by_role("button", name="Run comparison").click()
    page.get_by_text("Done:").wait_for()


def test_the_score_formula_is_behind_a_disclosure(page: Any) -> None:
    _run(page, CRITERIA)
    overall = page.locator("#heatmap tr.overall th")
    assert overall.inner_text() == "Overall"
    assert overall.evaluate("th => th.getBoundingClientRect().height") < 60  # one line, not a 20-line cell
    details = page.get_by_test_id("score-details")
    assert "geometric mean" not in details.inner_text()
    details.locator("summary").click()
    assert "geometric mean" in details.inner_text()
    _run(page, [])  # the recall order kept: its score is the policy's calibration of the vector score
    details = page.get_by_test_id("score-details")
    assert "sigmoid" not in details.inner_text()
    details.locator("summary").click()
    assert "sigmoid(12.000" in details.inner_text()
    _no_horizontal_overflow(page)


def test_a_note_says_in_plain_words_why_the_order_was_kept(page: Any) -> None:
    """A candidate alone: the policy keeps the first stage's order; the note says so without metrics, which
    wait behind its Details."""
    _run(page, [])
    note = page.locator("#degraded")
    note.wait_for(state="visible")
    plain = note.evaluate("n => [...n.childNodes].filter(c => c.nodeType === Node.TEXT_NODE).map(c => c.textContent)"
                          ".join('')")
    assert "first stage's order" in plain and "nDCG" not in plain and "0.703" not in plain
    note.locator("summary", has_text="Details").click()
    assert "nDCG@10 0.703 reranked, 0.754 recall order" in note.locator("details").inner_text()
    _no_horizontal_overflow(page)
