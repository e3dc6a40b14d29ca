"""``/docs`` and ``/redoc`` in a real browser with every non-loopback request blocked: the pages render
the operations from assets the app serves itself, and ask nothing of any other host."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest

from rubricsearch.app.main import create_app
from tests.api_helpers import api_settings, serve_in_thread
from tests.test_web_browser import CHROMIUM, CHROMIUM_ARGS, _require_browser

pytestmark = [pytest.mark.browser, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
         ) -> Iterator[str]:
    app = create_app(api_settings(tmp_path_factory.mktemp("docs"), tiny_embedding_dir, tiny_reranker_dir))
    with serve_in_thread(app) as url:
        yield url


@pytest.fixture(scope="module")
def page(base: str) -> Iterator[tuple[Any, list[str]]]:
    """A page whose requests to other hosts are aborted and listed, as are the loads the page's own security
    policy refused (they never become requests)."""
    sync_api = _require_browser()
    blocked: list[str] = []

    def only_loopback(route: Any) -> None:
        host = urlsplit(route.request.url).hostname
        if host in ("127.0.0.1", "::1"):
            route.continue_()
        else:
            blocked.append(route.request.url)
            route.abort()

    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        context = browser.new_context()
        context.route("**/*", only_loopback)
        tab = context.new_page()
        tab.on("console", lambda m: blocked.append(m.text) if "Refused to" in m.text else None)
        yield tab, blocked
        browser.close()


@pytest.mark.parametrize(("path", "operation"), [
    ("/docs", ".opblock-summary-path[data-path='/v2/embed']"),
    ("/redoc", "h2"),
])
def test_docs_render_offline(page: tuple[Any, list[str]], base: str, path: str, operation: str) -> None:
    tab, blocked = page
    tab.goto(base + path, wait_until="load", timeout=60_000)
    tab.wait_for_selector(operation, state="attached", timeout=60_000)
    for op in ("/v2/embed", "/v1/visual-packages", "/v1/embeddings"):  # operations rendered from the schema
        tab.wait_for_function(f"document.body.innerText.includes({op!r})", timeout=60_000)
    if path == "/redoc":  # its footer logo is drawn once the page has rendered
        tab.wait_for_selector("img[alt='redocly logo']", state="attached", timeout=60_000)
    assert blocked == [], f"{path} asked for non-loopback resources: {blocked}"
