"""Judgments in the web UI, in Debian Chromium against a live uvicorn server with the tiny offline checkpoints:
on the Compare page a signed-in admin marks a cell ✓ (mouse), sees it again after a reload, undoes it and marks ✗
with the keyboard alone, and sees an error when the session is gone; a visitor who is not signed in sees the
recorded judgments but no controls; on the Admin page a set's judgments are counted, exported and derived from a
metadata field (preview with editable wording, then apply). Every mark is checked against what the API holds."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.api_helpers import ADMIN_KEY, bearer
from tests.test_web_browser import (
    CRITERIA,
    SEEDED,
    SHOTS,
    TIMEOUT_MS,
    _run_comparison,
    _seed,
    _sign_in,
    chromium,
    seeded_server,
)

pytestmark = pytest.mark.browser
URL = f"/v1/sets/{SEEDED}/judgments"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
           tiny_reranker_dir: Path) -> Iterator[str]:
    with seeded_server(tmp_path_factory.mktemp("judgments-web"), tiny_embedding_dir, tiny_reranker_dir, _seed) as base:
        yield base


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:
    with chromium() as b:
        yield b


@pytest.fixture
def api(server: str) -> Iterator[httpx.Client]:
    """An admin client of the server, with the set's judgments cleared before the test."""
    with httpx.Client(base_url=server, headers=bearer(ADMIN_KEY), timeout=60) as c:
        c.delete(URL, params={"all": "true"}).raise_for_status()
        yield c


def _page(browser: Any, errors: list[str]) -> Any:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    return page


def recorded(api: httpx.Client) -> dict[tuple[int, str], tuple[bool, str]]:
    """(image id, criterion) -> (holds, source), as the API lists them."""
    got = api.get(URL, params={"limit": 1000}).raise_for_status().json()["data"]
    return {(j["image_id"], j["criterion"]): (j["holds"], j["source"]) for j in got}


def _pressed(page: Any, name: str) -> str | None:
    return page.get_by_role("button", name=name, exact=True).get_attribute("aria-pressed")  # type: ignore[no-any-return]


def test_mark_reload_undo_and_keyboard(browser: Any, server: str, api: httpx.Client) -> None:
    errors: list[str] = []
    page = _page(browser, errors)
    _sign_in(page, server)
    page.goto(f"{server}/?set={SEEDED}")
    _run_comparison(page)
    crit = CRITERIA[0]
    holds, not_holds = f"Holds: rank 1, {crit}", f"Does not hold: rank 1, {crit}"
    state = page.get_by_role("group", name=f"Judgment: rank 1, {crit}").locator(".judgment-state")
    assert _pressed(page, holds) == "false" and state.inner_text() == ""
    assert not page.locator("#judge-signin").is_visible()

    page.get_by_role("button", name=holds, exact=True).click()
    page.wait_for_function(f"() => document.querySelector('[aria-label=\"{holds}\"]').ariaPressed === 'true'")
    assert state.inner_text() == "judged yes" and _pressed(page, not_holds) == "false"
    [(image_id, _)] = recorded(api)
    assert recorded(api) == {(image_id, crit): (True, "person")}
    page.screenshot(path=str(SHOTS / "compare-judged.png"), full_page=True)

    # a reload shows the recorded judgment from the search hit, in that reference's cell only
    page.reload()
    _run_comparison(page)
    assert _pressed(page, holds) == "true" and _pressed(page, not_holds) == "false"
    assert state.inner_text() == "judged yes"
    assert page.locator('.judge[data-judged="yes"]').count() == 1

    # the keyboard alone: Enter on the pressed ✓ undoes it, Tab reaches ✗ of the same cell, Space marks it
    page.get_by_role("button", name=holds, exact=True).focus()
    page.keyboard.press("Enter")
    page.wait_for_function(f"() => document.querySelector('[aria-label=\"{holds}\"]').ariaPressed === 'false'")
    assert recorded(api) == {} and state.inner_text() == ""
    page.keyboard.press("Tab")
    assert page.evaluate("() => document.activeElement.getAttribute('aria-label')") == not_holds
    page.keyboard.press("Space")
    page.wait_for_function(f"() => document.querySelector('[aria-label=\"{not_holds}\"]').ariaPressed === 'true'")
    assert recorded(api) == {(image_id, crit): (False, "person")} and state.inner_text() == "judged no"

    # pressing the pressed ✗ again deletes the judgment
    page.get_by_role("button", name=not_holds, exact=True).click()
    page.wait_for_function(f"() => document.querySelector('[aria-label=\"{not_holds}\"]').ariaPressed === 'false'")
    assert recorded(api) == {}

    # signed out in another tab: the next mark is refused, and the page says so
    other = page.context.new_page()
    other.goto(f"{server}/admin")
    other.get_by_role("button", name="Sign out").click()
    page.get_by_role("button", name=holds, exact=True).click()
    alert = page.locator("#judge-error")
    alert.wait_for(state="visible")
    assert "Could not record the judgment" in alert.inner_text() and f"rank 1, {crit}" in alert.inner_text()
    assert _pressed(page, holds) == "false" and recorded(api) == {}
    page.context.close()
    assert not errors, errors


