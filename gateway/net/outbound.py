"""The guarded HTTP session every outbound request of batchgate goes through (sources, targets, polls).

:func:`guarded_session` returns a ``requests.Session`` that enforces :mod:`gateway.net.urlguard` where it
matters, on the connection itself:

- **The address checked is the address connected to.** Each new connection resolves its host once, checks
  every address, and connects the socket to a checked address; the Host header and the TLS server name
  (SNI and certificate check) stay the URL's host. A host whose DNS answer changes between a check and
  the connect (DNS rebinding) gains nothing: there is no second lookup.
- **Every redirect hop is a new request through the same guard**, at most :data:`MAX_REDIRECTS` of them.
  When a hop changes the origin (scheme, host or port), every header but a few content-negotiation ones is
  dropped: ``Authorization``, cookies, the platform's API key headers, a source's custom headers and
  batchgate's own signature. 303 (and 301/302 after a POST) continue as GET, 307/308 keep method and body,
  except that a body holding one of batchgate's signed URLs (a callback or blob URL: a bearer credential,
  as in a callback-mode envelope's ``callback_url``) is never re-sent to another origin: that hop is
  refused. Within the origin it is followed (the origin already holds the URL).
- No proxies from the environment, no ``.netrc``, and no cookie jar shared between calls.

A refused connection raises :class:`RefusedURL`, a ``requests.RequestException`` that is not a connection
error: the chunker reports it as a non-retryable source read error, the connectors as a FATAL platform
error. Its ``refusal`` attribute says why (no query string, no secrets).
"""

from __future__ import annotations

import logging
import socket
import sys
from http.cookiejar import DefaultCookiePolicy
from typing import Any
from urllib.parse import urlsplit

import requests
from requests.adapters import HTTPAdapter
from urllib3.connection import HTTPConnection, HTTPSConnection
from urllib3.connectionpool import HTTPConnectionPool, HTTPSConnectionPool
from urllib3.exceptions import ConnectTimeoutError, NameResolutionError, NewConnectionError
from urllib3.util.connection import _set_socket_options
from urllib3.util.timeout import _DEFAULT_TIMEOUT

from connectors.transport import undelivered_mark
from gateway import tracing
from gateway.net.keepalive import IdleLimitPoolMixin, ProvenDeliveryMixin, fresh_connections, replayable
from gateway.net.urlguard import Allowlist, UnsafeURL, checked_addresses, normal_host
from gateway.security import SIGNED_URL_PATHS

log = logging.getLogger(__name__)

MAX_REDIRECTS = 5

KEPT_ACROSS_ORIGINS = frozenset({
    "accept", "accept-encoding", "accept-language", "connection", "content-length", "content-type",
    "range", "transfer-encoding", "user-agent",
})
"""Headers a redirect to another origin keeps; every other header may carry a credential."""


class RefusedURL(requests.exceptions.InvalidURL):
    """The guard refused a connection (or a redirect hop); ``refusal`` says why."""

    def __init__(self, refusal: str, **kwargs: Any) -> None:
        super().__init__(refusal, **kwargs)
        self.refusal = refusal


class _NoCookies(DefaultCookiePolicy):
    """Keep no cookies: one session serves every tenant's calls."""

    def set_ok(self, cookie: Any, request: Any) -> bool:
        return False


class _GuardedConnectionMixin:
    """Connect to an address :func:`checked_addresses` approved, never resolving the host again."""

    allow: Allowlist = Allowlist()

    def _new_conn(self) -> socket.socket:
        conn: Any = self
        try:
            infos = checked_addresses(conn._dns_host, conn.port, self.allow)
        except socket.gaierror as exc:
            raise NameResolutionError(conn.host, conn, exc) from exc
        except UnicodeError:
            raise UnsafeURL(f"host {conn.host!r} is not a valid host name") from None
        err: OSError | None = None
        for family, socktype, proto, _canon, sockaddr in infos:
            sock = None
            try:
                sock = socket.socket(family, socktype, proto)
                _set_socket_options(sock, conn.socket_options)
                if conn.timeout is not _DEFAULT_TIMEOUT:
                    sock.settimeout(conn.timeout)
                if conn.source_address:
                    sock.bind(conn.source_address)
                sock.connect(sockaddr)
                sys.audit("http.client.connect", conn, conn.host, conn.port)
                return sock
            except OSError as exc:
                err = exc
                if sock is not None:
                    sock.close()
        if isinstance(err, TimeoutError):
            raise ConnectTimeoutError(
                conn, f"Connection to {conn.host} timed out. (connect timeout={conn.timeout})") from err
        raise NewConnectionError(conn, f"Failed to establish a new connection: {err}") from err


