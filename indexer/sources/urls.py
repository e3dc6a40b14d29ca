"""Images fetched from a list of http(s) URLs, through the :class:`~indexer.sources.netguard.NetGuard`.

Every hop (the URL and each redirect) is validated (scheme, no credentials, host syntax), resolved once,
checked, and then requested from exactly that address: the URL handed to httpx carries the checked IP,
while the ``Host`` header and TLS SNI / certificate check keep the original name. Keep-alive is off so a
TLS connection verified for one name is never reused for another name at the same address; proxies and
``.netrc`` from the environment are ignored. Bodies are streamed raw (``Accept-Encoding: identity``; an
encoded body is refused, so no gzip bomb is ever inflated) and aborted past the byte limit.
"""

from __future__ import annotations

import json
import re
import ssl
import time
from collections.abc import Iterable
from typing import Any

import httpx

from rubricsearch.indexer.sources.base import ListedSource, SourceLimits
from rubricsearch.indexer.sources.netguard import NetGuard, parse_ip_literal
from rubricsearch.retrieval.errors import (
    BackendUnavailable,
    ImageError,
    InvalidInput,
    InvalidMetadata,
    NotFound,
    PayloadTooLarge,
    RubricSearchError,
    UnsupportedMedia,
)
from rubricsearch.retrieval.images import DEFAULT_MAX_BYTES

DEFAULT_USER_AGENT = "rubricsearch-fetcher/0.1"
REDIRECT_STATUSES = frozenset({301, 302, 303, 307, 308})
DEFAULT_PORTS = {"http": 80, "https": 443}
MAX_URL_CHARS = 2048
_LABEL = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(?:\.{_LABEL})*\.?$")


def effective_port(url: httpx.URL) -> int:
    return DEFAULT_PORTS[url.scheme] if url.port is None else url.port


def validate_url(url: str | httpx.URL) -> httpx.URL:
    """Parse and check one URL (or redirect target) before anything is resolved or sent."""
    text = str(url).strip()
    if len(text) > MAX_URL_CHARS:
        raise InvalidInput(f"URL is longer than {MAX_URL_CHARS} characters")
    try:
        parsed = httpx.URL(text)
    except (httpx.InvalidURL, ValueError, TypeError) as exc:
        raise InvalidInput(f"not a valid URL: {exc}") from exc
    if parsed.scheme not in DEFAULT_PORTS:
        raise InvalidInput(f"only http and https URLs are fetched, not {parsed.scheme or 'a relative URL'!r}")
    if parsed.userinfo:
        raise InvalidInput("URLs with credentials (user:password@) are not accepted")
    host = parsed.raw_host.decode("ascii", "replace").lower()
    if not host:
        raise InvalidInput("URL has no host")
    if parse_ip_literal(host) is None and not _HOSTNAME.match(host):
        raise InvalidInput(f"URL host {host!r} is not a valid host name or address")
    port = effective_port(parsed)
    if not 1 <= port <= 65535:
        raise InvalidInput(f"URL port {port} is out of range")
    return parsed


