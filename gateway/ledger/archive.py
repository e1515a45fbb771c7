"""A job at rest in one value: its spec and its streams folded into ``<p>:{<job>}:past``.

A job with a sink whose every committed batch is delivered holds, at rest, its job record, its sink
hash (cursor and range summaries), its cost ledger, its spec and three streams (execution log, audit,
event outbox). Each stream costs ~0.8 KB however few its entries (Redis's stream and listpack overhead),
the spec 0.7 KB: 4.3 KB in all. ``fold`` writes the spec and the streams' entries as one zlib-compressed
JSON string and removes them (archive.lua, compare-and-set on what was read): about 1.6 KB a job.

Readers: ``spec_fields`` (Ledger.spec, the job listing, the job index) takes the spec hash when there is
one, else the past's; ``entries`` (the log and audit of the API, the console and the supervisor) gives
the past's entries first, then the stream's. Writers need nothing: scripts append to the streams, which
start afresh after a resume; a migration writes the spec hash again (``restore_spec`` first: migrate.lua
checks the spec it replaces), and a hash, once there, is read before the past's. Folding the job again
(it came to rest again) keeps the past's entries and adds the new. The event outbox is folded only when
every subscription of the tenant has had the job's events (its cursor is past the last): the webhook
deliverer reads the stream, never the past. docs/design.md "A job at rest".
"""

from __future__ import annotations

import json
import zlib
from hashlib import sha1
from typing import Any

import redis

from gateway.ledger.due import TERMINAL
from gateway.ledger.events import SubscriptionStore, entry_key
from gateway.ledger.keys import JobKeys

STREAMS = ("log", "audit", "events")
Entry = tuple[str, dict[str, str]]


def decode(raw: str | bytes | None) -> dict[str, Any] | None:
    """The past's content: {"spec": fields, "log": [[id, fields], ...], "audit": [...], "events": [...]}."""
    if raw is None:
        return None
    return json.loads(zlib.decompress(_bytes(raw)))


def _bytes(raw: str | bytes) -> bytes:
    """The value's bytes: the ledger's client decodes replies as UTF-8 with surrogateescape
    (embedded.client_for), which gives any byte string back unchanged when encoded the same way."""
    return raw.encode("utf-8", "surrogateescape") if isinstance(raw, str) else raw


def encode(content: dict[str, Any]) -> bytes:
    """zlib'd compact JSON."""
    text = json.dumps(content, separators=(",", ":"), ensure_ascii=False)
    return zlib.compress(text.encode("utf-8", "surrogateescape"), 9)


def past(r: redis.Redis, k: JobKeys) -> dict[str, Any] | None:
    return decode(r.get(k.past))


def spec_fields(r: redis.Redis, k: JobKeys, fields: dict[str, str] | None = None) -> dict[str, str]:
    """The spec's fields: its hash (``fields``, if the caller read it already), else the past's; {} when
    neither is there (the job does not exist)."""
    if fields is None:
        fields = r.hgetall(k.spec)
    if fields:
        return fields
    folded = past(r, k)
    return dict(folded["spec"]) if folded and folded.get("spec") else {}


def _in_range(entry_id: str, start: str, end: str) -> bool:
    """XRANGE's range rules for ids: '-' and '+' open, '(' exclusive, else inclusive."""
    key = entry_key(entry_id)
    if start != "-":
        low = entry_key(start.lstrip("("))
        if key < low or (start.startswith("(") and key == low):
            return False
    if end != "+":
        high = entry_key(end.lstrip("("))
        if key > high or (end.startswith("(") and key == high):
            return False
    return True


def entries(r: redis.Redis, k: JobKeys, kind: str, start: str = "-", end: str = "+", count: int | None = None,
            reverse: bool = False) -> list[Entry]:
    """A job's ``kind`` stream entries (log, audit) between ``start`` and ``end`` (XRANGE's id rules;
    for ``reverse`` as XREVRANGE: ``start`` the newest), at most ``count``, oldest first (newest first
    when ``reverse``): the past's, then the stream's. Raises redis.ResponseError for a malformed id."""
    key = getattr(k, kind)
    pipe = r.pipeline(transaction=False)
    if reverse:
        pipe.xrevrange(key, start, end, count=count)
    else:
        pipe.xrange(key, start, end, count=count)
    pipe.get(k.past)
    live, raw = pipe.execute()
    folded = decode(raw)
    if not folded:
        return live
    low, high = (end, start) if reverse else (start, end)
    old = [(i, f) for i, f in folded.get(kind, []) if _in_range(i, low, high)]
    newest = {i for i, _ in live}
    merged = sorted([*(e for e in old if e[0] not in newest), *live], key=lambda e: entry_key(e[0]),
                    reverse=reverse)
    return merged[:count] if count is not None else merged


def restore_spec(r: redis.Redis, k: JobKeys) -> None:
    """Write the past's spec back to the spec hash if the hash is absent (a migration checks and
    replaces it). The past keeps its copy; a hash is always read first."""
    if r.exists(k.spec):
        return
    folded = past(r, k)
    if folded and folded.get("spec"):
        r.hset(k.spec, mapping=folded["spec"])  # two restoring at once write the same fields


def _events_heard(ledger: Any, job_id: str, last: str | None) -> bool:
    """True when every subscription of the job's tenant has had (or passed over) its last event: the
    webhook deliverer's cursor for the job is at or past it (a subscription made later hears only of
    later events). Then the outbox may fold; else it stays a stream for the deliverer."""
    if last is None:
        return True
    subs = SubscriptionStore(ledger.r, ledger.keys).for_tenant(ledger.spec(job_id).tenant)
    if not subs:
        return True
    pipe = ledger.r.pipeline(transaction=False)
    for sub in subs:
        pipe.hget(ledger.keys.sub_cursor(sub["id"]), job_id)
    return all(cursor and entry_key(cursor) >= entry_key(last) for cursor in pipe.execute())


def fold(ledger: Any, job_id: str, log_kept: int) -> list[str]:
    """Fold a job at rest into its past (archive.lua's answer: ['ok'], ['live', status] or ['raced']).
    ``ledger`` is the Ledger; the log keeps its newest ``log_kept`` entries, past and new together."""
    r, keys = ledger.r, ledger.keys
    k = keys.job(job_id)
    pipe = r.pipeline(transaction=False)
    pipe.hmget(k.job, "status", "checksum")
    pipe.hgetall(k.spec)
    for kind in STREAMS:
        pipe.xrange(getattr(k, kind))
    pipe.get(k.past)
    (status, checksum), spec, log, audit, events, raw = pipe.execute()
    if status not in TERMINAL:
        return ["live", status or "missing"]
    with_events = _events_heard(ledger, job_id, events[-1][0] if events else None)
    old = decode(raw) or {}
    content = {"v": 1, "spec": spec or old.get("spec") or {}}
    for kind, got in zip(STREAMS, (log, audit, events), strict=True):
        kept = list(old.get(kind, []))
        if kind != "events" or with_events:
            seen = {i for i, _ in kept}
            kept += [(i, f) for i, f in got if i not in seen]
        if kind == "log":
            kept = kept[-log_kept:] if log_kept else []
        content[kind] = kept
    value = encode(content)
    last = [got[-1][0] if got else "" for got in (log, audit, events)]
    return ledger.scripts.archive(
        keys=[k.job, k.spec, k.log, k.audit, k.events, k.past],
        args=[checksum or "", *last, sha1(_bytes(raw)).hexdigest() if raw else "",
              spec.get("checksum", "") if spec else "", value, "1" if with_events else "0"])
