"""HTTP helpers: GET with error classification, and URLs that are safe to show.

Readers send every request through the session they are given: a server passes one that guards
outbound addresses and redirects (gateway.net.outbound); standalone use gets a plain requests.Session.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import requests
import urllib3

from chunker.errors import SourceReadError


def display_url(url: str) -> str:
    """Returns url without credentials, query string or fragment (they may hold secrets)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    if parts.port:
        host = f"{host}:{parts.port}"
    return urlunsplit((parts.scheme, host, parts.path, "", ""))


def origin(url: str) -> tuple[str, str, int | None]:
    """Returns (scheme, host, port) of url, with the default port made explicit ("" for a bad URL)."""
    try:
        parts = urlsplit(url)
        port = parts.port or {"http": 80, "https": 443}.get(parts.scheme)
    except ValueError:
        return "", "", None
    return parts.scheme, (parts.hostname or "").lower(), port


def retry_after_seconds(value: str | None) -> float | None:
    """A Retry-After header (delta-seconds, or an HTTP date, which is always GMT) in seconds from now;
    None when absent or not valid. Parsed by urllib3, as connectors.base does."""
    if not value:
        return None
    try:
        return float(_RETRY_AFTER.parse_retry_after(value))
    except urllib3.exceptions.InvalidHeader:
        return None


_RETRY_AFTER = urllib3.util.Retry()


def request_error(exc: requests.RequestException, url: str) -> SourceReadError:
    """Converts a requests exception to SourceReadError without echoing the query string.

    An exception with a string ``refusal`` attribute (a caller's outbound guard refused the address,
    see gateway.net.outbound) is a non-retryable error that gives the reason.
    """
    refusal = getattr(exc, "refusal", None)
    if isinstance(refusal, str):
        return SourceReadError(f"GET {display_url(url)} refused: {refusal}", retryable=False)
    transient = (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError)
    retryable = isinstance(exc, transient) and not isinstance(exc, requests.exceptions.SSLError)
    reason = type(exc).__name__
    inner = getattr(exc.args[0], "reason", exc.args[0]) if exc.args else None
    if isinstance(inner, BaseException) and type(inner).__name__ != reason:
        reason = f"{reason} ({type(inner).__name__})"
    return SourceReadError(f"GET {display_url(url)} failed: {reason}", retryable=retryable)


def http_get(
    session: requests.Session,
    url: str,
    *,
    timeout_s: float,
    params: Mapping[str, Any] | None = None,
    headers: Mapping[str, str] | None = None,
    stream: bool = False,
    accept: tuple[int, ...] = (),
) -> requests.Response:
    """Sends a GET and returns the response if it is 2xx or its status is in accept.

    Raises:
        SourceReadError: retryable for connection errors, timeouts, 429 and 5xx (with
            retry_after_s from Retry-After); not retryable for other statuses.
    """
    try:
        resp = session.get(url, params=params, headers=headers, timeout=timeout_s, stream=stream)
    except requests.RequestException as exc:
        raise request_error(exc, url) from None
    code = resp.status_code
    if 200 <= code < 300 or code in accept:
        return resp
    resp.close()
    retryable = code == 429 or code >= 500
    retry_after = retry_after_seconds(resp.headers.get("Retry-After")) if retryable else None
    raise SourceReadError(
        f"GET {display_url(url)} returned HTTP {code}", retryable=retryable, retry_after_s=retry_after
    )
