"""Which network addresses an image URL may reach: the server-side request forgery guard.

Only globally routable unicast addresses pass. The check runs on the addresses a host name *resolves to*
(and on every legacy numeric spelling the OS resolver would accept, such as ``2130706433`` or
``0x7f000001``), and the fetcher then connects to exactly the address that was checked, so a DNS answer
that changes between check and connect (rebinding) cannot redirect it. The tables are explicit rather than
:attr:`ipaddress.IPv4Address.is_global`, whose answers differ between Python versions and which calls
multicast, NAT64, 6to4 and IPv4-compatible forms of 127.0.0.1 "global".
"""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Callable
from dataclasses import dataclass, field

from rubricsearch.retrieval.errors import Forbidden, InvalidInput

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Resolver = Callable[[str, int], list[str]]

LOOPBACK = "loopback"
BLOCKED_HOSTNAMES = frozenset(
    {
        "metadata",
        "metadata.google.internal",
        "metadata.goog",
        "instance-data",
        "instance-data.ec2.internal",
    }
)
BLOCKED_HOST_SUFFIXES = (".internal",)
LOOPBACK_HOSTNAMES = frozenset({"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"})


Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def _table(rows: list[tuple[str, str]]) -> tuple[tuple[Network, str], ...]:
    return tuple((ipaddress.ip_network(net), reason) for net, reason in rows)


# Most specific first: the first match names the reason.
_V4_BLOCKS = _table(
    [
        ("169.254.169.254/32", "cloud metadata"),
        ("168.63.129.16/32", "cloud metadata (Azure WireServer)"),
        ("127.0.0.0/8", LOOPBACK),
        ("0.0.0.0/8", "unspecified / this network"),
        ("10.0.0.0/8", "private"),
        ("100.64.0.0/10", "shared address space (CGNAT)"),
        ("169.254.0.0/16", "link-local"),
        ("172.16.0.0/12", "private"),
        ("192.0.0.0/24", "IETF protocol assignments"),
        ("192.0.2.0/24", "documentation"),
        ("192.88.99.0/24", "6to4 relay anycast"),
        ("192.168.0.0/16", "private"),
        ("198.18.0.0/15", "benchmarking"),
        ("198.51.100.0/24", "documentation"),
        ("203.0.113.0/24", "documentation"),
        ("224.0.0.0/4", "multicast"),
        ("240.0.0.0/4", "reserved"),  # includes 255.255.255.255
    ]
)
_V6_BLOCKS = _table(
    [
        ("fd00:ec2::254/128", "cloud metadata"),
        ("::/128", "unspecified"),
        ("::1/128", LOOPBACK),
        ("::/96", "IPv4-compatible (deprecated)"),
        ("::ffff:0:0:0/96", "IPv4-translated"),
        ("64:ff9b:1::/48", "local-use NAT64"),
        ("100::/64", "discard-only"),
        ("2001::/32", "Teredo"),
        ("2001::/23", "IETF protocol assignments"),
        ("2001:db8::/32", "documentation"),
        ("3fff::/20", "documentation"),
        ("5f00::/16", "SRv6 segment identifiers"),
        ("fc00::/7", "unique local"),
        ("fe80::/10", "link-local"),
        ("fec0::/10", "site-local (deprecated)"),
        ("ff00::/8", "multicast"),
    ]
)
_V6_GLOBAL_UNICAST = ipaddress.ip_network("2000::/3")
_NAT64 = ipaddress.ip_network("64:ff9b::/96")


def parse_ip_literal(host: str) -> IPAddress | None:
    """The address a host string denotes by itself, including the legacy forms ``inet_aton`` accepts.

    ``127.1``, ``2130706433``, ``0x7f000001`` and ``0177.0.0.1`` all mean 127.0.0.1 to the C resolver, so
    they are treated as that address and never looked up in DNS.
    """
    text = host.strip("[]")
    try:
        return ipaddress.ip_address(text)
    except ValueError:
        pass
    if text and all(c in "0123456789abcdefxABCDEFX." for c in text):
        try:
            return ipaddress.IPv4Address(socket.inet_aton(text))
        except OSError:
            return None
    return None


