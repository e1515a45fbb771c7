"""Outbound address policy: batchgate calls only http(s) hosts whose addresses are public, unless allowed.

Flow authors and tenants choose the URLs batchgate calls (targets, polls, source URLs), so without a guard
they could make batchgate reach loopback services, the private network or a cloud metadata endpoint (SSRF).
This module decides which addresses may be called; :mod:`gateway.net.outbound` enforces it on every connection
(the address checked is the address connected to) and on every redirect hop. :func:`check_url` is the same
decision made ahead of time, for clear errors at flow registration and job creation.

Refused unless ``BATCHGATE_OUTBOUND_ALLOW`` admits them: loopback, private, link-local, shared (CGNAT
100.64.0.0/10), multicast, reserved, unspecified and other non-global addresses, cloud metadata addresses,
the local-use NAT64 prefix, and IPv4-mapped, 6to4, NAT64 (64:ff9b::/96) and Teredo addresses wrapping any
of those. Hosts spelled as numbers (``2130706433``, ``0x7f.1``, ``0177.0.0.1``, ``127.1``) are judged by
the address they stand for.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

from gateway.errors import FatalError

METADATA = {ipaddress.ip_address(a) for a in ("169.254.169.254", "fd00:ec2::254", "100.100.100.200")}
CGNAT = ipaddress.ip_network("100.64.0.0/10")
NAT64 = ipaddress.ip_network("64:ff9b::/96")
NAT64_LOCAL = ipaddress.ip_network("64:ff9b:1::/48")
_NUMERIC = re.compile(r"[0-9a-fx.]+")

IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
AddrInfo = tuple[Any, ...]


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
                hosts.add(normal_host(entry))
        return cls(frozenset(hosts), tuple(networks))

    def admits(self, ip: IPAddress) -> bool:
        """True if a network of the list holds ``ip`` (or the IPv4 address an IPv4-mapped one stands for)."""
        mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
        return any(ip in net or (mapped is not None and mapped in net) for net in self.networks)

    def admits_host(self, host: str) -> bool:
        """True if ``host`` is admitted by name (whatever it resolves to)."""
        return normal_host(host) in self.hosts


def normal_host(host: str) -> str:
    """A host as compared and resolved: lower case, no IPv6 brackets, no trailing dot."""
    return host.strip().lower().strip("[]").rstrip(".")


def _wrapped(ip: ipaddress.IPv6Address) -> list[tuple[ipaddress.IPv4Address, str]]:
    """The IPv4 addresses an IPv6 address carries inside it (6to4, NAT64, Teredo), with the form's name."""
    inner: list[tuple[ipaddress.IPv4Address, str]] = []
    if ip.sixtofour is not None:
        inner.append((ip.sixtofour, "6to4"))
    if ip.teredo is not None:
        inner.extend((v4, "Teredo") for v4 in ip.teredo)
    return inner


def forbidden(ip: IPAddress) -> str | None:
    """Why ``ip`` may not be called, or None if it is public."""
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:  # the same host, spelled in IPv6
            return forbidden(ip.ipv4_mapped)
        if ip in NAT64:  # a NAT64 gateway forwards to the IPv4 address in the last 32 bits
            inner = ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
            why = forbidden(inner)
            return f"{why} ({inner}) behind the NAT64 prefix" if why else None
        if ip in NAT64_LOCAL:
            return "a local-use NAT64 address"
        for inner, form in _wrapped(ip):
            why = forbidden(inner)
            if why:
                return f"{why} ({inner}) wrapped in a {form} address"
    if ip in METADATA:
        return "a cloud metadata address"
    for attr, why in (("is_loopback", "a loopback"), ("is_link_local", "a link-local"),
                      ("is_unspecified", "an unspecified"), ("is_multicast", "a multicast"),
                      ("is_reserved", "a reserved")):
        if getattr(ip, attr):
            return f"{why} address"
    if ip in CGNAT:
        return "a shared (CGNAT) address"
    if ip.is_private:
        return "a private address"
    if not ip.is_global:
        return "a special-purpose (non-global) address"
    return None


