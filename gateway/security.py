"""Signed, expiring tokens for the URLs batchgate hands to platforms (callbacks, blobs)."""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

from gateway.errors import FatalError, Unauthorized


class TokenExpired(FatalError):
    """The signed URL's token is genuine but past its expiry."""

    status = 410
    title = "Link expired"
    type_slug = "link-expired"


def _b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def _unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(payload: dict[str, Any], key: bytes, purpose: str, ttl_s: float) -> str:
    """``<payload>.<mac>``: the payload (with an expiry) in base64url, HMAC-SHA256 bound to ``purpose``."""
    body = _b64(json.dumps({**payload, "exp": int(time.time() + ttl_s)}, separators=(",", ":")).encode())
    mac = hmac.new(key, f"{purpose}.{body}".encode(), hashlib.sha256).digest()
    return f"{body}.{_b64(mac)}"


def verify(token: str, key: bytes, purpose: str) -> dict[str, Any]:
    """The payload of a genuine, unexpired token; 401 if forged or malformed, 410 if expired."""
    body, _, mac = token.partition(".")
    try:
        expected = hmac.new(key, f"{purpose}.{body}".encode(), hashlib.sha256).digest()
        if not mac or not hmac.compare_digest(expected, _unb64(mac)):
            raise Unauthorized("the link's signature is not valid")
        payload = json.loads(_unb64(body))
    except (ValueError, TypeError):
        raise Unauthorized("the link's token is malformed") from None
    if not isinstance(payload, dict) or not isinstance(payload.get("exp"), int):
        raise Unauthorized("the link's token is malformed")
    if payload["exp"] < time.time():
        raise TokenExpired("this link has expired; the stage attempt it belonged to is over")
    return payload
