"""Listing a tenant's jobs from the job index (jobindex.py): filters, order, opaque cursor, verify on read.

``GET /v1/jobs`` filters by status, flow (and version) and creation time, combined. Each combination of
status and flow is one index set, so a page is one ZRANGEBYLEX whatever the filter: the time window
and the cursor are lex bounds on members ``<created ms>:<job id>``. Time bounds are a half-open window,
``created_after`` <= created < ``created_before``, each in epoch milliseconds or ISO 8601 (a time
without a zone is UTC).

The cursor is opaque to clients: base64url of the last member returned and a fingerprint of the
filters, so a cursor used with other filters is refused (422) rather than read in the wrong set.

Every job a page returns is read from its record (one pipelined MULTI per page, which also builds the
views): one whose record is gone (retention) leaves the index, the roster and the quota's active set;
one that no longer matches the filter, or whose filed place differs from its record, is filed again
and skipped. So a listing is correct even when an index update was lost, and it repairs what it reads.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from gateway.errors import CorruptRecord, InvalidRequest, NotFound
from gateway.ledger import archive
from gateway.ledger.flows import NAME
from gateway.ledger.jobindex import STATUSES, Filed, job_of, member
from gateway.ledger.multi import multi
from gateway.validation import problem_errors

MAX_ROUNDS = 20  # index reads per request while entries turn out stale; then the page ends early
_MEMBER = re.compile(r"[0-9]{13}:job_[A-Za-z0-9_-]{1,60}")
MS_MAX = 10**13 - 1  # 13 digits: the index member's time field (until the year 2286)
#: created_after / created_before: epoch milliseconds, or an ISO 8601 date or date-time (openapi.py)
TIME = (r"^([0-9]{1,13}|[0-9]{4}-[0-9]{2}-[0-9]{2}(T[0-9]{2}:[0-9]{2}(:[0-9]{2}(\.[0-9]{1,6})?)?"
        r"(Z|[+-][0-9]{2}:[0-9]{2})?)?)$")
CURSOR = r"^[A-Za-z0-9_-]{1,400}$"
_TIME = re.compile(TIME)


def _epoch_ms(value: Any) -> int | None:
    """Milliseconds since the epoch from an integer (string) or an ISO 8601 time (UTC if no zone)."""
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        ms = value
    elif not isinstance(value, str) or not _TIME.fullmatch(value):
        raise ValueError("must be epoch milliseconds or an ISO 8601 time such as 2026-01-31T12:00:00Z")
    elif value.isdigit():
        ms = int(value)
    else:
        try:
            when = datetime.fromisoformat(value)
        except ValueError:
            raise ValueError("is not a real date and time") from None
        if when.tzinfo is None:
            when = when.replace(tzinfo=timezone.utc)
        ms = int(when.timestamp() * 1000)
    if not 0 <= ms <= MS_MAX:
        raise ValueError("is out of range (1970 to 2286)")
    return ms


class ListQuery(BaseModel):
    """Query of ``GET /v1/jobs``."""

    model_config = ConfigDict(extra="ignore")

    status: str | None = None
    flow_id: str | None = Field(default=None, pattern=NAME)
    flow_version: str | None = Field(default=None, pattern=NAME)
    created_after: int | None = Field(default=None, description="at or after (ms or ISO 8601)")
    created_before: int | None = Field(default=None, description="before (ms or ISO 8601)")
    order: Literal["newest", "oldest"] = "newest"
    cursor: str | None = Field(default=None, pattern=CURSOR)
    limit: int = Field(default=100, ge=1, le=1000)

    @field_validator("status")
    @classmethod
    def _status(cls, value: str | None) -> str | None:
        if value is not None and value not in STATUSES:
            raise ValueError(f"status must be one of {', '.join(STATUSES)}")
        return value

    @field_validator("created_after", "created_before", mode="before")
    @classmethod
    def _time(cls, value: Any) -> int | None:
        return _epoch_ms(value)

    @model_validator(mode="after")
    def _together(self) -> ListQuery:
        if self.flow_version is not None and self.flow_id is None:
            raise ValueError("flow_version needs flow_id")
        if None not in (self.created_after, self.created_before) and self.created_after >= self.created_before:
            raise ValueError("created_after must be before created_before")
        return self

    def fingerprint(self) -> str:
        """What a cursor is bound to: every filter and the order (not the limit)."""
        parts = (self.status, self.flow_id, self.flow_version, self.created_after, self.created_before,
                 self.order)
        return hashlib.sha256(repr(parts).encode()).hexdigest()[:12]

    def link_params(self) -> dict[str, str]:
        """The query of this listing as given (for the ``next`` link), cursor aside."""
        out = {name: str(getattr(self, name)) for name in
               ("status", "flow_id", "flow_version", "created_after", "created_before")
               if getattr(self, name) is not None}
        if self.order != "newest":
            out["order"] = self.order
        return out | {"limit": str(self.limit)}


def parse_query(args: dict[str, Any]) -> ListQuery:
    """The listing query, or a 422 problem naming each bad parameter (never echoing values)."""
    try:
        return ListQuery.model_validate(args)
    except ValidationError as exc:
        errors = problem_errors(exc)
        raise InvalidRequest("; ".join(f"{e['field']}: {e['message']}" if e["field"] != "(body)"
                                       else e["message"] for e in errors), errors=errors) from exc


def encode_cursor(entry: str, query: ListQuery) -> str:
    raw = f"{query.fingerprint()}.{entry}".encode()
    return base64.urlsafe_b64encode(raw).decode().rstrip("=")


def decode_cursor(cursor: str, query: ListQuery) -> str:
    """The index member a cursor points after; InvalidRequest if it is not one of ours or was made
    for other filters."""
    try:
        raw = base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)).decode()
    except (binascii.Error, ValueError, UnicodeDecodeError):
        raise InvalidRequest("cursor is not a cursor this listing returned") from None
    fingerprint, _, entry = raw.partition(".")
    if not _MEMBER.fullmatch(entry):
        raise InvalidRequest("cursor is not a cursor this listing returned")
    if fingerprint != query.fingerprint():
        raise InvalidRequest("cursor was returned for other filters or another order; list again "
                             "with the same filters, or without a cursor")
    return entry


@dataclass
class Page:
    """One page: the job views, and the cursor of the next page (None at the end)."""

    jobs: list[dict[str, Any]]
    next_cursor: str | None


def list_jobs(service: Any, tenant: str, query: ListQuery) -> Page:
    """One page of ``tenant``'s jobs (JobService: ledger, index, views)."""
    ledger = service.ledger
    index = ledger.index
    key = ledger.keys.job_index(tenant, query.status, query.flow_id, query.flow_version)
    newest = query.order == "newest"
    lo = f"[{query.created_after:013d}" if query.created_after is not None else "-"
    hi = f"({query.created_before:013d}" if query.created_before is not None else "+"
    if query.cursor is not None:
        entry = decode_cursor(query.cursor, query)
        hi, lo = (f"({entry}", lo) if newest else (hi, f"({entry}")
    out: list[dict[str, Any]] = []
    last: str | None = None
    more = False
    for _ in range(MAX_ROUNDS):
        want = query.limit - len(out) + 1  # one more: is there a next page?
        entries = index.range(key, lo, hi, newest, want)
        for entry, view in zip(entries, _verified(service, tenant, key, query, entries)):
            if len(out) == query.limit:
                more = True
                break
            last = entry
            if view is not None:
                out.append(view)
        if more or len(entries) < want or not entries:
            break
        hi, lo = (f"({last}", lo) if newest else (hi, f"({last}")
    else:
        more = True  # many stale entries in a row (repaired as read): the next page goes on
    return Page(out, encode_cursor(last, query) if more and last else None)


