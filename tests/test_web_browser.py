"""The web UI in a real browser: Debian Chromium driven by playwright against a real uvicorn server.

The server runs in a subprocess on 127.0.0.1 with the tiny offline checkpoints, so the test-model banner
must show. Screenshots go to artifacts/screenshots/ (gitignored) for a person to look at.
Skipped when /usr/bin/chromium or playwright is missing, unless RUBRICSEARCH_REQUIRE_BROWSER=1.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from rubricsearch.app.demo.faces import candidate_images, demo_images, zip_bytes
from tests.api_helpers import ADMIN_KEY, wait_job
from tests.live_server import ServerFailed, live_server

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
                 "--disable-sync", "--no-first-run", "--disable-quic"]
ROOT = Path(__file__).resolve().parents[1]
SHOTS = ROOT / "artifacts" / "screenshots"
CRITERIA = ["short ginger fur", "triangular ears", "dark forehead stripes", "green eyes"]
TIMEOUT_MS = 60_000
SEEDED = "seeded-animals"


def _require_browser() -> Any:
    """The playwright module, or a skip (a failure when the browser is required)."""
    missing = None
    if not CHROMIUM.exists():
        missing = f"{CHROMIUM} is not installed (apt-get install chromium)"
    else:
        try:
            from playwright import sync_api
        except ImportError:
            missing = "python playwright is not installed"
    if missing:
        if os.environ.get("RUBRICSEARCH_REQUIRE_BROWSER") == "1":
            pytest.fail(missing)
        pytest.skip(missing)
    return sync_api


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, tiny_embedding_dir: Path,
           tiny_reranker_dir: Path) -> Iterator[str]:
    with seeded_server(tmp_path_factory.mktemp("browser-data"), tiny_embedding_dir, tiny_reranker_dir, _seed) as base:
        yield base


@contextmanager
def seeded_server(data_dir: Path, embedding: Path, reranker: Path, seed: Callable[[str], None]) -> Iterator[str]:
    """A live server of these models with the tests' admin key and a fixed session secret, seeded by
    ``seed(base)``; a server that cannot start fails the test with its log."""
    _require_browser()
    try:
        with live_server(data_dir, embedding, reranker, RUBRICSEARCH_MODELS__DTYPE="float32",
                         RUBRICSEARCH_AUTH__ADMIN_API_KEYS=ADMIN_KEY, RUBRICSEARCH_AUTH__SESSION_SECRET="s" * 32
                         ) as (_, base):
            seed(base)
            yield base
    except ServerFailed as exc:
        pytest.fail(str(exc))


def _seed(base: str) -> None:
    """A set ingested through the REST API, so each browser test can run alone."""
    auth = {"Authorization": f"Bearer {ADMIN_KEY}"}
    with httpx.Client(base_url=base, headers=auth, timeout=60) as c:
        c.post("/v1/sets", json={"name": SEEDED}).raise_for_status()
        files = [("files", (name, data, "image/png")) for name, data in demo_images(8, seed=3)]
        job = wait_job(c, c.post(f"/v1/sets/{SEEDED}/images", files=files).raise_for_status().json()["id"])
        assert job["done"] == 8, job


@contextmanager
def chromium() -> Iterator[Any]:
    """Debian's Chromium through playwright (never a downloaded browser), closed with the block."""
    sync_api = _require_browser()
    SHOTS.mkdir(parents=True, exist_ok=True)
    with sync_api.sync_playwright() as p:
        b = p.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        try:
            yield b
        finally:
            b.close()


@pytest.fixture(scope="module")
def browser(server: str) -> Iterator[Any]:
    with chromium() as b:
        yield b


def _sign_in(page: Any, base: str) -> None:
    page.goto(f"{base}/admin")
    page.get_by_label("Admin API key").fill(ADMIN_KEY)
    page.get_by_role("button", name="Sign in").click()
    page.get_by_role("heading", name="Reference sets").wait_for()
    page.locator("#create-set-form[data-ready]").wait_for(state="attached")


def _no_horizontal_overflow(page: Any) -> None:
    width = page.evaluate("document.documentElement.scrollWidth")
    viewport = page.evaluate("window.innerWidth")
    assert width <= viewport, f"the page is {width}px wide in a {viewport}px viewport"


@pytest.fixture
def page(browser: Any, server: str) -> Iterator[Any]:
    """A desktop-sized page, signed in on the admin page; a script error it raised fails the test."""
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    _sign_in(page, server)
    yield page
    context.close()
    assert not errors, errors