def _pool_classes(allow: Allowlist) -> dict[str, type[HTTPConnectionPool]]:
    """Connection pool classes whose connections are guarded by ``allow``."""
    mixins = (_GuardedConnectionMixin, ProvenDeliveryMixin)
    http_conn = type("GuardedHTTPConnection", (*mixins, HTTPConnection), {"allow": allow})
    https_conn = type("GuardedHTTPSConnection", (*mixins, HTTPSConnection), {"allow": allow})
    return {
        "http": type("GuardedHTTPConnectionPool", (IdleLimitPoolMixin, HTTPConnectionPool),
                     {"ConnectionCls": http_conn}),
        "https": type("GuardedHTTPSConnectionPool", (IdleLimitPoolMixin, HTTPSConnectionPool),
                      {"ConnectionCls": https_conn}),
    }


class GuardedAdapter(HTTPAdapter):
    """An HTTPAdapter whose connections go only to addresses ``allow`` (and the public rule) admit."""

    __attrs__ = [*HTTPAdapter.__attrs__, "allow"]

    def __init__(self, allow: Allowlist, **kwargs: Any) -> None:
        self.allow = allow
        super().__init__(**kwargs)

    def init_poolmanager(self, connections: int, maxsize: int, block: bool = False,
                         **pool_kwargs: Any) -> None:
        super().init_poolmanager(connections, maxsize, block, **pool_kwargs)
        self.poolmanager.pool_classes_by_scheme = _pool_classes(self.allow)

    def send(self, request: requests.PreparedRequest, stream: bool = False, timeout: Any = None,
             verify: Any = True, cert: Any = None, proxies: Any = None) -> requests.Response:
        """Send without any proxy (a proxy would connect where the guard cannot see); a request a reused
        connection provably did not deliver (gateway.net.keepalive) goes once more on a new connection."""
        tracing.inject(request.headers)  # W3C traceparent of the current span, when tracing is on
        try:
            try:
                return super().send(request, stream=stream, timeout=timeout, verify=verify, cert=cert,
                                    proxies={})
            except requests.ConnectionError as exc:
                if undelivered_mark(exc) != "reused" or not replayable(request.body):
                    raise
                log.info("%s %s: the server closed a reused connection before reading the request; "
                         "sending it once more on a new connection", request.method, _where(request.url))
            with fresh_connections():
                return super().send(request, stream=stream, timeout=timeout, verify=verify, cert=cert,
                                    proxies={})
        except UnsafeURL as exc:
            raise RefusedURL(exc.detail, request=request) from None


def _where(url: str | None) -> str:
    """scheme://host:port of ``url``: no path or query, which may carry a token."""
    parts = urlsplit(url or "")
    return f"{parts.scheme}://{parts.hostname}:{parts.port or ''}"


def origin(url: str | None) -> tuple[str, str, int | None]:
    """(scheme, host, port) of ``url``, the default port made explicit."""
    parts = urlsplit(url or "")
    try:
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        port = None
    return parts.scheme.lower(), normal_host(parts.hostname or ""), port


class GuardedSession(requests.Session):
    """A Session whose every connection and redirect hop passes the outbound guard."""

    def __init__(self, allow: Allowlist) -> None:
        super().__init__()
        self.allow = allow
        self.trust_env = False  # no proxies or .netrc credentials from the environment
        self.max_redirects = MAX_REDIRECTS
        self.cookies.set_policy(_NoCookies())
        adapter = GuardedAdapter(allow)
        self.mount("http://", adapter)
        self.mount("https://", adapter)

    def should_strip_auth(self, old_url: str, new_url: str) -> bool:
        """Credentials stay only while scheme, host and port stay the same."""
        return origin(old_url) != origin(new_url)

    def rebuild_auth(self, prepared_request: requests.PreparedRequest, response: requests.Response) -> None:
        """On a redirect to another origin, drop every header that may carry a credential, and refuse
        the hop if it would re-send a body holding a signed URL (requests has already dropped the body
        unless the answer was 307 or 308)."""
        if self.should_strip_auth(response.request.url or "", prepared_request.url or ""):
            if holds_signed_url(prepared_request.body):
                raise RefusedURL(
                    f"{_where(response.request.url)} answered {response.status_code} with a redirect to "
                    f"{_where(prepared_request.url)}, another origin; the request body holds a signed "
                    "batchgate URL (a credential), so it is not sent there", request=prepared_request)
            headers = prepared_request.headers
            for name in [n for n in headers if n.lower() not in KEPT_ACROSS_ORIGINS]:
                del headers[name]


def holds_signed_url(body: Any) -> bool:
    """Whether a request body (bytes or text) holds a path of one of batchgate's signed URLs."""
    if isinstance(body, str):
        body = body.encode("utf-8", "surrogatepass")
    if not isinstance(body, (bytes, bytearray)):
        return body is not None  # a stream cannot be looked into: treated as holding one
    return any(path.encode() in body for path in SIGNED_URL_PATHS)


def guarded_session(allow: Allowlist | None = None) -> GuardedSession:
    """A new guarded session; ``allow`` admits exceptions (``BATCHGATE_OUTBOUND_ALLOW``)."""
    return GuardedSession(allow or Allowlist())


def session_for(settings: Any | None) -> GuardedSession:
    """A guarded session admitting what ``settings.outbound_allow`` admits (no settings: public only)."""
    return GuardedSession(Allowlist.parse(settings.outbound_allow) if settings is not None else Allowlist())
