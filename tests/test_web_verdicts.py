"""Calibrated verdicts in the web UI, in Debian Chromium against a live uvicorn server with the tiny random-weight
checkpoints. Judgments are recorded through the API, and the server fits the set's calibration on them by itself;
the Admin page's Quality disclosure shows that fit's per-criterion report and its Refit button fits the next
version now and shows its held-out log-loss and calibration error, each checked against what the API then
reports. The Compare page shows each result's verdict as a word (never colour alone), the calibrated chance beside
the raw score and each cell's verdict, exactly as the search API gives them, or one plain line saying why there
are none.

Random weights rarely separate yes from no, so the real fit is checked for whatever state the API reports. The
"uncertain only" filter needs results in several bands: for it a calibration with a spread of thresholds is saved
through the catalog's own store (the server reads it as it reads any fit), and the page must agree with the
search API's verdicts for it, filter count and side-by-side arrows included."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import replace
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path
from typing import Any

import httpx
import pytest

from rubricsearch.indexer.catalog import Catalog, resolve_set
from rubricsearch.indexer.catalog.calibrations import latest_calibration, save_calibration
from rubricsearch.rerank.calibration import ScoreMap
from tests.api_helpers import ADMIN_KEY, bearer
from tests.test_web_browser import (
    CRITERIA,
    SEEDED,
    SHOTS,
    TIMEOUT_MS,
    _no_horizontal_overflow,
    _seed,
    _sign_in,
    chromium,
    seeded_server,
)

pytestmark = pytest.mark.browser
WORDS = {"match": "Match", "uncertain": "Uncertain", "no_match": "No match"}


def percent(p: float) -> str:
    """A probability as the page words it (JavaScript's Math.round: halves up)."""
    return f"{int(100 * p + 0.5)} %"


def fixed(x: float, digits: int) -> str:
    """``x.toFixed(digits)`` as JavaScript writes it: the exact binary value, a tie rounded up (Python's format
    rounds a tie such as 0.125 to even)."""
    return str(Decimal(x).quantize(Decimal(1).scaleb(-digits), rounding=ROUND_HALF_UP))


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("verdicts-web")


@pytest.fixture(scope="module")
def server(data_dir: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path) -> Iterator[str]:
    with seeded_server(data_dir, tiny_embedding_dir, tiny_reranker_dir, _seed) as base:
        yield base


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture(scope="module")
def api(server: str) -> Iterator[httpx.Client]:
    """An admin client of the server."""
    with httpx.Client(base_url=server, headers=bearer(ADMIN_KEY), timeout=120) as c:
        yield c


def _judge(api: httpx.Client) -> dict[str, Any]:
    """Every seeded reference judged on every criterion (half yes), and the calibration the server then fits on
    its own, once it covers them all."""
    images = sorted(i["id"] for i in api.get(f"/v1/sets/{SEEDED}/images").raise_for_status().json()["data"])
    api.post(f"/v1/sets/{SEEDED}/judgments", json=[
        {"image_id": image, "criterion": crit, "holds": (k + j) % 2 == 0}
        for k, image in enumerate(images) for j, crit in enumerate(CRITERIA)]).raise_for_status()
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        got = api.get(f"/v1/sets/{SEEDED}/calibration")
        if got.status_code == 200 and not got.json()["stale"]["stale"] and not got.json()["stale"]["refit_pending"]:
            return got.json()  # type: ignore[no-any-return]
        time.sleep(0.1)
    raise AssertionError("the server did not fit the set's calibration on its judgments")


def _page(browser: Any, errors: list[str], **context: Any) -> Any:
    page = browser.new_context(**({"viewport": {"width": 1280, "height": 900}} | context)).new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return page


def _search(api: httpx.Client) -> dict[str, Any]:
    """The search the Compare page runs: the criteria, no candidate, the form's defaults."""
    body = {"set_id": SEEDED, "criteria": CRITERIA, "top_k": 50, "top_n": 10, "rerank": True}
    return api.post("/v1/search", json=body).raise_for_status().json()  # type: ignore[no-any-return]


def _compare(page: Any, server: str) -> None:
    page.goto(f"{server}/?set={SEEDED}")
    page.locator("#compare-form[data-ready]").wait_for(state="attached")
    page.get_by_label("Criteria, one per line").fill("\n".join(CRITERIA))
    page.get_by_role("button", name="Run comparison").click()
    page.get_by_text("Done:").wait_for()


def _card_verdicts(page: Any) -> list[str | None]:
    return page.evaluate("""() => [...document.querySelectorAll('#cards .card')].map(
        c => { const v = c.querySelector('.verdict-hit'); return v ? v.textContent.trim() : null; })""")  # type: ignore[no-any-return]


def _expected_cards(found: dict[str, Any]) -> list[str | None]:
    """What each card must say: the glyph and word of the API's verdict."""
    glyph = {"match": "✓", "uncertain": "?", "no_match": "✗"}
    return [f"{glyph[h['verdict']]} {WORDS[h['verdict']]}" if h["verdict"] else None for h in found["hits"]]


def _shown_ranks(page: Any) -> list[int]:
    return page.evaluate("""() => [...document.querySelectorAll('#cards .card')].filter(c => !c.hidden)
        .map(c => parseInt(c.querySelector('.card-rank').textContent.slice(1), 10))""")  # type: ignore[no-any-return]


def _spread_calibration(data_dir: Path, found: dict[str, Any]) -> None:
    """The set's latest fit saved again with the raw score as the probability and thresholds that put the best
    result (by its weakest criterion) in `match`, the worst in `no_match` and the others in `uncertain`."""
    lows = sorted(min(h["criteria"][c] for c in CRITERIA) for h in found["hits"])
    assert lows[1] < lows[-2], lows  # the raw scores vary enough to split
    catalog = Catalog.open(f"sqlite:///{(data_dir / 'catalog.db').resolve()}", migrate=False)
    try:
        with catalog.write() as session:
            set_id = resolve_set(session, SEEDED).id
            fitted = latest_calibration(session, set_id)
            assert fitted is not None
            save_calibration(session, set_id, replace(fitted, status="calibrated", mapping=ScoreMap("platt"),
                                                      match_at=(lows[-2] + lows[-1]) / 2,
                                                      no_match_at=(lows[0] + lows[1]) / 2))
    finally:
        catalog.dispose()


def test_refit_quality_verdicts_and_the_uncertain_filter(browser: Any, server: str, api: httpx.Client,
                                                         data_dir: Path) -> None:
    errors: list[str] = []
    page = _page(browser, errors)

    # before any fit: no verdict anywhere, one plain line saying why, no filter
    assert _search(api)["provenance"]["calibration"] is None
    _compare(page, server)
    assert page.locator("#cards .verdict").count() == 0 and page.locator("#heatmap .verdict").count() == 0
    assert "no calibration yet" in page.get_by_test_id("verdict-note").inner_text()
    assert not page.locator("#verdict-filter").is_visible()

    # the Admin page: the Quality disclosure before the judgments, after them (the server's own fit), and after
    # pressing Refit
    _sign_in(page, server)
    panel = page.locator("details.quality", has_text=f"Quality: {SEEDED}")
    panel.locator("summary").click()
    panel.locator(".quality-status", has_text="Not fitted yet").wait_for()
    automatic = _judge(api)
    panel.locator("summary").click()  # closed
    panel.locator("summary").click()  # and opened again: it loads the report anew
    panel.locator(".quality-status", has_text=f"Version {automatic['version']}, ").wait_for()
    panel.get_by_role("button", name=f"Refit the calibration of {SEEDED}").click()
    panel.locator(".refit-result", has_text="Refitted").wait_for()
    fit = api.get(f"/v1/sets/{SEEDED}/calibration").raise_for_status().json()
    assert fit["version"] == automatic["version"] + 1 and fit["judgments"] == automatic["judgments"]
    quality = api.get(f"/v1/sets/{SEEDED}/quality").raise_for_status().json()
    assert quality["calibration_version"] == fit["version"] and quality["judgments"] == len(CRITERIA) * 8
    said = panel.locator(".refit-result").inner_text()
    held = fit["held_out"]
    if held is None:
        assert fit["status"] == "too_few" and "nothing fitted" in said
    else:
        assert (f"log-loss: before {fixed(held['log_loss_raw'], 3)}, after {fixed(held['log_loss_calibrated'], 3)}"
                in said and f"Calibration error: before {fixed(held['ece_raw'], 3)}, after "
                f"{fixed(held['ece_calibrated'], 3)}" in said)
    panel.locator(f'.quality-status[data-status="{quality["status"]}"]').wait_for()
    rows = panel.locator(".quality-table tbody tr")
    assert rows.count() == len(quality["per_criterion"]) == len(CRITERIA)
    for want in quality["per_criterion"]:
        cells = panel.locator(f'.quality-table tr[data-criterion="{want["criterion"]}"] td').all_inner_texts()
        auc = "–" if want["auc"] is None else fixed(want["auc"], 2)
        assert cells[1:3] == [f"{want['yes']} / {want['no']}", auc], cells
        assert cells[4] == percent(want["share_uncertain"])
        assert ("Too few judgments" in cells[5]) == want["too_few"]
    assert panel.locator(".quality-same-subject").inner_text().startswith("A candidate image alone")
    assert f"{quality['same_subject']['pairs']} pairs of judged references" in panel.locator(
        ".quality-same-subject").inner_text()
    page.screenshot(path=str(SHOTS / "admin-quality.png"), full_page=True)

    # the Compare page shows the state the API reports for the real fit of random weights
    found = _search(api)
    use = found["provenance"]["calibration"]
    assert use["version"] == fit["version"]
    _compare(page, server)
    assert _card_verdicts(page) == _expected_cards(found)
    note = page.get_by_test_id("verdict-note").inner_text()
    if not use["applied"]:
        assert "No verdicts for this search" in note
    elif use["status"] == "no_separation":
        assert "does not tell yes from no" in note and {h["verdict"] for h in found["hits"]} == {"uncertain"}

    # a calibration whose bands split the results: every card and cell as the API says, the filter by them
    _spread_calibration(data_dir, found)
    found = _search(api)
    verdicts = [h["verdict"] for h in found["hits"]]
    uncertain = [h["rank"] for h in found["hits"] if h["verdict"] == "uncertain"]
    assert {"match", "no_match"} <= set(verdicts) and 2 <= len(uncertain) < len(verdicts), verdicts
    _compare(page, server)
    assert _card_verdicts(page) == _expected_cards(found)
    for hit in found["hits"]:
        card = page.locator(f'#cards .card[data-index="{hit["rank"] - 1}"]')
        assert f"Chance all criteria hold: {percent(hit['probability'])}" in card.inner_text()
        for crit, cell in hit["criteria_verdicts"].items():
            shown = page.get_by_label(f"{WORDS[cell['verdict']]}: rank {hit['rank']}, {crit}", exact=True)
            assert shown.count() == 1
    assert f"{len(verdicts)} of {len(verdicts)} shown" == page.locator("#verdict-count").inner_text()
    page.get_by_label("Show uncertain only").focus()
    page.keyboard.press("Space")
    assert page.locator("#verdict-count").inner_text() == f"{len(uncertain)} of {len(verdicts)} shown"
    assert _shown_ranks(page) == uncertain
    assert page.locator("#heatmap thead th[data-index]:visible").count() == len(uncertain)
    page.screenshot(path=str(SHOTS / "compare-verdicts-uncertain.png"), full_page=True)

    # side by side, the arrows move between the results the filter shows
    page.locator(f'#cards .card[data-index="{uncertain[0] - 1}"]').get_by_role("button", name="Side by side").click()
    heading = page.locator("#sbs-heading")
    heading.wait_for(state="visible")
    page.keyboard.press("ArrowLeft")  # nothing shown before it
    assert heading.inner_text().endswith(f"rank {uncertain[0]}")
    for rank in [*uncertain[1:], uncertain[-1]]:  # each shown result in turn, then nothing after the last
        page.keyboard.press("ArrowRight")
        assert heading.inner_text().endswith(f"rank {rank}")
    assert page.locator("#sbs-next").is_disabled()

    page.get_by_label("Show uncertain only").uncheck()
    assert page.locator("#verdict-count").inner_text() == f"{len(verdicts)} of {len(verdicts)} shown"
    assert _shown_ranks(page) == [h["rank"] for h in found["hits"]]
    page.context.close()
    assert not errors, errors


def _contrast(page: Any, selector: str) -> float:
    """WCAG contrast of an element's text colour on its own background."""
    return page.evaluate("""(sel) => {
        const s = getComputedStyle(document.querySelector(sel));
        const lum = (c) => { const [r, g, b] = c.match(/\\d+(\\.\\d+)?/g).slice(0, 3).map(Number).map((v) => {
            v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; });
            return 0.2126 * r + 0.7152 * g + 0.0722 * b; };
        const [a, b] = [lum(s.color), lum(s.backgroundColor)].sort((x, y) => y - x);
        return (a + 0.05) / (b + 0.05); }""", selector)  # type: ignore[no-any-return]


def test_narrow_and_dark(browser: Any, server: str, api: httpx.Client, data_dir: Path) -> None:
    """At 375 px in dark mode: nothing overflows sideways, every band's word is legible on its own background."""
    _judge(api)
    _spread_calibration(data_dir, _search(api))
    errors: list[str] = []
    page = _page(browser, errors, viewport={"width": 375, "height": 812}, is_mobile=True, has_touch=True,
                 color_scheme="dark")
    assert page.evaluate("matchMedia('(prefers-color-scheme: dark)').matches")
    _compare(page, server)
    _no_horizontal_overflow(page)
    for band in ("match", "uncertain", "no_match"):
        assert _contrast(page, f"#cards .verdict-{band}") >= 4.5, band
    page.screenshot(path=str(SHOTS / "compare-verdicts-375-dark.png"), full_page=True)
    _sign_in(page, server)
    panel = page.locator("details.quality", has_text=f"Quality: {SEEDED}")
    panel.locator("summary").click()
    panel.locator(".quality-table").wait_for()
    _no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / "admin-quality-375-dark.png"), full_page=True)
    page.context.close()
    assert not errors, errors


def test_a_refused_refit_is_shown_and_changes_nothing(browser: Any, server: str, api: httpx.Client) -> None:
    before = api.get(f"/v1/sets/{SEEDED}/quality").raise_for_status().json()["calibration_version"]
    errors: list[str] = []
    page = _page(browser, errors)
    _sign_in(page, server)
    panel = page.locator("details.quality", has_text=f"Quality: {SEEDED}")
    panel.locator("summary").click()
    panel.locator(".quality-status[data-status]").wait_for()
    other = page.context.new_page()  # the session ends in another tab
    other.goto(f"{server}/admin")
    other.get_by_role("button", name="Sign out").click()
    panel.get_by_role("button", name=f"Refit the calibration of {SEEDED}").click()
    alert = panel.locator(".quality-error")
    alert.wait_for(state="visible")
    assert alert.inner_text().startswith("Could not refit:") and panel.locator(".refit-result").inner_text() == ""
    assert api.get(f"/v1/sets/{SEEDED}/quality").raise_for_status().json()["calibration_version"] == before
    page.context.close()
    assert not errors, errors
