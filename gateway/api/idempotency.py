"""Idempotency-Key for POST requests, after the IETF httpapi draft.

Same key and same body: the first response is replayed. Same key, other body: 422. First request still
in flight: 409. Records live ``idempotency_ttl`` (24 h by default); an in-flight claim lives a minute,
so a crashed request does not block its key for a day.
"""

from __future__ import annotations

import hashlib
import json
from datetime import timedelta
from typing import Any

import redis

from gateway.errors import IdempotencyInFlight, IdempotencyMismatch, InvalidRequest
from gateway.ledger.keys import Keys
from gateway.ledger.multi import multi

IN_FLIGHT_TTL = timedelta(minutes=1)


def fingerprint(method: str, path: str, body: bytes) -> str:
    """What makes two requests 'the same' under one key."""
    return hashlib.sha256(method.encode() + b" " + path.encode() + b"\n" + body).hexdigest()


class IdempotencyStore:
    """Claims keys, stores first responses, replays them."""

    def __init__(self, client: redis.Redis, keys: Keys, ttl: timedelta) -> None:
        self._r = client
        self._keys = keys
        self._ttl = ttl

    def begin(self, tenant: str, key: str, fp: str) -> tuple[int, Any] | None:
        """Claim ``key``; returns the stored (status, body) to replay, or None to proceed."""
        if not 1 <= len(key) <= 255:
            raise InvalidRequest("Idempotency-Key must be 1 to 255 characters")
        rkey = self._keys.idempotency(tenant, key)
        in_flight_ms = int(IN_FLIGHT_TTL.total_seconds() * 1000)
        if self._r.set(self._keys.idempotency_claim(tenant, key), fp, nx=True, px=in_flight_ms):
            pipe = multi(self._r)
            pipe.hset(rkey, mapping={"fp": fp, "state": "in_flight"})
            pipe.pexpire(rkey, in_flight_ms)
            pipe.execute()
            return None
        record = self._r.hgetall(rkey)
        stored_fp = record.get("fp") or self._r.get(self._keys.idempotency_claim(tenant, key))
        if stored_fp != fp:
            raise IdempotencyMismatch("this Idempotency-Key was used with a different request body")
        if record.get("state") != "done":
            raise IdempotencyInFlight("a request with this Idempotency-Key is still in flight; "
                                      "retry later")
        return int(record["status"]), json.loads(record["body"])

    def finish(self, tenant: str, key: str, status: int, body: Any) -> None:
        """Store the response to replay for the key's lifetime."""
        rkey = self._keys.idempotency(tenant, key)
        ttl_ms = int(self._ttl.total_seconds() * 1000)
        pipe = multi(self._r)
        pipe.hset(rkey, mapping={"state": "done", "status": str(status), "body": json.dumps(body)})
        pipe.pexpire(rkey, ttl_ms)
        pipe.pexpire(self._keys.idempotency_claim(tenant, key), ttl_ms)
        pipe.execute()

    def abandon(self, tenant: str, key: str) -> None:
        """Release the key after a server-side failure so the client can retry."""
        self._r.delete(self._keys.idempotency(tenant, key), self._keys.idempotency_claim(tenant, key))
