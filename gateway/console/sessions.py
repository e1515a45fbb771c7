"""Console sessions: server-side in Redis, a random id in an HttpOnly cookie, a CSRF token per session.

A person signs in with a tenant's bearer token (the same tokens ``Authorization: Bearer`` takes). The
token is checked once and then forgotten: the session keeps the tenant, a CSRF token and a SHA-256
digest of the token, so that removing the token from ``BATCHGATE_TOKENS`` ends every session made
with it (each request checks the digest against the tokens configured now). The cookie holds only
the session id; Redis holds the session under the id's digest (a copy of the data names no usable
cookie). A session lasts ``SESSION_TTL`` from sign-in, then the person signs in again; signing out
deletes it.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import time
from dataclasses import dataclass
from datetime import timedelta

import redis

from gateway.ledger.keys import Keys
from gateway.ledger.multi import multi
from gateway.settings import Settings

SESSION_TTL = timedelta(hours=12)
COOKIE = "batchgate_console"
COOKIE_PATH = "/console"
#: A session id or CSRF token: 32 random bytes, URL-safe base64 (43 characters).
TOKEN_BYTES = 32


@dataclass(frozen=True)
class Session:
    """A signed-in console user: which tenant, and the CSRF token its forms carry."""

    session_id: str
    tenant: str
    csrf: str

    @property
    def actor(self) -> str:
        """Who the audit trail names for this session's actions."""
        return f"tenant:{self.tenant} (console)"

    def csrf_ok(self, sent: str | None) -> bool:
        """Whether a form's CSRF token is this session's (constant-time)."""
        return bool(sent) and hmac.compare_digest(sent.encode(), self.csrf.encode())


def token_digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


class SessionStore:
    """Console sessions in Redis: one hash per session, expiring ``SESSION_TTL`` after sign-in."""

    def __init__(self, client: redis.Redis, keys: Keys, settings: Settings) -> None:
        self.r = client
        self.keys = keys
        self.settings = settings

    def create(self, tenant: str, token: str) -> Session:
        """A new session for ``tenant``, signed in with ``token`` (only its digest is kept)."""
        session = Session(secrets.token_urlsafe(TOKEN_BYTES), tenant, secrets.token_urlsafe(TOKEN_BYTES))
        key = self.keys.console_session(session.session_id)
        pipe = multi(self.r)
        pipe.hset(key, mapping={"tenant": tenant, "csrf": session.csrf, "token_sha256": token_digest(token),
                                "created_ms": int(time.time() * 1000)})
        pipe.expire(key, SESSION_TTL)
        pipe.execute()
        return session

    def get(self, session_id: str | None) -> Session | None:
        """The live session with this id; None if it is unknown, expired, or its token was revoked."""
        if not session_id or len(session_id) > 100:
            return None
        fields = self.r.hgetall(self.keys.console_session(session_id))
        if not fields.get("tenant") or not fields.get("csrf"):
            return None
        if not self._token_still_valid(fields["tenant"], fields.get("token_sha256", "")):
            self.delete(session_id)
            return None
        return Session(session_id, fields["tenant"], fields["csrf"])

    def delete(self, session_id: str) -> None:
        self.r.delete(self.keys.console_session(session_id))

    def _token_still_valid(self, tenant: str, digest: str) -> bool:
        """Whether a configured token of ``tenant`` still has this digest."""
        found = False
        for known, name in self.settings.token_map().items():
            if name == tenant and hmac.compare_digest(token_digest(known), digest):
                found = True
        return found
