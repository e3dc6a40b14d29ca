"""Metadata in the web UI, in real Chromium against a real server: edit an image's metadata on the admin page,
then see its label as the card title and its fields on the card, and narrow a comparison with the filter box
(a filter matching nothing says so; one that is not JSON is refused before sending)."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.api_helpers import ADMIN_KEY
from tests.test_web_browser import SEEDED, TIMEOUT_MS, browser, filter_box, page, server  # noqa: F401

pytestmark = pytest.mark.browser


def test_edit_metadata_then_filter(page: Any, server: str) -> None:  # noqa: F811
    row = page.locator("#sets-table tbody tr", has_text=SEEDED)
    row.get_by_role("button", name=f"Browse images of {SEEDED}").click()
    first = page.locator("#browse-grid li").first
    first.locator("img").wait_for()
    first.locator("summary", has_text="Metadata").click()
    editor = first.locator("textarea")
    editor.fill("{not json")
    first.get_by_role("button", name="Save metadata").click()
    first.locator("p.help", has_text="Not JSON").wait_for()
    editor.fill(json.dumps({"label": "Browser label", "category": "boots", "tags": ["a", "b"]}))
    first.get_by_role("button", name="Save metadata").click()
    first.locator("p.help", has_text="Saved.").wait_for()
    editor.fill(json.dumps({"label": 7}))
    first.get_by_role("button", name="Save metadata").click()
    first.locator("p.help", has_text="Not saved").wait_for()  # the 422 is shown, nothing changed
    page.goto(f"{server}/admin")
    page.locator("#sets-table tbody tr", has_text=SEEDED).get_by_role(
        "button", name=f"Browse images of {SEEDED}").click()
    page.locator("#browse-grid figcaption", has_text="Browser label").wait_for()

    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as c:
        other = c.get(f"/v1/sets/{SEEDED}/images").raise_for_status().json()["data"][-1]["sha256"]
        c.patch(f"/v1/sets/{SEEDED}/images/{other}", json={"metadata": {"category": "boots"}}).raise_for_status()

    box = filter_box(page, server)
    page.get_by_role("button", name="Filter category = boots (2 images)").click()  # the set's value counts
    assert json.loads(box.input_value()) == {"must": [{"key": "category", "match": {"value": "boots"}}]}
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#cards .card").first.wait_for(timeout=TIMEOUT_MS)
    assert page.locator("#cards .card").count() == 2
    card = page.locator("#cards .card", has_text="Browser label")
    assert card.locator(".card-name").inner_text() == "Browser label"
    assert "category: boots" in card.locator(".card-meta").inner_text()
    card.get_by_role("button", name="Side by side").click()
    caption = page.locator("#sbs-ref-caption")
    caption.wait_for(state="visible")
    assert "Browser label" in caption.inner_text() and "a, b" in caption.inner_text()  # the fields in the details

    box.fill(json.dumps({"must": [{"key": "category", "match": {"value": "sandals"}}]}))
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#cards li", has_text="the filter matches no reference in this set").wait_for()
    box.fill("{oops")
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#run-status", has_text="not JSON").wait_for()


def test_admin_page_shows_manifest_rows_and_applied_manifests(page: Any) -> None:  # noqa: F811
    """A zip whose manifest has bad rows is refused with each row shown in an error notice; a good one's job says
    the manifest was applied (not that it ignored an entry)."""
    from rubricsearch.app.demo.faces import demo_images, zip_bytes

    page.get_by_label("Name").fill("manifests")
    page.get_by_role("button", name="Create set").click()
    page.locator("#sets-table tbody tr", has_text="manifests").wait_for()
    page.locator("#upload-set").select_option(label="manifests")
    images = demo_images(2, seed=21)
    rows = "file,label\n" + "".join(f"{name},Face {i}\n" for i, (name, _) in enumerate(images))
    bad = rows + "ghost.png,Ghost\nother.png,Other\n"
    page.set_input_files("#upload-files", files=[{"name": "bad.zip", "mimeType": "application/zip",
                                                  "buffer": zip_bytes([*images, ("manifest.csv", bad.encode())])}])
    page.get_by_role("button", name="Upload", exact=True).click()
    notice = page.locator("#admin-error")
    notice.wait_for(state="visible")
    assert "notice-error" in (notice.get_attribute("class") or "") and notice.get_attribute("role") == "alert"
    assert "2 row(s) are wrong" in notice.inner_text()
    listed = page.locator("#admin-error-rows li").all_inner_texts()
    assert listed == ["line 4: 'ghost.png' is not an image of this source",
                      "line 5: 'other.png' is not an image of this source"]

    page.set_input_files("#upload-files", files=[{"name": "good.zip", "mimeType": "application/zip",
                                                  "buffer": zip_bytes([*images, ("manifest.csv", rows.encode())])}])
    page.get_by_role("button", name="Upload", exact=True).click()
    job = page.locator("#jobs .job", has_text="good.zip")
    job.locator(".state-succeeded").wait_for(timeout=TIMEOUT_MS)
    assert "manifest.csv applied: metadata for 2 images" in job.locator(".job-note").inner_text()
    assert job.locator(".job-ignored").is_hidden() and notice.is_hidden()


def test_chips_offer_only_values_that_images_share(page: Any, server: str) -> None:  # noqa: F811
    """A chip is a filter: values that several images share, of keys with few values. A key whose every image
    has its own value (a label, a price) gets none, nor does a value only one image holds."""
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as c:
        images = c.get(f"/v1/sets/{SEEDED}/images").raise_for_status().json()["data"]
        rows = [{"sha256": im["sha256"], "label": f"face {i}", "price": 10 + i,
                 "kind": "cat" if i < 5 else ("fox" if i < 7 else "wolf")} for i, im in enumerate(images)]
        manifest = "\n".join(json.dumps(r) for r in rows).encode()
        c.post(f"/v1/sets/{SEEDED}/manifest", files={"file": ("manifest.jsonl", manifest, "application/x-ndjson")},
               ).raise_for_status()
    filter_box(page, server)
    chips = page.locator("#metadata-counts .chip")
    chips.first.wait_for()
    texts = chips.all_inner_texts()
    assert "kind: cat (5)" in texts and "kind: fox (2)" in texts, texts
    assert not [t for t in texts if t.startswith(("label:", "price:")) or t == "kind: wolf (1)"], texts
