"""Signed, expiring tokens for the URLs batchgate hands to platforms (callbacks, blobs), and log redaction.

A token is ``<body>.<mac>``: ``body`` the base64url (unpadded) JSON payload with an ``exp`` (unix seconds),
``mac`` the base64url HMAC-SHA256 of ``"<purpose>.<body>"``. Only the canonical encoding verifies: the
URL-safe alphabet, no padding, no whitespace, zero trailing bits, so one payload has exactly one token.
(itsdangerous was considered; its decoder accepts ``+/``, padding and non-zero trailing bits too, and its
expiry is chosen by the verifier, not recorded at signing, so it would not keep these guarantees.)
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import re
import time
from typing import Any

from gateway.errors import FatalError, Unauthorized

#: URL paths whose last segment is a signed token (authenticated by it, never by a bearer token).
SIGNED_URL_PATHS = ("/v1/callbacks/", "/v1/blobs/", "/decide/")
_B64URL = re.compile(r"[A-Za-z0-9_-]*")
#: The fields a token of each purpose carries (besides ``exp``), and their types: a genuine token without
#: them (signed by an older release, or by hand with the key) is refused as malformed, never a 500.
#: j: job id, s: batch seq, st: stage index, a: attempt, t: lease token.
CLAIMS: dict[str, dict[str, type]] = {
    "callback": {"j": str, "s": int, "st": int, "a": int, "t": str},
    "blob": {"j": str, "s": int},
    "decide": {"a": str},  # a: approval id (p: the approver the link was made for, absent = anyone)
}


class TokenExpired(FatalError):
    """The signed URL's token is genuine but past its expiry."""

    status = 410
    title = "Link expired"
    type_slug = "link-expired"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    """Decode canonical unpadded base64url only; ValueError for anything else."""
    if not _B64URL.fullmatch(text) or len(text) % 4 == 1:
        raise ValueError("not canonical base64url")
    try:
        data = base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))
    except binascii.Error:
        raise ValueError("not base64url") from None
    if _b64(data) != text:  # non-zero trailing bits: another spelling of the same bytes
        raise ValueError("not canonical base64url")
    return data


def sign(payload: dict[str, Any], key: bytes, purpose: str, ttl_s: float | None = None, *,
         expires_s: int | None = None) -> str:
    """``<payload>.<mac>``: the payload (with an expiry) in base64url, HMAC-SHA256 bound to ``purpose``.
    The expiry is ``ttl_s`` from now, or ``expires_s`` (epoch seconds) for a token that must come out the
    same whenever it is made (an approval link, re-made on each delivery of its event)."""
    exp = expires_s if expires_s is not None else int(time.time() + (ttl_s or 0))
    body = _b64(json.dumps({**payload, "exp": exp}, separators=(",", ":")).encode())
    mac = hmac.new(key, f"{purpose}.{body}".encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify(token: str, key: bytes, purpose: str) -> dict[str, Any]:
    """The payload of a genuine, unexpired token; 401 if forged or malformed (the fields its purpose
    carries, :data:`CLAIMS`, missing or mistyped included), 410 if expired.

    Non-canonical spellings of a genuine token (padding, ``+/``, altered trailing bits) are forged.
    """
    body, dot, mac = token.partition(".")
    try:
        if not dot or not body or not mac:
            raise ValueError("not <body>.<mac>")
        given = _unb64(mac)
        _unb64(body)
        expected = hmac.new(key, f"{purpose}.{body}".encode(), hashlib.sha256).digest()
        if not hmac.compare_digest(expected, given):
            raise Unauthorized("the link's signature is not valid")
        payload = json.loads(_unb64(body))
    except (ValueError, TypeError, UnicodeError):
        raise Unauthorized("the link's token is malformed") from None
    if not isinstance(payload, dict) or type(payload.get("exp")) is not int:
        raise Unauthorized("the link's token is malformed")
    if payload["exp"] < time.time():
        raise TokenExpired("this link has expired; the stage attempt it belonged to is over")
    for name, kind in CLAIMS.get(purpose, {}).items():
        value = payload.get(name)
        if type(value) is not kind or (kind is int and value < 0) or (kind is str and not value):
            raise Unauthorized(f"the link's token is malformed: it lacks a valid {name!r} field")
    return payload


def fingerprint(secret: str) -> str:
    """A short, one-way label for a token or secret, safe to log (to correlate, not to recover)."""
    return hashlib.sha256(secret.encode("utf-8", "surrogatepass")).hexdigest()[:12]


def redact_path(path: str) -> str:
    """``path`` fit for a log line: the token of a signed URL path is replaced by its fingerprint.

    ``/v1/callbacks/<token>`` becomes ``/v1/callbacks/<redacted:1a2b3c4d5e6f>``; other paths are unchanged.
    """
    for prefix in SIGNED_URL_PATHS:
        if path.startswith(prefix):
            return f"{prefix}<redacted:{fingerprint(path[len(prefix):])}>"
    return path


def tenant_for_token(tokens: dict[str, str], token: str) -> str | None:
    """The tenant a bearer token names in ``tokens`` (token -> tenant), None for an unknown one. Every
    known token is compared, each in constant time, so the time taken says nothing about which matched."""
    tenant = None
    for known, name in tokens.items():
        if hmac.compare_digest(known.encode(), token.strip().encode()):
            tenant = name
    return tenant
