"""The web UI's pages without a browser: rendering, labels, escaping, static files, admin sign-in and CSRF."""

from __future__ import annotations

import io
import re
import shutil
import subprocess
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from PIL import Image

from rubricsearch.app.demo.faces import DEFAULT_SIZE, candidate_images, demo_faces, demo_images, zip_bytes
from rubricsearch.app.main import create_app
from rubricsearch.app.settings import Settings
from rubricsearch.app.state import AppState
from rubricsearch.indexer.catalog import create_set
from rubricsearch.web import STATIC_DIR
from tests.api_helpers import ADMIN_KEY, client_for


@pytest.fixture(scope="module")
def state(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AppState]:
    settings = Settings(_env_file=None, data_dir=tmp_path_factory.mktemp("web"), auth={"admin_api_keys": [ADMIN_KEY]})
    built = AppState.build(settings, embedder=False, reranker=False)  # ingestion service without models: no workers
    with built.catalog.write() as session:
        create_set(session, "animals")
        create_set(session, "<script>alert(1)</script>")
    yield built
    built.close()


@pytest.fixture
def client(state: AppState) -> Iterator[TestClient]:
    with client_for(state) as c:
        yield c


class Controls(HTMLParser):
    """Collects form controls, labels, images and inline script/style uses of a page."""

    def __init__(self) -> None:
        super().__init__()
        self.controls: list[dict[str, str | None]] = []
        self.label_for: set[str] = set()
        self.images: list[dict[str, str | None]] = []
        self.inline_scripts = 0
        self.style_attrs = 0
        self.meta: dict[str, str | None] = {}

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if "style" in a:
            self.style_attrs += 1
        if tag in ("input", "select", "textarea") and a.get("type") != "hidden":
            self.controls.append(a)
        elif tag == "label" and a.get("for"):
            self.label_for.add(str(a["for"]))
        elif tag == "img":
            self.images.append(a)
        elif (tag == "script" and not a.get("src")) or tag == "style":
            self.inline_scripts += 1
        elif tag == "meta" and a.get("name"):
            self.meta[str(a["name"])] = a.get("content")


def parse(html: str) -> Controls:
    p = Controls()
    p.feed(html)
    return p


def assert_accessible(html: str) -> Controls:
    page = parse(html)
    for control in page.controls:
        named = control.get("id") in page.label_for or control.get("aria-label") or control.get("aria-labelledby")
        assert named, f"form control without a label: {control}"
    assert all("alt" in img for img in page.images), "every <img> needs an alt attribute"
    assert page.inline_scripts == 0 and page.style_attrs == 0, "inline script/style would break the CSP"
    return page


def login(client: TestClient, key: str = ADMIN_KEY) -> str:
    """Sign in through the form; returns the page's CSRF token."""
    form = client.get("/admin")
    token = re.search(r'name="csrf_token" value="([^"]+)"', form.text)
    assert token is not None
    r = client.post("/admin/login", data={"key": key, "csrf_token": token.group(1)}, follow_redirects=False)
    assert r.status_code == 303, r.text
    page = parse(client.get("/admin").text)
    csrf = page.meta.get("csrf-token")
    assert csrf
    return csrf


def test_compare_page_lists_sets_with_labels_and_escapes(client: TestClient) -> None:
    r = client.get("/")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "script-src 'self'" in r.headers["content-security-policy"]
    assert r.headers["x-content-type-options"] == "nosniff"
    page = assert_accessible(r.text)
    ids = {c.get("id") for c in page.controls}
    assert ids >= {"set-select", "criteria", "candidate-file", "top-k", "top-n", "rerank", "threshold"}
    assert ">animals (0 indexed)</option>" in r.text
    assert "<script>alert(1)</script>" not in r.text and "&lt;script&gt;alert(1)&lt;/script&gt;" in r.text
    assert 'role="alert"' not in r.text.split("<main")[0]  # no test-model banner for real models


def test_query_preselects_set_and_criteria(client: TestClient, state: AppState) -> None:
    r = client.get("/", params={"set": "animals", "criteria": "green eyes\nround ears"})
    selected = re.search(r'<option value="([0-9a-f]+)" selected>animals', r.text)
    assert selected is not None
    assert "green eyes\nround ears</textarea>" in r.text


