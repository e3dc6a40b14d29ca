"""Facets on the Compare page, in real Chromium against a real server: after a facet job the set's computed
facet values are chips beside the metadata values; one click puts `facets.<attribute> = value` in the filter,
and the comparison then shows exactly the references the counts promised."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest

from tests.api_helpers import ADMIN_KEY, wait_job
from tests.test_web_browser import SEEDED, TIMEOUT_MS, browser, filter_box, page, server  # noqa: F401

pytestmark = pytest.mark.browser


def _facets(base: str) -> dict[str, int]:
    """A schema and its facet job through the REST API; the chosen values' counts."""
    with httpx.Client(base_url=base, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as c:
        c.put(f"/v1/sets/{SEEDED}/facets/schema", json={"attributes": [
            {"name": "ears", "values": ["round", "pointed"]}]}).raise_for_status()
        job = wait_job(c, c.post(f"/v1/sets/{SEEDED}/facets/jobs").raise_for_status().json()["id"])
        assert job["state"] == "succeeded", job
        got = c.get(f"/v1/sets/{SEEDED}/facets/counts").raise_for_status().json()
        counts: dict[str, int] = got["attributes"]["ears"]
        return counts


def test_facet_chips_filter_the_comparison(page: Any, server: str) -> None:  # noqa: F811
    counts = _facets(server)
    value, count = max(counts.items(), key=lambda kv: kv[1])
    assert count > 0
    box = filter_box(page, server)
    page.get_by_role("button", name=f"Filter facet ears = {value} ({count} images)").click()
    assert json.loads(box.input_value()) == {"must": [{"key": "facets.ears", "match": {"value": value}}]}
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#cards .card").first.wait_for(timeout=TIMEOUT_MS)
    assert page.locator("#cards .card").count() == count
