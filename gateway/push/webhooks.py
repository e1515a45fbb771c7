"""Webhook deliverer: reads each job's event outbox and POSTs every event to the tenant's subscriptions.

Runs as a thread of the supervisor process (gateway/push/supervisor.py). Each pass reads the outbox of
every active job and of every retired job whose events may not all be delivered yet
(``keys.events_pending``), and feeds each subscription of the job's tenant in outbox order:

- **At least once.** A subscription's cursor for a job (``keys.sub_cursor``) moves past an event only
  after its URL answered 2xx (or the event was given up after ``RetryPolicy.give_up_after``). A
  deliverer killed between the answer and the cursor write sends that one event again, with the same
  ``webhook-id``; nothing is lost.
- **Ordered per job and subscription.** A failing delivery holds the later events of that job for that
  subscription until it succeeds or is given up; other jobs and subscriptions go on.
- **Backoff.** Failed attempts are retried after ``initial * coefficient^(attempt-1)`` capped at
  ``maximum_interval``; the retry state lives in Redis (``keys.sub_retry``), so a restart keeps it.
- **Signed** per Standard Webhooks: ``webhook-id``, ``webhook-timestamp`` (the attempt's, in seconds),
  ``webhook-signature: v1,<base64 HMAC-SHA256 of "id.timestamp.body">`` keyed with the subscription's
  secret. :func:`sign` reproduces the specification's published test vector (tests/test_webhooks.py).
- **Guarded.** Every POST goes through the outbound guard (gateway/net/outbound.py); redirects are not
  followed.

Several deliverers (one per supervisor) may send the same event twice; receivers dedupe on webhook-id.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

import requests

from gateway import metrics
from gateway.errors import BatchgateError
from gateway.ledger import archive
from gateway.ledger.decisions import links_for
from gateway.ledger.embedded import REDIS_DOWN
from gateway.ledger.events import SubscriptionStore, entry_key, entry_ms, event_id
from gateway.ledger.ledger import Ledger
from gateway.net.outbound import session_for

log = logging.getLogger(__name__)

TIMEOUT_S = 5.0  # one delivery attempt's connect + read timeout
PRUNE_S = 300.0  # how often the cursors of jobs retention removed are dropped
PRUNE_PAGE = 500  # gone jobs handled per prune round trip
ANSWER_KEPT = 200  # characters of a receiver's answer kept in the delivery record


def sign(secret: str, msg_id: str, timestamp_s: int, body: bytes) -> str:
    """The ``webhook-signature`` value for one message (Standard Webhooks, scheme v1)."""
    key = base64.b64decode(secret.removeprefix("whsec_"))
    mac = hmac.new(key, f"{msg_id}.{timestamp_s}.".encode() + body, hashlib.sha256).digest()
    return "v1," + base64.b64encode(mac).decode()


def verify(secret: str, headers: Any, body: bytes, tolerance_s: int = 300) -> bool:
    """Whether ``headers`` carry a valid, fresh signature of ``body`` (what a receiver checks)."""
    msg_id, ts = headers.get("webhook-id", ""), headers.get("webhook-timestamp", "")
    if not msg_id or not ts.isdigit() or abs(time.time() - int(ts)) > tolerance_s:
        return False
    expected = sign(secret, msg_id, int(ts), body).encode()
    return any(hmac.compare_digest(expected, s.encode())
               for s in headers.get("webhook-signature", "").split(" "))


@dataclass(frozen=True)
class RetryPolicy:
    """How failed deliveries are retried."""

    initial_interval: timedelta = timedelta(seconds=1)
    backoff_coefficient: float = 2.0
    maximum_interval: timedelta = timedelta(minutes=30)
    give_up_after: timedelta = timedelta(hours=24)

    def delay_ms(self, attempt: int) -> int:
        delay = self.initial_interval.total_seconds() * self.backoff_coefficient ** (attempt - 1)
        return int(min(delay, self.maximum_interval.total_seconds()) * 1000)


class Deliverer:
    """Delivers outbox events to subscriptions; ``run`` loops until ``stop`` is set."""

    def __init__(self, ledger: Ledger, retry: RetryPolicy | None = None,
                 interval: timedelta = timedelta(milliseconds=500)) -> None:
        self.ledger = ledger
        self.r = ledger.r
        self.keys = ledger.keys
        self.store = SubscriptionStore(ledger.r, ledger.keys)
        self.retry = retry or RetryPolicy()
        self.interval = interval
        self.session = session_for(ledger.settings)
        self.stop = threading.Event()
        self._pruned_at = 0.0  # monotonic time of the last prune

    def run(self) -> None:
        down = False
        while not self.stop.is_set():
            try:
                self.tick()
                if down:
                    log.warning("webhooks: ledger redis reachable again; delivering")
                down = False
            except REDIS_DOWN as exc:  # waited for, like the supervisor
                if not down:
                    log.warning("webhooks: ledger redis unavailable (%s); deliveries wait for it",
                                type(exc).__name__)
                down = True
            except Exception:  # noqa: BLE001 - a surprise: log it, deliver again next pass
                log.exception("webhooks: a delivery pass failed; trying again")
            self.stop.wait(self.interval.total_seconds())

    def tick(self) -> None:
        """One pass over every job that may have undelivered events."""
        active = self.r.smembers(self.keys.active)
        subs: dict[str, list[dict[str, str]]] = {}  # tenant -> subscriptions, read once a pass
        for job_id in sorted(active | self.r.smembers(self.keys.events_pending)):
            if self.stop.is_set():
                return
            try:
                done = self._job(job_id, subs)
            except BatchgateError as exc:  # e.g. the job is gone: nothing left to deliver
                log.warning("webhooks: job_id=%s skipped: %s", job_id, exc.detail)
                done = True
            if done and job_id not in active:
                self.r.srem(self.keys.events_pending, job_id)
                self._fold_outbox(job_id)
        if time.monotonic() - self._pruned_at >= PRUNE_S:
            self.prune()
            self._pruned_at = time.monotonic()

    def prune(self, now_ms: int | None = None) -> int:
        """Drop the subscription cursors and retry states of jobs retention has removed (the supervisor
        files each retired job in ``events_gone`` with when its keys expire): they are one hash field per
        job and subscription, read by nothing once the job is gone. A job resumed meanwhile still has
        its record: its entry goes, and its next retirement files it again. Returns the jobs pruned."""
        now_ms = int(time.time() * 1000) if now_ms is None else now_ms
        pruned = 0
        while due := self.r.zrangebyscore(self.keys.events_gone, "-inf", now_ms, start=0, num=PRUNE_PAGE):
            pipe = self.r.pipeline(transaction=False)
            for member in due:
                pipe.exists(self.keys.job(member.split(" ", 1)[0]).job)
            alive = pipe.execute()
            subs: dict[str, list[dict[str, str]]] = {}
            pipe = self.r.pipeline(transaction=False)
            for member, exists in zip(due, alive, strict=True):
                job_id, _, tenant = member.partition(" ")
                if not exists:
                    if tenant not in subs:
                        subs[tenant] = self.store.for_tenant(tenant)
                    for sub in subs[tenant]:
                        pipe.hdel(self.keys.sub_cursor(sub["id"]), job_id)
                        pipe.hdel(self.keys.sub_retry(sub["id"]), job_id)
                    pruned += 1
                pipe.zrem(self.keys.events_gone, member)
            pipe.execute()
        if pruned:
            log.info("webhooks: dropped the subscription cursors of %d job(s) retention removed", pruned)
        return pruned

    def _fold_outbox(self, job_id: str) -> None:
        """A job at rest folded while a subscriber had not had its events yet kept its outbox as a
        stream (archive.py); once every subscription has had them, it folds too."""
        k = self.keys.job(job_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.exists(k.past)
        pipe.exists(k.events)
        if all(pipe.execute()):
            archive.fold(self.ledger, job_id, self.ledger.settings.log_at_rest)

    def _job(self, job_id: str, subs: dict[str, list[dict[str, str]]]) -> bool:
        """Feed the job's events to its tenant's subscriptions; True when every one is handled."""
        tenant = self.ledger.spec(job_id).tenant
        if tenant not in subs:
            subs[tenant] = self.store.for_tenant(tenant)
        if not subs[tenant]:
            return True  # nobody listens (a subscription made later hears only of later events)
        entries = self.r.xrange(self.keys.job(job_id).events)
        done = True
        for sub in subs[tenant]:
            done = self._feed(sub, job_id, entries) and done
        return done

    def _feed(self, sub: dict[str, str], job_id: str, entries: list) -> bool:
        cursor_key = self.keys.sub_cursor(sub["id"])
        cursor = self.r.hget(cursor_key, job_id)
        wanted = set(sub["events"].split(","))
        for entry_id, fields in entries:
            if cursor and entry_key(entry_id) <= entry_key(cursor):
                continue
            relevant = fields.get("type") in wanted and entry_ms(entry_id) >= int(sub["created_ms"])
            if relevant and not self._deliver(sub, job_id, entry_id, fields):
                return False
            self.r.hset(cursor_key, job_id, entry_id)
            cursor = entry_id
        return True

    def _deliver(self, sub: dict[str, str], job_id: str, entry_id: str, fields: dict[str, str]) -> bool:
        """One attempt at one event if it is due; True once it is handled (delivered or given up)."""
        retry_key = self.keys.sub_retry(sub["id"])
        now = int(time.time() * 1000)
        state = json.loads(self.r.hget(retry_key, job_id) or "null")
        if state is None or state["entry"] != entry_id:
            state = {"entry": entry_id, "attempt": 0, "next_ms": now, "first_ms": now}
        if state["next_ms"] > now:
            return False
        state["attempt"] += 1
        msg_id = event_id(job_id, entry_id)
        status, answer = self._post(sub, msg_id, self._body(job_id, fields))
        ok = status is not None and 200 <= status < 300
        gave_up = not ok and now - state["first_ms"] >= self.retry.give_up_after.total_seconds() * 1000
        metrics.WEBHOOK_DELIVERIES.labels("delivered" if ok else "gave_up" if gave_up
                                          else "unreachable" if status is None else "refused").inc()
        self.store.record_delivery(sub["id"], {
            "event_id": msg_id, "type": fields.get("type"), "job_id": job_id, "attempt": state["attempt"],
            "at_ms": now, "status": status, "answer": answer, "ok": ok, "gave_up": gave_up})
        log.info("webhook delivery sub=%s event=%s attempt=%d status=%s", sub["id"], msg_id,
                 state["attempt"], status)
        if ok or gave_up:
            self.r.hdel(retry_key, job_id)
            return True
        state["next_ms"] = now + self.retry.delay_ms(state["attempt"])
        self.r.hset(retry_key, job_id, json.dumps(state))
        return False

    def _body(self, job_id: str, fields: dict[str, str]) -> bytes:
        at_ms = int(fields.get("at_ms") or 0)
        tenant = self.ledger.spec(job_id).tenant
        if "data" in fields:  # batch.* and approval.* events carry their payload as JSON (lib.lua emit)
            data = {"job_id": job_id, "tenant": tenant, **json.loads(fields["data"])}
            if fields.get("type") == "approval.requested":
                data.update(links_for(self.ledger, data, self.ledger.settings))
        else:
            data = {"job_id": job_id, "tenant": tenant,
                    "status": fields.get("status"), "from": fields.get("from"),
                    "n_done": int(fields.get("n_done") or 0),
                    "n_failed": int(fields.get("n_failed") or 0),
                    "items_done": int(fields.get("items_done") or 0)}
            if fields.get("error"):
                data["error"] = fields["error"]
        stamp = datetime.fromtimestamp(at_ms / 1000, UTC).isoformat().replace("+00:00", "Z")
        return json.dumps({"type": fields.get("type"), "timestamp": stamp, "data": data}).encode()

    def _post(self, sub: dict[str, str], msg_id: str, body: bytes) -> tuple[int | None, str]:
        ts = int(time.time())
        headers = {"content-type": "application/json", "webhook-id": msg_id,
                   "webhook-timestamp": str(ts), "webhook-signature": sign(sub["secret"], msg_id, ts, body)}
        try:
            resp = self.session.post(sub["url"], data=body, headers=headers, timeout=TIMEOUT_S,
                                     allow_redirects=False)
        except requests.RequestException as exc:
            return None, f"{type(exc).__name__}"
        return resp.status_code, resp.text[:ANSWER_KEPT]
