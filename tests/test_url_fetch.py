"""URL fetching under the SSRF guard. All traffic goes to 127.0.0.1 / 127.0.0.2 / ::1 only.

Refusals are proven with a canary server that records every accepted connection: after the refused
fetches it is probed once by the test itself, and that probe must be the only connection it ever saw.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from rubricsearch.indexer.sources import NetGuard, UrlFetcher, UrlSource, classify_address, validate_url
from rubricsearch.indexer.sources.urls import url_list
from rubricsearch.retrieval.errors import (
    BackendUnavailable,
    Forbidden,
    InvalidInput,
    InvalidMetadata,
    NotFound,
    PayloadTooLarge,
    RubricSearchError,
    UnsupportedMedia,
)
from tests import fixtures_images as fx

pytestmark = pytest.mark.timeout(60)
IMAGE = fx.png(40, 30, fx.BLUE)


class RecordingServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address: tuple[str, int], handler: type[BaseHTTPRequestHandler], family: int) -> None:
        self.address_family = family
        self.connections: list[object] = []
        self.requests: list[tuple[str, str]] = []  # (path, Host header)
        super().__init__(address, handler)

    def get_request(self) -> tuple[socket.socket, object]:
        conn, addr = super().get_request()
        self.connections.append(addr)
        return conn, addr

    @property
    def port(self) -> int:
        return int(self.server_address[1])


class Handler(BaseHTTPRequestHandler):
    server: RecordingServer

    def log_message(self, *args: object) -> None:
        pass

    def _send(self, status: int, body: bytes = b"", headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        if "Content-Length" not in (headers or {}):
            self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        query = {k: v[0] for k, v in parse_qs(url.query, keep_blank_values=True).items()}
        self.server.requests.append((self.path, self.headers.get("Host", "")))
        route: Callable[[dict[str, str]], None] | None = getattr(self, f"route_{url.path.strip('/')}", None)
        if route is None:
            self._send(404)
        else:
            route(query)

    def route_img(self, q: dict[str, str]) -> None:
        self._send(200, IMAGE, {"Content-Type": "image/png"})

    def route_canary(self, q: dict[str, str]) -> None:
        self._send(200, b"canary")

    def route_redirect(self, q: dict[str, str]) -> None:
        self._send(int(q.get("status", "302")), headers={"Location": q["to"]})

    def route_loop(self, q: dict[str, str]) -> None:
        self._send(302, headers={"Location": "/loop"})

    def route_big(self, q: dict[str, str]) -> None:
        self._send(200, headers={"Content-Length": str(10**9)})

    def route_endless(self, q: dict[str, str]) -> None:
        self.send_response(200)
        self.end_headers()  # no length: the body ends when the connection does
        block = b"\0" * 65536
        try:
            for _ in range(2048):  # 128 MiB at most, should the client not abort
                self.wfile.write(block)
        except OSError:
            pass

    def route_gzip(self, q: dict[str, str]) -> None:
        self._send(200, b"\x1f\x8b" + b"\0" * 20, {"Content-Encoding": "gzip"})

    def route_slow(self, q: dict[str, str]) -> None:
        self.send_response(200)
        self.send_header("Content-Length", "100000")
        self.end_headers()
        try:
            for _ in range(200):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass

    def route_error(self, q: dict[str, str]) -> None:
        self._send(int(q["status"]))


@contextmanager
def serve(host: str = "127.0.0.1", port: int = 0) -> Iterator[RecordingServer]:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    server = RecordingServer((host, port), Handler, family)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def assert_untouched(canary: RecordingServer, host: str) -> None:
    """Probe the canary once; accepted connections are FIFO, so the probe must be the first and only one."""
    authority = f"[{host}]" if ":" in host else host
    with httpx.Client(trust_env=False) as client:
        assert client.get(f"http://{authority}:{canary.port}/canary?probe=1").text == "canary"
    assert canary.requests == [("/canary?probe=1", f"{authority}:{canary.port}")]
    assert len(canary.connections) == 1


def ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


# --- the happy path (a test server on loopback, allowed explicitly) ---------------------------------


def test_fetch_image_from_local_server_with_loopback_allowed() -> None:
    with serve() as server, UrlFetcher(NetGuard(allow_loopback=True)) as fetcher:
        assert fetcher.fetch(f"http://127.0.0.1:{server.port}/img") == IMAGE
        # Redirects are followed, each hop checked.
        target = f"http://127.0.0.1:{server.port}/img"
        assert fetcher.fetch(f"http://127.0.0.1:{server.port}/redirect?to={target}&status=301") == IMAGE
        assert fetcher.fetch(f"http://127.0.0.1:{server.port}/redirect?to=/img&status=308") == IMAGE


def test_connection_is_pinned_to_the_checked_address_and_keeps_the_host_header() -> None:
    calls: list[str] = []

    def rebinding_resolver(host: str, port: int) -> list[str]:
        calls.append(host)
        return ["127.0.0.1"] if len(calls) == 1 else ["127.0.0.2"]  # a rebinding DNS answer

    with serve("127.0.0.1") as server, serve("127.0.0.2", server.port) as canary:
        guard = NetGuard(allow_loopback=True, resolve=rebinding_resolver)
        with UrlFetcher(guard) as fetcher:
            assert fetcher.fetch(f"http://images.test:{server.port}/img") == IMAGE
        assert calls == ["images.test"]  # resolved once; httpx only ever saw the checked address
        assert server.requests == [("/img", f"images.test:{server.port}")]
        assert_untouched(canary, "127.0.0.2")


# --- refusals: the canary must never be reached -----------------------------------------------------


def test_loopback_in_every_spelling_is_refused_by_default() -> None:
    with serve() as canary:
        p = canary.port
        urls = [f"http://127.0.0.1:{p}/canary", f"http://localhost:{p}/canary",
                f"http://LOCALHOST.:{p}/canary", f"http://foo.localhost:{p}/canary",
                f"http://2130706433:{p}/canary", f"http://0x7f000001:{p}/canary",
                f"http://0177.0.0.1:{p}/canary", f"http://127.1:{p}/canary", f"http://127.0.1:{p}/canary",
                f"http://0x7f.1:{p}/canary", f"http://0.0.0.0:{p}/canary", f"http://0:{p}/canary",
                f"http://[::ffff:127.0.0.1]:{p}/canary", f"http://[::ffff:7f00:1]:{p}/canary",
                f"https://127.0.0.1:{p}/canary"]
        with UrlFetcher() as fetcher:
            for url in urls:
                with pytest.raises((Forbidden, InvalidInput)):
                    fetcher.fetch(url)
        assert_untouched(canary, "127.0.0.1")


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_ipv6_loopback_is_refused_by_default() -> None:
    with serve("::1") as canary, UrlFetcher() as fetcher:
        for host in ("[::1]", "[0:0:0:0:0:0:0:1]", "[::]", "[::127.0.0.1]"):
            with pytest.raises(Forbidden):
                fetcher.fetch(f"http://{host}:{canary.port}/canary")
        assert_untouched(canary, "::1")


def test_redirect_from_an_allowed_entry_point_to_loopback_is_refused() -> None:
    with serve() as entry, serve() as canary:
        guard = NetGuard(allowed_hosts=frozenset({("127.0.0.1", entry.port)}))
        targets = [f"http://127.0.0.1:{canary.port}/canary", f"http://localhost:{canary.port}/canary",
                   f"http://2130706433:{canary.port}/canary", f"http://[::ffff:127.0.0.1]:{canary.port}/c"]
        with UrlFetcher(guard) as fetcher:
            assert fetcher.fetch(f"http://127.0.0.1:{entry.port}/img") == IMAGE  # the entry point works
            for target in targets:
                for status in (301, 302, 303, 307, 308):
                    with pytest.raises(Forbidden):
                        fetcher.fetch(f"http://127.0.0.1:{entry.port}/redirect?to={target}&status={status}")
            for bad in ("file:///etc/passwd", f"http://user:pw@127.0.0.1:{entry.port}/img", "gopher://x/"):
                with pytest.raises(InvalidInput):
                    fetcher.fetch(f"http://127.0.0.1:{entry.port}/redirect?to={bad}")
        assert len(entry.requests) == 1 + 4 * 5 + 3
        assert_untouched(canary, "127.0.0.1")


def test_injected_resolver_pointing_at_loopback_is_refused() -> None:
    with serve() as canary:
        guard = NetGuard(resolve=lambda host, port: ["127.0.0.1"])
        with UrlFetcher(guard) as fetcher, pytest.raises(Forbidden, match="loopback"):
            fetcher.fetch(f"http://innocent.example:{canary.port}/canary")
        assert_untouched(canary, "127.0.0.1")


def test_guard_refuses_mixed_answers_and_metadata_names_without_any_traffic() -> None:
    # pin() only resolves (here through an injected resolver) and classifies: no connection is made.
    looked_up: list[str] = []

    def resolver(host: str, port: int) -> list[str]:
        looked_up.append(host)
        return {"mixed.test": ["93.184.216.34", "10.0.0.5"], "public.test": ["93.184.216.34"],
                "meta.test": ["169.254.169.254"], "v6meta.test": ["fd00:ec2::254"]}[host]

    guard = NetGuard(resolve=resolver)
    assert guard.pin("public.test", 443) == "93.184.216.34"
    for host in ("mixed.test", "meta.test", "v6meta.test"):
        with pytest.raises(Forbidden):
            guard.pin(host, 80)
    for name in ("metadata.google.internal", "METADATA.GOOGLE.INTERNAL.", "metadata", "instance-data",
                 "anything.internal", "localhost"):
        with pytest.raises(Forbidden):
            guard.pin(name, 80)
    assert looked_up == ["public.test", "mixed.test", "meta.test", "v6meta.test"]
    # Operator-trusted entry points are exact (host, port) pairs.
    trusted = NetGuard(allowed_hosts=frozenset({("Images.Corp.", 8080)}), resolve=lambda h, p: ["10.1.2.3"])
    assert trusted.pin("images.corp", 8080) == "10.1.2.3"
    with pytest.raises(Forbidden):
        trusted.pin("images.corp", 8081)


@pytest.mark.parametrize("address,reason", [
    ("127.0.0.1", "loopback"), ("127.255.255.254", "loopback"), ("10.1.2.3", "private"),
    ("172.16.0.1", "private"), ("172.31.255.255", "private"), ("192.168.1.1", "private"),
    ("169.254.169.254", "metadata"), ("169.254.1.1", "link-local"), ("100.64.0.1", "CGNAT"),
    ("100.100.100.200", "CGNAT"), ("0.0.0.0", "unspecified"), ("0.1.2.3", "this network"),
    ("224.0.0.1", "multicast"), ("239.255.255.250", "multicast"), ("240.0.0.1", "reserved"),
    ("255.255.255.255", "reserved"), ("192.0.2.1", "documentation"), ("198.18.0.1", "benchmarking"),
    ("192.0.0.192", "IETF"), ("168.63.129.16", "metadata"),
    ("::1", "loopback"), ("::", "unspecified"), ("fc00::1", "unique local"), ("fd12:3456::1", "unique local"),
    ("fd00:ec2::254", "metadata"), ("fe80::1", "link-local"), ("fe80::1%eth0", "scoped"),
    ("fec0::1", "site-local"), ("ff02::1", "multicast"), ("2001:db8::1", "documentation"),
    ("::ffff:127.0.0.1", "loopback"), ("::ffff:10.0.0.1", "embedded private"),
    ("::ffff:169.254.169.254", "metadata"), ("64:ff9b::a00:1", "embedded private"),
    ("64:ff9b::7f00:1", "loopback"), ("2002:a00:1::", "embedded private"), ("2002:7f00:1::1", "loopback"),
    ("::7f00:1", "IPv4-compatible"), ("::ffff:0:7f00:1", "IPv4-translated"), ("2001::1", "Teredo"),
    ("100::1", "discard"), ("4000::1", "reserved"), ("2130706433", "loopback"), ("0x7f.1", "loopback"),
    ("not-an-ip", "not an IP"),
])
def test_classifier_refuses_non_public_addresses(address: str, reason: str) -> None:
    result = classify_address(address)
    assert result is not None and reason.lower() in result.lower(), result


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "93.184.216.34", "2606:4700:4700::1111",
                                     "2a00:1450:4001::200e", "64:ff9b::808:808", "2002:808:808::1",
                                     "::ffff:8.8.8.8"])
def test_classifier_allows_public_addresses(address: str) -> None:
    assert classify_address(address) is None


def test_loopback_exception_is_only_loopback() -> None:
    guard = NetGuard(allow_loopback=True)
    assert guard.refusal("127.0.0.1") is None and guard.refusal("::1") is None
    assert guard.refusal("::ffff:127.0.0.1") is None
    for other in ("10.0.0.1", "169.254.169.254", "0.0.0.0", "fe80::1"):
        assert guard.refusal(other) is not None


@pytest.mark.parametrize("url", ["ftp://example.com/a.png", "file:///etc/passwd", "javascript:alert(1)",
                                 "data:image/png;base64,AAAA", "http://user:pw@example.com/a.png",
                                 "http://user@example.com/", "http://ex%61mple.com/", "http:///a.png",
                                 "/relative.png", "http://a_b..c/", "http://exa mple.com/",
                                 "http://example.com:0/", "http://" + "a" * 2100 + ".com/"])
def test_validate_url_refuses(url: str) -> None:
    with pytest.raises(InvalidInput):
        validate_url(url)


def test_validate_url_accepts_ordinary_urls() -> None:
    for url in ("http://example.com/a.png", "https://Example.COM:8443/x?y=1", "https://bücher.de/a.jpg",
                "http://[2606:4700::1]/a", "http://images.example.com./a.png"):
        validate_url(url)


# --- limits and per-item errors (loopback allowed: they test limits, not the guard) -----------------


def test_limits_and_status_errors() -> None:
    with serve() as server:
        base = f"http://127.0.0.1:{server.port}"
        fetcher = UrlFetcher(NetGuard(allow_loopback=True), max_bytes=MIB, total_timeout=0.5,
                             max_redirects=3)
        cases: list[tuple[str, type[RubricSearchError]]] = [
            ("/big", PayloadTooLarge), ("/endless", PayloadTooLarge), ("/gzip", UnsupportedMedia),
            ("/slow", BackendUnavailable), ("/loop", InvalidInput), ("/error?status=404", NotFound),
            ("/error?status=410", NotFound), ("/error?status=500", BackendUnavailable),
            ("/error?status=429", BackendUnavailable), ("/error?status=403", InvalidInput),
            ("/redirect?to=", InvalidInput), ("/error?status=204", InvalidInput),
        ]
        with fetcher:
            for path, error in cases:
                with pytest.raises(error):
                    fetcher.fetch(base + path)
            with pytest.raises(InvalidInput, match="redirects"):
                UrlFetcher(NetGuard(allow_loopback=True), max_redirects=0).fetch(
                    f"{base}/redirect?to=/img")
        with socket.socket() as s:  # a port with nothing listening
            s.bind(("127.0.0.1", 0))
            closed = s.getsockname()[1]
        with pytest.raises(BackendUnavailable):
            UrlFetcher(NetGuard(allow_loopback=True)).fetch(f"http://127.0.0.1:{closed}/img")


MIB = 1024 * 1024


def test_url_source_lists_once_and_fails_per_item() -> None:
    with serve() as server:
        base = f"http://127.0.0.1:{server.port}"
        lines = [f"{base}/img", "", "# a comment", f"{base}/img", f"{base}/error?status=404",
                 "ftp://example.com/x.png", f"  {base}/redirect?to=/img  "]
        fetcher = UrlFetcher(NetGuard(allow_loopback=True))
        with UrlSource(lines, fetcher=fetcher) as source:
            assert source.refs() == [f"{base}/img", f"{base}/error?status=404", "ftp://example.com/x.png",
                                     f"{base}/redirect?to=/img"]
            assert [s.reason for s in source.skipped] == ["duplicate URL"]
            assert server.requests == []  # listing fetches nothing
            results: dict[str, object] = {}
            for item in source.items():
                try:
                    results[item.ref] = item.load()
                except RubricSearchError as exc:
                    results[item.ref] = exc.kind
        fetcher.close()
        assert list(results.values()) == [IMAGE, "not_found", "invalid_input", IMAGE]


def test_url_source_default_fetcher_refuses_loopback() -> None:
    with serve() as canary:
        with UrlSource([f"http://127.0.0.1:{canary.port}/canary"]) as source, pytest.raises(Forbidden):
            source.load(source.refs()[0])
        assert_untouched(canary, "127.0.0.1")


def test_a_url_list_reads_plain_lines_and_jsonl_rows_and_names_a_bad_line() -> None:
    urls, metadata = url_list('http://a.test/1.png\n  {"url": " http://a.test/2.png ", "metadata": {"label": "two"}}\n'
                              '{"url": "http://a.test/3.png", "metadata": {}}\n\n# note\n')
    assert urls == ["http://a.test/1.png", "http://a.test/2.png", "http://a.test/3.png", "", "# note"]
    assert metadata == {"http://a.test/2.png": {"label": "two"}}
    with pytest.raises(InvalidMetadata, match="URL list line 2 is not JSON"):
        url_list("http://a.test/1.png\n{oops\n")
    for row in ('{"url": 7}', '{"url": "http://a.test/1.png", "meta": {}}', '{"metadata": {}}'):
        with pytest.raises(InvalidMetadata, match="URL list line 1: expected"):
            url_list(row)