def _fill_comparison(page: Any) -> None:
    """The Compare form, once ready, with the criteria typed and the first demo candidate chosen."""
    page.locator("#compare-form[data-ready]").wait_for(state="attached")
    page.get_by_label("Criteria, one per line").fill("\n".join(CRITERIA))
    name, data = candidate_images()[0]
    page.set_input_files("#candidate-file", files=[{"name": name, "mimeType": "image/png", "buffer": data}])
    page.locator("#candidate-preview").wait_for(state="visible")


def _run_comparison(page: Any) -> None:
    _fill_comparison(page)
    page.get_by_role("button", name="Run comparison").click()
    page.locator("#cards .card").first.wait_for(timeout=TIMEOUT_MS)


def filter_box(page: Any, server: str) -> Any:
    """The seeded set's Compare page filled in and its options open: the metadata filter box."""
    page.goto(f"{server}/?set={SEEDED}")
    _fill_comparison(page)
    page.locator("details.options summary").click()
    return page.get_by_label("Metadata filter (Qdrant filter JSON, optional)")


def test_admin_upload_then_compare(browser: Any, server: str) -> None:
    context = browser.new_context(viewport={"width": 1280, "height": 900})
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))

    page.goto(f"{server}/admin")
    page.screenshot(path=str(SHOTS / "admin-login.png"))
    _sign_in(page, server)
    assert page.get_by_test_id("test-models-banner").is_visible()
    page.get_by_label("Name").fill("browser-animals")
    page.get_by_role("button", name="Create set").click()
    page.locator("#sets-table tbody tr", has_text="browser-animals").wait_for()

    files = [*demo_images(10), ("broken.png", b"this is not an image")]
    page.set_input_files("#upload-files", files=[
        {"name": "animals.zip", "mimeType": "application/zip", "buffer": zip_bytes(files)}])
    assert "1 file chosen" in page.locator("#upload-chosen").inner_text()
    streams: list[str] = []
    page.on("request", lambda r: streams.append(r.url) if r.url.endswith("/events") else None)
    page.get_by_role("button", name="Upload", exact=True).click()
    job = page.locator("#jobs .job", has_text="browser-animals")
    job.locator('progress[data-percent="100"]').wait_for(timeout=TIMEOUT_MS)
    job.locator(".state-completed_with_errors").wait_for()
    assert job.locator("progress").evaluate("p => p.value") == 1
    # a job with failures does not look like a success: its bar takes the warning colour (--warn-line)
    assert job.locator("progress").evaluate("p => getComputedStyle(p).accentColor") == "rgb(224, 176, 64)"
    assert job.locator("progress").get_attribute("data-state") == "completed_with_errors"
    assert streams, "the progress bar should follow the job's event stream"
    job.locator(".job-errors summary").click()
    assert "broken.png" in job.locator(".job-errors").inner_text()
    row = page.locator("#sets-table tbody tr", has_text="browser-animals")
    row.locator("td").nth(1).filter(has_text="10").wait_for()
    page.screenshot(path=str(SHOTS / "admin-desktop.png"), full_page=True)

    row.get_by_role("link", name="Compare").click()
    page.get_by_role("heading", name="Compare against a reference set").wait_for()
    assert page.get_by_test_id("test-models-banner").is_visible()
    _run_comparison(page)
    assert page.locator("#cards .card").count() == 10
    assert page.locator("#heatmap tbody tr").count() == 1 + len(CRITERIA)
    assert page.locator("#heatmap tbody td.cell").count() == 10 * (1 + len(CRITERIA))
    page.wait_for_function("() => [...document.querySelectorAll('#cards img')].every(i => i.naturalWidth > 0)")
    page.get_by_label("Stretch the colours to each row's range (shows small differences)").check()
    colours = page.locator("#heatmap tbody tr.overall td").evaluate_all(
        "cells => new Set(cells.map(c => c.style.backgroundColor)).size")
    assert colours > 1
    page.screenshot(path=str(SHOTS / "compare-desktop.png"), full_page=True)

    page.locator("#cards .card").first.get_by_role("button", name="Side by side").click()
    sbs = page.locator("#side-by-side")
    sbs.wait_for(state="visible")
    for criterion in CRITERIA:
        assert criterion in sbs.inner_text()
    assert sbs.locator("img").count() == 2
    page.get_by_label("Zoom (both images)").fill("2")
    assert page.locator("#sbs-zoom-value").inner_text() == "200%"
    for box in ("#sbs-cand-box", "#sbs-ref-box"):  # twice the size, scrolled to the centre, pixels loaded
        page.wait_for_function("b => b.querySelector('img').naturalWidth > 0", arg=page.locator(box).element_handle())
        assert page.locator(box).evaluate(
            "b => b.scrollWidth > 1.9 * b.clientWidth && b.scrollLeft > 0.4 * b.clientWidth")
    # a criterion's evidence, on demand: overlaid on the reference and the candidate, said in words
    toggle = sbs.get_by_role("button", name="dark forehead stripes")
    toggle.click()
    page.locator("#sbs-ref-box .evidence-overlay").wait_for(state="attached", timeout=TIMEOUT_MS)
    assert page.locator("#sbs-cand-box .evidence-overlay").count() == 1
    assert toggle.get_attribute("aria-pressed") == "true"
    assert "vision encodes" in sbs.locator(".evidence-status").inner_text()
    sbs.screenshot(path=str(SHOTS / "side-by-side-evidence.png"))
    toggle.click()
    assert page.locator("#side-by-side .evidence-overlay").count() == 0
    page.locator("#provenance summary").click()
    provenance = page.locator("#provenance-body").inner_text()
    assert "Embedding model" in provenance and "Per-criterion instructions" in provenance and "Timings" in provenance
    assert "Overall score" in provenance and "geometric mean of the per-criterion scores" in provenance
    sbs.screenshot(path=str(SHOTS / "side-by-side-desktop.png"))
    page.screenshot(path=str(SHOTS / "compare-provenance-desktop.png"), full_page=True)
    # weak matches (all of them at threshold 1) are marked by their border; no image is dimmed or recoloured
    page.locator("#threshold").evaluate("i => { i.value = '1'; i.dispatchEvent(new Event('change')); }")
    assert page.locator("#cards .card.weak").count() == 10
    assert page.locator("#cards .card-img").evaluate_all(
        "imgs => imgs.every(i => getComputedStyle(i).opacity === '1' && getComputedStyle(i).filter === 'none')")
    # a reference used as the candidate is that image (same bytes): its card says so, whatever the models think
    picked = page.locator("#cards .card").nth(2)
    picked_name = picked.locator(".card-name").inner_text()
    picked.locator("button", has_text="Use as candidate").click()
    page.get_by_role("button", name="Run comparison").click()
    badge = page.locator("#cards .card", has=page.locator(".card-flag.identical"))
    badge.wait_for(timeout=TIMEOUT_MS)
    assert badge.count() == 1 and badge.locator(".card-name").inner_text() == picked_name
    assert badge.locator(".card-flag.identical").inner_text() == "Identical image"
    assert "same bytes (sha256) as the candidate" in (page.locator("#provenance-body").text_content() or "")

    # back on the admin page: browse the set's images, then delete the set (confirming the dialog)
    page.goto(f"{server}/admin")
    row = page.locator("#sets-table tbody tr", has_text="browser-animals")
    row.get_by_role("button", name="Browse images of browser-animals").click()
    page.locator("#browse-grid li img").nth(9).wait_for()
    assert "(10)" in page.locator("#browse-heading").inner_text()
    page.once("dialog", lambda dialog: dialog.accept())
    row.get_by_role("button", name="Delete set browser-animals").click()
    row.wait_for(state="detached")
    assert page.locator("#browse").is_hidden()
    assert not errors, errors
    context.close()