def classify_address(address: str | IPAddress) -> str | None:
    """Why ``address`` must not be contacted (``"loopback"``, ``"private"``, ...); ``None`` if public."""
    if isinstance(address, str):
        if "%" in address:
            return "scoped (zone) address"
        parsed = parse_ip_literal(address)
        if parsed is None:
            return "not an IP address"
        address = parsed
    if isinstance(address, ipaddress.IPv6Address):
        if address.scope_id:
            return "scoped (zone) address"
        embedded = address.ipv4_mapped
        if embedded is None:
            embedded = address.sixtofour
        if embedded is None and address in _NAT64:
            embedded = ipaddress.IPv4Address(int(address) & 0xFFFFFFFF)
        if embedded is not None:
            inner = classify_address(embedded)
            return None if inner is None else (LOOPBACK if inner == LOOPBACK else f"IPv6-embedded {inner}")
        for net, reason in _V6_BLOCKS:
            if address in net:
                return reason
        return None if address in _V6_GLOBAL_UNICAST else "reserved"
    for net, reason in _V4_BLOCKS:
        if address in net:
            return reason
    return None if address.is_global else "reserved"


def system_resolve(host: str, port: int) -> list[str]:
    """All addresses the OS resolver gives for ``host`` (TCP), in its order."""
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP)
    except (socket.gaierror, UnicodeError) as exc:
        raise InvalidInput(f"host {host!r} does not resolve: {exc}", host=host) from exc
    seen: dict[str, None] = {}
    for *_, sockaddr in infos:
        seen.setdefault(str(sockaddr[0]), None)
    return list(seen)


def normalize_host(host: str) -> str:
    return host.strip("[]").rstrip(".").lower()


@dataclass(frozen=True)
class NetGuard:
    """Decides whether a (host, port) may be contacted and which single address to connect to.

    ``allow_loopback`` exists for tests of the happy path against a local server; ``allowed_hosts`` lists
    exact ``(host, port)`` pairs an operator trusts whatever they resolve to (an internal image server).
    Both default to nothing: production fetches reach public addresses only.
    """

    allow_loopback: bool = False
    allowed_hosts: frozenset[tuple[str, int]] = frozenset()
    resolve: Resolver = field(default=system_resolve, compare=False)

    def __post_init__(self) -> None:
        normalized = frozenset((normalize_host(h), int(p)) for h, p in self.allowed_hosts)
        object.__setattr__(self, "allowed_hosts", normalized)

    def is_trusted(self, host: str, port: int) -> bool:
        return (normalize_host(host), port) in self.allowed_hosts

    def refusal(self, address: str) -> str | None:
        """Why this guard refuses ``address``, or ``None``."""
        reason = classify_address(address)
        if reason == LOOPBACK and self.allow_loopback:
            return None
        return reason

    def check_hostname(self, host: str) -> None:
        """Refuse names that are dangerous before any lookup (cloud metadata, ``localhost``)."""
        name = normalize_host(host)
        if name in BLOCKED_HOSTNAMES or name.endswith(BLOCKED_HOST_SUFFIXES):
            raise Forbidden(f"host {host!r} is a cloud metadata or internal name", host=host)
        if not self.allow_loopback and (name in LOOPBACK_HOSTNAMES or name.endswith(".localhost")):
            raise Forbidden(f"host {host!r} is a loopback name", host=host)

    def pin(self, host: str, port: int) -> str:
        """Resolve ``host`` once, check every answer, and return the one address to connect to.

        If *any* answer is refused the host is refused: connecting to "the public one" would let an
        attacker who controls the DNS answer choose which address is used on retry.
        """
        trusted = self.is_trusted(host, port)
        if not trusted:
            self.check_hostname(host)
        literal = parse_ip_literal(normalize_host(host))
        addresses = [str(literal)] if literal is not None else self.resolve(normalize_host(host), port)
        if not addresses:
            raise InvalidInput(f"host {host!r} has no addresses", host=host)
        if not trusted:
            for address in addresses:
                reason = self.refusal(address)
                if reason is not None:
                    raise Forbidden(
                        f"host {host!r} resolves to a {reason} address ({address}); refusing to connect",
                        host=host,
                        address=address,
                        reason=reason,
                    )
        return addresses[0]