def _verified(service: Any, tenant: str, key: str, query: ListQuery,
              entries: list[str]) -> list[dict[str, Any] | None]:
    """Each entry's view if its record still matches the filter; None for the others, which are
    dropped (record gone) or filed again (moved)."""
    ledger = service.ledger
    ids = [job_of(e) for e in entries]
    pipe = multi(ledger.r)  # one instant: a view never shows a lease its counts lack
    meta = ledger.keys.job_index_meta(tenant)
    cached = {job_id: ledger.fresh_spec(job_id) for job_id in ids}
    for job_id in ids:
        k = ledger.keys.job(job_id)
        pipe.hgetall(k.job)
        pipe.zcard(k.leases)
        pipe.hget(meta, job_id)
        if cached[job_id] is None:  # specs this process has not seen lately: read in the same trip
            pipe.hgetall(k.spec)
    replies = iter(pipe.execute())
    views: list[dict[str, Any] | None] = []
    gone: list[tuple[str, str, str]] = []
    for entry, job_id in zip(entries, ids):
        job, leased, filed = next(replies), next(replies), next(replies)
        spec_fields = next(replies) if cached[job_id] is None else None
        if not job:
            gone.append((job_id, filed, entry))
            views.append(None)
            continue
        try:
            spec = cached[job_id] or ledger.spec_from(
                job_id, archive.spec_fields(ledger.r, ledger.keys.job(job_id), spec_fields))
        except NotFound:
            gone.append((job_id, filed, entry))
            views.append(None)
            continue
        except CorruptRecord:
            views.append(None)
            continue
        truth = Filed(job["status"], spec.flow.id, spec.flow.version, int(job.get("created_ms") or 0))
        matches = (spec.tenant == tenant and query.status in (None, truth.status)
                   and query.flow_id in (None, truth.flow_id)
                   and query.flow_version in (None, truth.flow_version)
                   and entry == member(truth.created_ms, job_id))
        if spec.tenant == tenant and (not matches or filed != truth.encode()):
            ledger.index.refile(tenant, job_id, truth, Filed.decode(filed), stray=key if not matches else None)
        views.append(service.render(spec, job_id, ledger.checked(job_id, job), int(leased))
                     if matches else None)
    if gone:
        _drop(ledger, tenant, key, gone)
    return views


def _drop(ledger: Any, tenant: str, key: str, gone: list[tuple[str, str, str]]) -> None:
    """Jobs whose retention ran out leave the index, the roster and the quota's active set."""
    pipe = multi(ledger.r)
    for job_id, filed, entry in gone:
        pipe.zrem(key, entry)
        old = Filed.decode(filed)
        ledger.index.unfile(pipe, tenant, job_id, old, old.created_ms if old else int(entry[:13]))
    ids = [job_id for job_id, _, _ in gone]
    pipe.zrem(ledger.keys.jobs(tenant), *ids)
    pipe.srem(ledger.keys.quota_active(tenant), *ids)
    pipe.execute()