def test_keyboard_and_drop(browser: Any, server: str) -> None:
    """The form works from the keyboard, and dropping a file fills the candidate like the file input does."""
    page = browser.new_page(viewport={"width": 1024, "height": 800})
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{server}/?set={SEEDED}")
    page.locator("#compare-form[data-ready]").wait_for(state="attached")
    data = candidate_images()[1][1]
    page.evaluate(
        """bytes => {
            const file = new File([new Uint8Array(bytes)], "dropped.png", {type: "image/png"});
            const dt = new DataTransfer();
            dt.items.add(file);
            const drop = new DragEvent("drop", {dataTransfer: dt, bubbles: true});
            document.getElementById("candidate-drop").dispatchEvent(drop);
        }""", list(data))
    assert "dropped.png" in page.locator("#candidate-status").inner_text()
    page.get_by_label("Criteria, one per line").focus()
    page.keyboard.type("round ears")
    page.get_by_role("button", name="Run comparison").focus()
    assert page.evaluate("getComputedStyle(document.activeElement).outlineStyle") != "none"
    page.keyboard.press("Enter")
    page.locator("#cards .card").first.wait_for(timeout=TIMEOUT_MS)
    assert page.evaluate("document.activeElement.id") == "results-heading"  # focus moves to the results
    assert page.locator("#cards .card").count() == 8

    # a reference can become the candidate (sent as {"image_id": sha256})
    page.locator("#cards .card").nth(2).get_by_role("button", name="Use").click()
    assert "Candidate: reference" in page.locator("#candidate-status").inner_text()
    page.keyboard.press("Enter")  # focus is on the run button
    page.get_by_text("Done: 8 results.").wait_for()
    page.locator("#cards .card").first.get_by_role("button", name="Side by side").click()
    assert page.locator("#sbs-cand-box img").evaluate("img => img.src.includes('/v1/images/')")

    # the side-by-side view: arrow keys move between results, Escape closes it and focus returns to the card
    heading = page.locator("#sbs-heading")
    assert heading.inner_text().endswith("rank 1")
    for key, rank in (("ArrowRight", 2), ("ArrowRight", 3), ("ArrowLeft", 2)):
        page.keyboard.press(key)
        assert heading.inner_text().endswith(f"rank {rank}")
        assert page.evaluate("document.activeElement.id") == "sbs-heading"
    page.keyboard.press("ArrowLeft")
    page.keyboard.press("ArrowLeft")  # nothing before rank 1
    assert heading.inner_text().endswith("rank 1")
    page.get_by_label("Zoom (both images)").focus()
    page.keyboard.press("ArrowRight")  # the slider keeps its arrows
    assert heading.inner_text().endswith("rank 1") and page.locator("#sbs-zoom-value").inner_text() == "125%"
    page.keyboard.press("Escape")
    page.locator("#side-by-side").wait_for(state="hidden")
    assert page.evaluate("document.activeElement.closest('.card').dataset.index") == "0"
    page.close()