class UrlFetcher:
    """Fetches one image URL under the guard, with byte, redirect and time limits.

    ``total_timeout`` bounds the whole fetch, checked between chunks: a server dripping bytes is cut off
    at most ``read_timeout`` after it. Thread safe; call :meth:`close` when done.
    """

    def __init__(
        self,
        guard: NetGuard | None = None,
        *,
        max_bytes: int = DEFAULT_MAX_BYTES,
        connect_timeout: float = 5.0,
        read_timeout: float = 10.0,
        total_timeout: float = 30.0,
        max_redirects: int = 5,
        user_agent: str = DEFAULT_USER_AGENT,
        verify: ssl.SSLContext | bool = True,
    ) -> None:
        self.guard = guard or NetGuard()
        self.max_bytes = max_bytes
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.total_timeout = total_timeout
        self.max_redirects = max_redirects
        self.user_agent = user_agent
        self._client = httpx.Client(
            verify=verify,
            trust_env=False,
            follow_redirects=False,
            limits=httpx.Limits(max_keepalive_connections=0),
        )

    def fetch(self, url: str, *, max_bytes: int | None = None) -> bytes:
        """The body of ``url`` after at most ``max_redirects`` checked redirects, or a typed error."""
        limit = self.max_bytes if max_bytes is None else min(max_bytes, self.max_bytes)
        deadline = time.monotonic() + self.total_timeout
        current = validate_url(url)
        for _ in range(self.max_redirects + 1):
            result = self._hop(current, limit, deadline, ref=url)
            if isinstance(result, bytes):
                return result
            current = validate_url(current.join(result))
        raise InvalidInput(f"{url}: more than {self.max_redirects} redirects", ref=url)

    def _hop(self, url: httpx.URL, limit: int, deadline: float, *, ref: str) -> bytes | str:
        """One request: the body (bytes) or a redirect target (str)."""
        port = effective_port(url)
        address = self.guard.pin(url.raw_host.decode("ascii"), port)
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BackendUnavailable(f"{ref}: the total time limit of {self.total_timeout}s ran out", ref=ref)
        timeout = httpx.Timeout(
            min(self.read_timeout, remaining), connect=min(self.connect_timeout, remaining)
        )
        request = self._client.build_request(
            "GET",
            url.copy_with(host=address),
            headers={
                "Host": url.netloc.decode("ascii"),
                "Accept": "image/*",
                "Accept-Encoding": "identity",
                "User-Agent": self.user_agent,
            },
            extensions={"sni_hostname": url.raw_host.decode("ascii")},
            timeout=timeout,
        )
        try:
            response = self._client.send(request, stream=True)
            try:
                return self._read(response, limit, deadline, ref)
            finally:
                response.close()
        except httpx.TimeoutException as exc:
            raise BackendUnavailable(f"{ref}: timed out ({type(exc).__name__})", ref=ref) from exc
        except httpx.HTTPError as exc:
            raise BackendUnavailable(f"{ref}: cannot fetch: {exc}", ref=ref) from exc

    def _read(self, response: httpx.Response, limit: int, deadline: float, ref: str) -> bytes | str:
        status = response.status_code
        if status in REDIRECT_STATUSES:
            location = response.headers.get("location")
            if not location:
                raise InvalidInput(f"{ref}: redirect ({status}) without a Location", ref=ref)
            return location
        if status in (404, 410):
            raise NotFound(f"{ref}: the server answered {status}", ref=ref, status=status)
        if status == 429 or status >= 500:
            raise BackendUnavailable(f"{ref}: the server answered {status}", ref=ref, status=status)
        if status != 200:
            raise InvalidInput(f"{ref}: the server answered {status}", ref=ref, status=status)
        encoding = response.headers.get("content-encoding", "identity").strip().lower()
        if encoding not in ("", "identity"):
            raise UnsupportedMedia(f"{ref}: content-encoding {encoding!r} is not accepted", ref=ref)
        declared = response.headers.get("content-length", "")
        if declared.isdigit() and int(declared) > limit:
            raise PayloadTooLarge(
                f"{ref} declares {declared} bytes; the limit is {limit}", limit=limit, ref=ref
            )
        chunks: list[bytes] = []
        total = 0
        for chunk in response.iter_raw():  # as received: no buffering past the checks
            total += len(chunk)
            if total > limit:
                raise PayloadTooLarge(f"{ref} is larger than {limit} bytes", limit=limit, ref=ref)
            if time.monotonic() > deadline:
                raise BackendUnavailable(f"{ref}: the total time limit ran out", ref=ref)
            chunks.append(chunk)
        if total == 0:
            raise ImageError(f"{ref}: the server sent an empty body", ref=ref)
        return b"".join(chunks)

    def close(self) -> None:
        self._client.close()

    def __enter__(self) -> UrlFetcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class UrlSource(ListedSource):
    """One item per distinct URL; blank lines and ``#`` comments are ignored, repeats are skipped."""

    kind = "url"

    def __init__(
        self,
        urls: Iterable[str],
        *,
        fetcher: UrlFetcher | None = None,
        limits: SourceLimits | None = None,
    ) -> None:
        super().__init__(limits or SourceLimits())
        self._own_fetcher = fetcher is None
        self.fetcher = fetcher or UrlFetcher(max_bytes=self.limits.max_item_bytes)
        for line in urls:
            url = line.strip()
            if not url or url.startswith("#"):
                continue
            if url in self._entries:
                self._skip(url, "duplicate URL")
            else:
                self._add(url)

    def _load(self, ref: str) -> bytes:
        try:
            return self.fetcher.fetch(ref, max_bytes=self.limits.max_item_bytes)
        except RubricSearchError as exc:
            exc.details.setdefault("ref", ref)
            raise

    def close(self) -> None:
        if self._own_fetcher:
            self.fetcher.close()


def url_list(text: str) -> tuple[list[str], dict[str, Any]]:
    """A URL list file's URLs, one a line, or JSONL lines ``{"url": ..., "metadata": {...}}``; metadata by URL."""
    urls: list[str] = []
    metadata: dict[str, Any] = {}
    for n, line in enumerate(text.splitlines(), start=1):
        line = line.strip()
        if not line.startswith("{"):
            urls.append(line)
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InvalidMetadata(f"URL list line {n} is not JSON: {exc}") from None
        if not isinstance(row, dict) or not isinstance(row.get("url"), str) or set(row) - {"url", "metadata"}:
            raise InvalidMetadata(f"URL list line {n}: expected {{\"url\": ..., \"metadata\": {{...}}}}")
        urls.append(row["url"].strip())
        if row.get("metadata"):
            metadata[row["url"].strip()] = row["metadata"]
    return urls, metadata
