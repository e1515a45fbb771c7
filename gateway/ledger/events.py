"""Job events and the webhook subscriptions that hear of them: what is stored, and how it is read.

An event is an entry of the job's outbox stream (``keys.JobKeys.events``), appended by the Lua script
whose write changes the job's status (lib.lua ``save``), so it exists exactly when that change
committed. Its id is ``<job_id>:<entry id>``: stable, and the same on every delivery attempt.

A subscription belongs to one tenant and names a URL, the event types it wants and a signing secret
(``whsec_`` + base64 of 32 random bytes, Standard Webhooks), shown once at creation. The deliverer
(gateway/push/webhooks.py) keeps its progress per subscription and job in Redis (``sub_cursor``), so a
restart neither loses events nor re-sends more than the one in flight.
"""

from __future__ import annotations

import base64
import json
import re
import secrets
import time
from typing import Any

import redis

from gateway.errors import InvalidRequest, NotFound
from gateway.ledger.keys import Keys
from gateway.ledger.multi import multi

#: Event types a subscription may ask for. Job events are appended by lib.lua ``save`` in whichever script
#: changes the job's status; the others by lib.lua ``emit`` in the script that makes the change:
#: ``batch.failed`` (fail_attempt: fail, expire, heartbeat past max_run, a rejection; a corrupt batch in
#: lease) with data {seq, stage, attempt, error, error_type, job_status}; ``approval.requested``
#: (complete, decide, open_approval) with {approval_id, seq, stage, stage_index, kind, deadline_ms,
#: on_timeout, approvers, prompt}, to which the deliverer adds ``deadline`` and signed ``links``
#: [{approver, url}]; ``approval.decided`` (decide) with {approval_id, seq, stage, stage_index, kind,
#: decision, status, actor, comment, edited, timed_out, job_status}; ``items.quarantined`` (fail, when a
#: bisecting stage sets items aside) with {seq, stage, attempt, items (their indices in the batch), error,
#: error_type, job_status}. Every payload also has job_id and tenant.
EVENT_TYPES = ("job.succeeded", "job.failed", "job.cancelled", "job.paused", "batch.failed",
               "items.quarantined", "approval.requested", "approval.decided")
DELIVERIES_KEPT = 100  # newest delivery attempts kept per subscription
MAX_SUBSCRIPTIONS = 50  # per tenant
SECRET_PREFIX = "whsec_"
SUB_ID = re.compile(r"sub_[0-9a-f]{16}")  # what create makes; nothing else names a key


def new_secret() -> str:
    """A fresh signing secret in the Standard Webhooks form."""
    return SECRET_PREFIX + base64.b64encode(secrets.token_bytes(32)).decode()


def event_id(job_id: str, entry_id: str) -> str:
    return f"{job_id}:{entry_id}"


def entry_key(entry_id: str) -> tuple[int, int]:
    """A stream entry id as (ms, sequence), for comparing ids in the order Redis gives them."""
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)


def entry_ms(entry_id: str) -> int:
    """When an outbox entry was appended (the ms part of its stream id)."""
    return int(entry_id.split("-", 1)[0])


class SubscriptionStore:
    """Tenant-scoped subscriptions and their delivery records in Redis."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.r = client
        self.keys = keys

    def create(self, tenant: str, url: str, events: list[str]) -> dict[str, Any]:
        """Store a subscription; returns its view with the secret (the only time it is shown)."""
        unknown = sorted(set(events) - set(EVENT_TYPES))
        if not events or unknown:
            raise InvalidRequest(f"events must be a non-empty list of {', '.join(EVENT_TYPES)}"
                                 + (f" (unknown: {', '.join(unknown)[:200]})" if unknown else ""))
        if self.r.scard(self.keys.subscriptions(tenant)) >= MAX_SUBSCRIPTIONS:
            raise InvalidRequest(f"at most {MAX_SUBSCRIPTIONS} subscriptions per tenant")
        sub_id = "sub_" + secrets.token_hex(8)
        record = {"id": sub_id, "tenant": tenant, "url": url, "events": ",".join(sorted(set(events))),
                  "secret": new_secret(), "created_ms": str(int(time.time() * 1000))}
        pipe = multi(self.r)
        pipe.hset(self.keys.subscription(sub_id), mapping=record)
        pipe.sadd(self.keys.subscriptions(tenant), sub_id)
        pipe.execute()
        return {**self.view(record), "secret": record["secret"]}

    def record(self, sub_id: str) -> dict[str, str] | None:
        """The stored record, secret included (for the deliverer), or None."""
        return self.r.hgetall(self.keys.subscription(sub_id)) or None

    def owned(self, tenant: str, sub_id: str) -> dict[str, str]:
        record = self.record(sub_id) if SUB_ID.fullmatch(sub_id) else None
        if record is None or record.get("tenant") != tenant:
            raise NotFound(f"no subscription {sub_id[:100]!r}")
        return record

    def for_tenant(self, tenant: str) -> list[dict[str, str]]:
        ids = sorted(self.r.smembers(self.keys.subscriptions(tenant)))
        records = [self.record(i) for i in ids]
        return [r for r in records if r]

    def delete(self, tenant: str, sub_id: str) -> None:
        self.owned(tenant, sub_id)
        pipe = multi(self.r)
        pipe.srem(self.keys.subscriptions(tenant), sub_id)
        pipe.delete(self.keys.subscription(sub_id), self.keys.sub_cursor(sub_id),
                    self.keys.sub_retry(sub_id), self.keys.sub_deliveries(sub_id))
        pipe.execute()

    def deliveries(self, tenant: str, sub_id: str, limit: int) -> list[dict[str, Any]]:
        """The newest delivery attempts first, at most ``limit``."""
        self.owned(tenant, sub_id)
        raw = self.r.lrange(self.keys.sub_deliveries(sub_id), 0, max(limit, 1) - 1)
        return [json.loads(x) for x in raw]

    def record_delivery(self, sub_id: str, attempt: dict[str, Any]) -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.keys.sub_deliveries(sub_id), json.dumps(attempt))
        pipe.ltrim(self.keys.sub_deliveries(sub_id), 0, DELIVERIES_KEPT - 1)
        pipe.execute()

    @staticmethod
    def view(record: dict[str, str]) -> dict[str, Any]:
        """The public view: no secret."""
        return {"id": record["id"], "url": record["url"], "events": record["events"].split(","),
                "created_ms": int(record["created_ms"])}