def test_narrow_screen(browser: Any, server: str) -> None:
    context = browser.new_context(viewport={"width": 375, "height": 812}, device_scale_factor=2, is_mobile=True,
                                  has_touch=True)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    page.goto(f"{server}/?set={SEEDED}")
    _no_horizontal_overflow(page)
    _run_comparison(page)
    _no_horizontal_overflow(page)
    # plain words in the heatmap: the formula of the overall score is behind a disclosure, not in its row header
    overall = page.locator("#heatmap tr.overall th")
    assert overall.inner_text() == "Overall"
    assert overall.evaluate("th => th.getBoundingClientRect().height") < 60
    details = page.get_by_test_id("score-details")
    assert "geometric mean" not in details.inner_text()
    details.locator("summary").click()
    assert "geometric mean" in details.inner_text()
    _no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / "compare-375.png"), full_page=True)
    page.locator("#cards .card").nth(1).get_by_role("button", name="Side by side").click()
    page.locator("#side-by-side").wait_for(state="visible")
    _no_horizontal_overflow(page)
    page.locator("#side-by-side").screenshot(path=str(SHOTS / "side-by-side-375.png"))
    _evidence_by_keyboard(page, "dark forehead stripes")
    _no_horizontal_overflow(page)
    page.locator("#side-by-side").screenshot(path=str(SHOTS / "side-by-side-evidence-375.png"))
    _sign_in(page, server)
    page.locator("#sets-table tbody tr").first.wait_for()
    _no_horizontal_overflow(page)
    page.screenshot(path=str(SHOTS / "admin-375.png"), full_page=True)
    context.close()


# Where the overlay's cells are drawn, where the reference's pixels are shown (the image is contained in its
# element, letterboxed), and the box and viewport around them: page pixels.
_OVERLAY_GEOMETRY = """box => {
  const edges = (rects) => ({ left: Math.min(...rects.map((r) => r.left)), top: Math.min(...rects.map((r) => r.top)),
    right: Math.max(...rects.map((r) => r.right)), bottom: Math.max(...rects.map((r) => r.bottom)) });
  const img = box.querySelector("img");
  const shown = img.getBoundingClientRect();
  const scale = Math.min(shown.width / img.naturalWidth, shown.height / img.naturalHeight);
  const [w, h] = [img.naturalWidth * scale, img.naturalHeight * scale];
  const left = shown.left + (shown.width - w) / 2, top = shown.top + (shown.height - h) / 2;
  const frame = box.getBoundingClientRect();
  return { cells: edges([...box.querySelectorAll(".evidence-overlay rect")].map((r) => r.getBoundingClientRect())),
           image: { left, top, right: left + w, bottom: top + h },
           box: { left: frame.left, top: frame.top, right: frame.right, bottom: frame.bottom },
           viewport: { left: 0, top: -Infinity, right: window.innerWidth, bottom: Infinity } };
}"""