def numeric_host(host: str) -> IPAddress | None:
    """The address a host spelled as a number stands for, as a resolver reads it, else None.

    Besides the usual forms this takes what ``inet_aton`` takes: ``2130706433``, ``0x7f000001``,
    ``0177.0.0.1``, ``127.1``.
    """
    host = normal_host(host)
    try:
        return ipaddress.ip_address(host.split("%")[0])
    except ValueError:
        pass
    if not _NUMERIC.fullmatch(host) or not host[0].isdigit():
        return None
    try:
        return ipaddress.IPv4Address(socket.inet_aton(host))
    except OSError:
        return None


def _refusal(host: str, ip: IPAddress, why: str) -> UnsafeURL:
    if host == str(ip):
        what = f"host {host} is {why}"
    else:
        what = f"host {host!r} {'is' if numeric_host(host) is not None else 'resolves to'} {ip}, {why}"
    return UnsafeURL(f"{what}; add it to BATCHGATE_OUTBOUND_ALLOW to call it")


def checked_addresses(host: str, port: int, allow: Allowlist) -> list[AddrInfo]:
    """Resolve ``host`` once and return its ``getaddrinfo`` entries, if every address may be called.

    The connection must be made to one of these entries (never by resolving again), so the address
    checked is the address connected to. A host admitted by name is resolved but not checked.

    Raises:
        UnsafeURL: the host's spelling or one of its addresses is refused.
        socket.gaierror: the host does not resolve.
    """
    host = normal_host(host)
    if not host:
        raise UnsafeURL("the URL has no host")
    admitted = allow.admits_host(host)
    spelled = numeric_host(host)
    if spelled is not None and not admitted:
        why = forbidden(spelled)
        if why and not allow.admits(spelled):
            raise _refusal(host, spelled, why)
    infos = socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM)
    if admitted:
        return infos
    for info in infos:
        ip = ipaddress.ip_address(str(info[4][0]).split("%")[0])
        why = forbidden(ip)
        if why and not allow.admits(ip):
            raise _refusal(host, ip, why)
    return infos


def url_host_port(url: str) -> tuple[str, int]:
    """The host and port ``url`` connects to; UnsafeURL unless it is an http(s) URL with a host."""
    parts = urlsplit(url)
    if parts.scheme not in ("http", "https"):
        raise UnsafeURL(f"only http and https URLs may be called, not {parts.scheme or 'none'!r}")
    host = normal_host(parts.hostname or "")
    if not host:
        raise UnsafeURL("the URL has no host")
    try:
        port = parts.port or (443 if parts.scheme == "https" else 80)
    except ValueError:
        raise UnsafeURL("the URL's port is not a number in 0-65535") from None
    return host, port


#: names that stand for this machine whatever DNS says (RFC 6761: localhost and every name under it)
LOCAL_NAMES = ("localhost",)


def check_url_shape(url: str, allow: Allowlist) -> None:
    """Raise UnsafeURL for what the URL itself shows to be refused, resolving nothing: a scheme other
    than http(s), no host, a bad port, a host written as a refused address (``http://10.0.0.1``,
    ``http://0x7f000001``), or a name for this machine (``localhost``). Flow registration and
    subscriptions use it: a target on ``api.dify.ai`` registers where that name does not resolve (an
    offline build machine), and each call is checked on connection by the guarded session anyway."""
    host, _ = url_host_port(url)
    if allow.admits_host(host):
        return
    ip = numeric_host(host)
    if ip is not None:
        if not allow.admits(ip) and (why := forbidden(ip)):
            raise _refusal(host, ip, why)
        return
    if host in LOCAL_NAMES or host.endswith(".localhost"):
        raise UnsafeURL(f"host {host!r} names this machine (a loopback address); add it to "
                        "BATCHGATE_OUTBOUND_ALLOW to call it")


def check_url(url: str, allow: Allowlist) -> None:
    """Raise UnsafeURL unless ``url`` is http(s) and every address of its host may be called now.

    A check ahead of time, for clear errors; the guarded session checks again on each connection.
    """
    host, port = url_host_port(url)
    if allow.admits_host(host):
        return  # admitted by name: nothing to check (and it need not resolve from here)
    try:
        checked_addresses(host, port, allow)
    except socket.gaierror as exc:
        raise UnsafeURL(f"cannot resolve host {host!r}: {exc.strerror}") from None
    except UnicodeError:
        raise UnsafeURL(f"host {host!r} is not a valid host name") from None
