"""Outbound URL guard: batchgate calls only http(s) URLs whose addresses are public, unless allowed.

Flow authors choose the URLs batchgate calls, so without a guard a flow could make batchgate reach
loopback services, the private network or a cloud metadata endpoint (SSRF). Every address a host name
resolves to is checked at call time; settings may admit hosts or networks (the local demo admits itself).
The check resolves before the request connects, so a host that changes its DNS answer in between
(DNS rebinding) is not covered; deployments that need that should also filter egress at the network.
"""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.errors import FatalError

METADATA = {ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")}

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class UnsafeURL(FatalError):
    """The URL is not http(s), or resolves to an address batchgate may not call."""

    status = 422
    title = "Unsafe outbound URL"
    type_slug = "unsafe-url"


@dataclass(frozen=True)
class Allowlist:
    """Host names and networks admitted although they are not public."""

    hosts: frozenset[str] = frozenset()
    networks: tuple[Network, ...] = ()

    @classmethod
    def parse(cls, entries: list[str]) -> Allowlist:
        """Entries are CIDRs (``127.0.0.1/32``, ``10.0.0.0/8``) or host names (``n8n.internal``)."""
        hosts, networks = set(), []
        for entry in entries:
            try:
                networks.append(ipaddress.ip_network(entry, strict=False))
            except ValueError:
                hosts.add(entry.lower().rstrip("."))
        return cls(frozenset(hosts), tuple(networks))

    def admits(self, ip: IPAddress) -> bool:
        return any(ip in net for net in self.networks)


def forbidden(ip: IPAddress) -> str | None:
    """Why ``ip`` may not be called, or None if it is public."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped:
        ip = ip.ipv4_mapped
    if ip in METADATA:
        return "a cloud metadata address"
    for attr, why in (("is_loopback", "loopback"), ("is_link_local", "link-local"),
                      ("is_private", "private"), ("is_multicast", "multicast"),
                      ("is_unspecified", "unspecified"), ("is_reserved", "reserved")):
        if getattr(ip, attr):
            return f"a {why} address"
    return None


def resolve(host: str, port: int) -> list[IPAddress]:
    """Every address ``host`` resolves to."""
    try:
        infos = socket.getaddrinfo(host, port, proto=socket.IPPROTO_TCP)
    except socket.gaierror as exc:
        raise UnsafeURL(f"cannot resolve host {host!r}: {exc.strerror}") from None
    return [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]


def check_url(url: str, allow: Allowlist) -> None:
    """Raise UnsafeURL unless ``url`` is http(s) and every address of its host may be called."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UnsafeURL(f"only http and https URLs may be called, not {parts.scheme or 'none'!r}")
    host = (parts.hostname or "").lower().rstrip(".")
    if not host:
        raise UnsafeURL("the URL has no host")
    if host in allow.hosts:
        return
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UnsafeURL("the URL's port is not a number in 0-65535") from None
    for ip in resolve(host, port):
        why = forbidden(ip)
        if why and not allow.admits(ip):
            raise UnsafeURL(f"host {host!r} resolves to {ip}, {why}; add it to "
                            "BATCHGATE_OUTBOUND_ALLOW to call it")