def _within(inner: dict[str, float], outer: dict[str, float], slack: float = 1.0) -> bool:
    return (inner["left"] >= outer["left"] - slack and inner["top"] >= outer["top"] - slack
            and inner["right"] <= outer["right"] + slack and inner["bottom"] <= outer["bottom"] + slack)


def _evidence_by_keyboard(page: Any, criterion: str) -> None:
    """Tab from the reference image to a criterion's evidence toggle, press it with the keyboard, and check the
    overlay: drawn over the reference's shown pixels (all of them, nothing outside), inside its box and the
    viewport, readable without hue (black and white only: a veil of varying opacity and outlined cells)."""
    page.locator("#sbs-ref-box").focus()
    for _ in range(30):
        page.keyboard.press("Tab")
        if page.evaluate("(document.activeElement.textContent || '').trim()") == criterion:
            break
    else:
        raise AssertionError(f"the evidence toggle of {criterion!r} is not reachable with Tab")
    page.keyboard.press("Enter")
    toggle = page.locator("#sbs-evidence").get_by_role("button", name=criterion)
    assert toggle.get_attribute("aria-pressed") == "true"
    page.locator("#sbs-ref-box .evidence-overlay").wait_for(state="attached", timeout=TIMEOUT_MS)
    page.wait_for_function("b => b.querySelector('img').naturalWidth > 0",
                           arg=page.locator("#sbs-ref-box").element_handle())
    assert "vision encodes" in page.locator("#sbs-evidence .evidence-status").inner_text()
    geometry = page.locator("#sbs-ref-box").evaluate(_OVERLAY_GEOMETRY)
    cells, image = geometry["cells"], geometry["image"]
    assert _within(cells, image) and _within(image, cells), geometry  # the map covers the image, no more
    assert _within(image, geometry["box"]) and _within(geometry["box"], geometry["viewport"]), geometry
    assert cells["right"] - cells["left"] > 100, geometry  # visible at this width, not a sliver
    paint = page.locator("#sbs-ref-box .evidence-overlay rect").evaluate_all(
        "rects => rects.map((r) => [r.getAttribute('fill'), r.getAttribute('stroke'), r.getAttribute('fill-opacity')])")
    assert {c for fill, stroke, _ in paint for c in (fill, stroke)} <= {"#000", "#fff", "none", None}, paint
    assert len({opacity for _, _, opacity in paint if opacity is not None}) > 1, paint  # a veil of several opacities
    assert any(stroke == "#fff" for _, stroke, _ in paint), paint  # the strongest cells outlined


LETTERBOXED = "letterboxed-animals"
# a 3:1 and a 1:3 reference, neither side a multiple of the model's 32-pixel patch grid
SHAPES = {"wide.png": (360, 120), "tall.png": (120, 360)}


@pytest.fixture(scope="module")
def letterboxed(server: str) -> str:
    """A set of the non-square references only, ingested through the REST API."""
    import io

    from PIL import Image

    files = []
    for (name, size), (_, data) in zip(SHAPES.items(), demo_images(2, seed=5), strict=True):
        out = io.BytesIO()
        Image.open(io.BytesIO(data)).convert("RGB").resize(size).save(out, format="PNG")
        files.append(("files", (name, out.getvalue(), "image/png")))
    with httpx.Client(base_url=server, headers={"Authorization": f"Bearer {ADMIN_KEY}"}, timeout=60) as c:
        c.post("/v1/sets", json={"name": LETTERBOXED}).raise_for_status()
        job = wait_job(c, c.post(f"/v1/sets/{LETTERBOXED}/images", files=files).raise_for_status().json()["id"])
        assert job["done"] == len(SHAPES), job
    return LETTERBOXED