def test_visitor_sees_judgments_but_no_controls(browser: Any, server: str, api: httpx.Client) -> None:
    images = api.get(f"/v1/sets/{SEEDED}/images").raise_for_status().json()["data"]
    api.post(URL, json=[{"image_id": i["id"], "criterion": CRITERIA[1], "holds": False} for i in images]
             ).raise_for_status()
    errors: list[str] = []
    page = _page(browser, errors)
    page.goto(f"{server}/?set={SEEDED}")
    _run_comparison(page)
    assert page.locator(".judge-button").count() == 0
    hint = page.locator("#judge-signin")
    assert hint.is_visible() and "Sign in as admin" in hint.inner_text()
    row = page.locator("#heatmap tbody tr", has_text=CRITERIA[1])
    shown = row.locator(".judgment-state").all_inner_texts()
    assert shown and all(text == "judged no" for text in shown)
    assert page.locator(".judgment-state", has_text="judged").count() == len(shown)
    page.context.close()
    assert not errors, errors


def test_admin_counts_exports_and_derives(browser: Any, server: str, api: httpx.Client) -> None:
    images = api.get(f"/v1/sets/{SEEDED}/images").raise_for_status().json()["data"]
    coats = {i["id"]: ("ginger" if n % 2 else "black") for n, i in enumerate(images)}
    for image_id, coat in coats.items():
        api.patch(f"/v1/sets/{SEEDED}/images/{image_id}", json={"metadata": {"coat": coat}}).raise_for_status()
    errors: list[str] = []
    page = _page(browser, errors)
    _sign_in(page, server)
    row = page.locator("#sets-table tbody tr", has_text=SEEDED)
    row.locator(".judgment-count").filter(has_text="0").wait_for()

    page.locator("#derive-set").select_option(SEEDED)
    page.get_by_label("Metadata field").fill("coat")
    page.get_by_role("button", name="Preview").click()
    black = page.get_by_label("Statement for coat = black")
    black.wait_for()
    assert page.get_by_label("Statement for coat = ginger").input_value() == "The coat is ginger"
    assert recorded(api) == {}  # a preview records nothing
    black.fill("A black coat")
    page.get_by_role("button", name="Apply: record these judgments").click()
    expected = {(i, c): (coat == value, "derived") for i, coat in coats.items()
                for value, c in (("ginger", "The coat is ginger"), ("black", "A black coat"))}
    page.locator("#derive-status", has_text=f"Recorded {len(expected)} judgments from “coat”").wait_for()
    assert recorded(api) == expected
    row.locator(".judgment-count").filter(has_text=str(len(expected))).wait_for()

    href = row.get_by_role("link", name=f"Export the judgments of {SEEDED} (JSONL)").get_attribute("href")
    export = page.request.get(f"{server}{href}")  # the session's cookie, as the link sends it
    assert export.ok and len(export.text().splitlines()) == len(expected)

    page.get_by_label("Metadata field").fill("no-such-field")
    page.get_by_role("button", name="Preview").click()
    page.locator("#derive-error").wait_for(state="visible")
    assert "Could not derive judgments" in page.locator("#derive-error").inner_text()
    assert recorded(api) == expected
    page.context.close()
    assert not errors, errors