def test_banner_when_test_models(client: TestClient, state: AppState) -> None:
    state.test_models = True
    try:
        for path in ("/", "/admin"):
            text = client.get(path).text
            assert "Offline random-weight test models: results are not meaningful." in text  # TEST_LABEL
    finally:
        state.test_models = False
    assert "test models" not in client.get("/").text


def test_static_files_versioned_and_confined(client: TestClient) -> None:
    html = client.get("/").text
    links = re.findall(r'(?:href|src)="(/static/[^"]+)"', html)
    assert {link.split("?")[0] for link in links} >= {"/static/app.css", "/static/common.js", "/static/compare.js"}
    for link in links:
        r = client.get(link)
        assert r.status_code == 200 and "immutable" in r.headers["cache-control"]
    assert client.get("/static/app.css").headers["cache-control"] == "no-cache"
    assert client.get("/static/missing.js").status_code == 404
    assert client.get("/static/..%2F..%2Fapp%2Fsettings.py").status_code == 404
    assert client.get("/static/../templates/base.html").status_code == 404


@pytest.mark.parametrize("script", sorted(p.name for p in STATIC_DIR.glob("*.js")))
def test_scripts_parse(script: str) -> None:
    """A syntax error would silently kill a page; node (when installed) checks each script."""
    node = shutil.which("node") or shutil.which("nodejs")
    if node is None:
        pytest.skip("node is not installed")
    result = subprocess.run([node, "--check", str(STATIC_DIR / script)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr


def test_admin_sign_in_session_and_csrf(client: TestClient, state: AppState) -> None:
    r = client.get("/admin")
    assert_accessible(r.text)
    assert 'id="admin-key"' in r.text and "Sign in" in r.text
    assert f"<code>{state.settings.data_dir / 'demo-admin-key'}</code>" in r.text  # where the demo keeps its key
    # a wrong key, and a post without the form's token, are refused without a session
    token = re.search(r'name="csrf_token" value="([^"]+)"', r.text)
    assert token is not None
    bad = client.post("/admin/login", data={"key": "x" * 20, "csrf_token": token.group(1)}, follow_redirects=False)
    assert bad.status_code == 401 and "That is not an admin key." in bad.text and "rs_session" not in client.cookies
    forged = client.post("/admin/login", data={"key": ADMIN_KEY, "csrf_token": "forged"}, follow_redirects=False)
    assert forged.status_code == 403 and "rs_session" not in client.cookies

    ok_form = client.get("/admin")
    token = re.search(r'name="csrf_token" value="([^"]+)"', ok_form.text)
    assert token is not None
    ok = client.post("/admin/login", data={"key": ADMIN_KEY, "csrf_token": token.group(1)}, follow_redirects=False)
    assert ok.status_code == 303 and ok.headers["location"] == "/admin"
    cookie = ok.headers["set-cookie"].lower()
    assert "rs_session=" in cookie and "httponly" in cookie and "samesite" in cookie
    dash = client.get("/admin")
    assert "Reference sets" in dash.text and dash.headers["cache-control"] == "no-store"
    page = assert_accessible(dash.text)
    csrf = page.meta["csrf-token"]
    assert csrf and csrf in dash.text

    # sign-out needs the token too
    assert client.post("/admin/logout", data={"csrf_token": "nope"}, follow_redirects=False).status_code == 403
    out = client.post("/admin/logout", data={"csrf_token": csrf}, follow_redirects=False)
    assert out.status_code == 303
    assert 'id="admin-key"' in client.get("/admin").text


def test_session_mutations_need_the_csrf_header(client: TestClient) -> None:
    csrf = login(client)
    refused = client.post("/v1/sets", json={"name": "via-cookie"})
    assert refused.status_code == 403 and refused.json()["error"]["type"] == "forbidden"
    made = client.post("/v1/sets", json={"name": "via-cookie"}, headers={"X-CSRF-Token": csrf})
    assert made.status_code == 201, made.text
    assert ">via-cookie (0 indexed)</option>" in client.get("/").text


def test_login_is_rate_limited(state: AppState) -> None:
    with client_for(state) as c:
        statuses = []
        for _ in range(12):
            token = re.search(r'name="csrf_token" value="([^"]+)"', c.get("/admin").text)
            assert token is not None
            statuses.append(c.post("/admin/login", data={"key": "y" * 20, "csrf_token": token.group(1)}).status_code)
        assert statuses[0] == 401 and statuses[-1] == 429


def test_without_admin_keys_nobody_signs_in(state: AppState) -> None:
    with client_for(state, auth={"admin_api_keys": []}) as c:
        r = c.get("/admin")
        assert "No admin API key is configured" in r.text
        token = re.search(r'name="csrf_token" value="([^"]+)"', r.text)
        assert token is not None
        assert c.post("/admin/login", data={"key": "z" * 20, "csrf_token": token.group(1)}).status_code == 403


def test_search_key_hides_set_names_from_anonymous_visitors(state: AppState) -> None:
    with client_for(state, auth={"search_requires_key": True, "search_api_keys": ["s" * 20]}) as c:
        r = c.get("/")
        assert "animals" not in r.text and 'id="api-key"' in r.text
        assert_accessible(r.text)


def test_demo_images_are_deterministic_and_cover_the_attributes() -> None:
    first, again = demo_images(12), demo_images(12)
    assert first == again
    assert len({data for _, data in first}) == 12 and len({name for name, _ in first}) == 12
    img = Image.open(io.BytesIO(first[0][1]))
    assert img.size == (DEFAULT_SIZE, DEFAULT_SIZE) and img.format == "PNG"
    faces = demo_faces(40)
    for attribute in ("species", "fur", "ears", "stripes", "eyes"):
        assert len({getattr(f, attribute) for f in faces}) > 1, attribute
    assert all(f.name.endswith(".png") and f.species in f.name for f in faces)
    names = {name for name, _ in candidate_images()} & {name for name, _ in demo_images(40)}
    assert not names
    assert zip_bytes(first[:2])[:2] == b"PK"


def test_demo_command_registered() -> None:
    from rubricsearch.app.cli import build_parser

    args = build_parser().parse_args(["demo", "--no-serve", "--images", "4", "--port", "8123"])
    assert args.no_serve and args.images == 4 and args.port == 8123


@pytest.mark.slow
def test_demo_builds_the_set_once(tmp_path: Path, tiny_embedding_dir: Path, tiny_reranker_dir: Path,
                                  monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]) -> None:
    """``rubricsearch demo --no-serve``: ingests generated images with the tiny models, then reuses them."""
    from rubricsearch.app.cli import main

    monkeypatch.setenv("RUBRICSEARCH_MODELS__EMBEDDING_MODEL", str(tiny_embedding_dir))
    monkeypatch.setenv("RUBRICSEARCH_MODELS__RERANKER_MODEL", str(tiny_reranker_dir))
    monkeypatch.setenv("RUBRICSEARCH_MODELS__DTYPE", "float32")
    monkeypatch.delenv("RUBRICSEARCH_AUTH__ADMIN_API_KEYS", raising=False)
    data = tmp_path / "demo"
    assert main(["demo", "--no-serve", "--images", "6", "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    key = (data / "demo-admin-key").read_text().strip()
    assert key in out and "100%" in out and "http://127.0.0.1:8000/" in out
    assert len(list((data / "candidates").glob("*.png"))) == 3
    assert main(["demo", "--no-serve", "--images", "6", "--data-dir", str(data)]) == 0
    out = capsys.readouterr().out
    assert "is ready (6 images indexed)" in out and key in out

    settings = Settings(_env_file=None, data_dir=data, auth={"admin_api_keys": [key]})
    built = AppState.build(settings, embedder=False, reranker=False, services=False)
    try:
        with TestClient(create_app(settings, state=built)) as c:
            page = c.get("/").text
            assert "demo-animals (6 indexed)" in page
            # the demo's candidate faces are offered, titled with their true attributes
            assert page.count('class="candidate-pick"') == 3
            assert 'title="a cat; ginger fur; triangular ears; dark forehead stripes; green eyes"' in page
            assert f"<code>{data / 'demo-admin-key'}</code>" in c.get("/admin").text  # the sign-in hint names it
    finally:
        built.close()