@pytest.mark.parametrize("width", [375, 1280])
def test_the_evidence_covers_a_letterboxed_reference_exactly(browser: Any, server: str, letterboxed: str,
                                                             width: int) -> None:
    """A 3:1 and a 1:3 reference are shown whole in the square side-by-side box (contained, letterboxed): the
    evidence overlay covers the drawn image box exactly, not the bars beside it, on a phone and on a desktop."""
    context = browser.new_context(viewport={"width": width, "height": 900}, device_scale_factor=2)
    page = context.new_page()
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    page.goto(f"{server}/?set={letterboxed}")
    _run_comparison(page)
    assert page.locator("#cards .card").count() == len(SHAPES)
    seen = set()
    for i in range(len(SHAPES)):
        page.locator("#cards .card").nth(i).get_by_role("button", name="Side by side").click()
        page.locator("#side-by-side").wait_for(state="visible")
        box = page.locator("#sbs-ref-box")
        page.wait_for_function("b => b.querySelector('img').naturalWidth > 0", arg=box.element_handle())
        natural = box.locator("img").evaluate("img => [img.naturalWidth, img.naturalHeight]")
        # the geometry below is where object-fit: contain, centred, draws the pixels
        assert box.locator("img").evaluate(
            "img => [getComputedStyle(img).objectFit, getComputedStyle(img).objectPosition]") == ["contain", "50% 50%"]
        page.locator("#sbs-evidence").get_by_role("button", name=CRITERIA[2]).click()
        page.locator("#sbs-ref-box .evidence-overlay").wait_for(state="attached", timeout=TIMEOUT_MS)
        geometry = box.evaluate(_OVERLAY_GEOMETRY)
        cells, image, frame = geometry["cells"], geometry["image"], geometry["box"]
        assert _within(cells, image) and _within(image, cells), geometry  # the drawn box, no bars, nothing cut
        assert _within(image, frame) and _within(frame, geometry["viewport"]), geometry
        shown = (image["right"] - image["left"]) / (image["bottom"] - image["top"])
        assert abs(shown / (natural[0] / natural[1]) - 1) < 0.02, (natural, geometry)
        bars = (frame["right"] - frame["left"]) - (image["right"] - image["left"]), (
            frame["bottom"] - frame["top"]) - (image["bottom"] - image["top"])
        assert max(bars) > (frame["right"] - frame["left"]) / 2, (bars, geometry)  # letterboxed: wide bars
        seen.add(tuple(natural))
        page.locator("#side-by-side").screenshot(path=str(SHOTS / f"evidence-letterboxed-{i}-{width}.png"))
    assert seen == set(SHAPES.values())
    assert not errors, errors
    context.close()


def test_admin_page_tells_what_happened(page: Any) -> None:
    """Job rows show their source, times, duplicates and every ignored entry with its reason; an archive with
    no images says so; the set's Failed column agrees with its jobs' failed items."""
    page.get_by_label("Name").fill("truthful")
    page.get_by_role("button", name="Create set").click()
    row = page.locator("#sets-table tbody tr", has_text="truthful")
    row.wait_for()

    images = demo_images(3, seed=11)
    inner = zip_bytes(images[:1])
    files = [*images, ("copy-" + images[0][0], images[0][1]), ("README.txt", b"about these images"),
             ("nested.zip", inner),
             ("broken.png", b"not an image")]
    page.set_input_files("#upload-files", files=[
        {"name": "mixed-batch.zip", "mimeType": "application/zip", "buffer": zip_bytes(files)}])
    page.get_by_role("button", name="Upload", exact=True).click()
    job = page.locator("#jobs .job", has_text="mixed-batch.zip")
    job.locator('progress[data-percent="100"]').wait_for(timeout=TIMEOUT_MS)
    job.locator(".state-completed_with_errors").wait_for()
    assert "skipped: already in the set (duplicate)" in job.locator(".job-note").inner_text()
    assert "ended" in job.locator(".job-times").inner_text() and "—" not in job.locator(".job-times").inner_text()
    job.locator(".job-ignored summary").click()
    ignored = job.locator(".job-ignored").inner_text()
    assert "README.txt" in ignored and "not an image file name" in ignored
    assert "nested.zip" in ignored and "nested archives are not opened" in ignored
    row.locator("td").nth(1).filter(has_text="3").wait_for()
    assert row.locator("td").nth(3).inner_text() == "1"  # the broken file, as the job counts it
    assert "1 failed" in job.locator(".job-counts").inner_text()

    page.set_input_files("#upload-files", files=[
        {"name": "only-nested.zip", "mimeType": "application/zip", "buffer": zip_bytes([("inner.zip", inner)])}])
    page.get_by_role("button", name="Upload", exact=True).click()
    empty = page.locator("#jobs .job", has_text="only-nested.zip")
    empty.locator(".job-note", has_text="No images found").wait_for(timeout=TIMEOUT_MS)
    assert "1 entry ignored" in empty.locator(".job-note").inner_text()
