"""Job routes: create (idempotent), list, show, batches, log, pause/resume/cancel/retry-failed,
quarantined items (list, retry)."""

from __future__ import annotations

import re
from datetime import datetime, timezone
from urllib.parse import urlencode

import redis
from flask import Blueprint, g, jsonify, request
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.common import Services, app_service, idempotent, json_body, query_int, request_services
from gateway.api.spool import REDIS_DOWN
from gateway.errors import InvalidRequest
from gateway.ledger import archive
from gateway.ledger.joblist import parse_query
from gateway.ledger.jobs import JobRequest, MigrateRequest, ResumeRequest, new_job_id
from gateway.ledger.migrate import settle
from gateway.ledger.quotas import Quotas
from gateway.ledger.records import typed_entry
from gateway.push.dispatch import target_id
from gateway.validation import parse

bp = Blueprint("jobs", __name__, url_prefix="/v1/jobs")
#: A log entry id XRANGE takes (openapi.LOG_ID states the same): every match is below 2^64 - 1.
LOG_ID = r"-|[0-9]{1,19}(-[0-9]{1,19})?"


def request_quotas() -> Quotas:
    """The app's per-tenant quotas (made on first use, one per app)."""
    return app_service("batchgate.quotas", lambda s: Quotas(s.redis, s.ledger.keys, s.settings))


@bp.post("")
def create():
    """A dry run (``"dry_run": true``) answers the plan (200) and writes nothing: no job, no quota slot,
    no idempotency record; otherwise the job is created (create_job)."""
    body = json_body()
    if body.get("dry_run") is True:
        req = parse(JobRequest, body, "job request")
        return request_services().jobs.plan(g.tenant, req, target_id), 200
    return create_job()


@idempotent
def create_job():
    """429 (nothing written) past the tenant's active-jobs or creation-rate quota; else 201."""
    req = parse(JobRequest, json_body(), "job request")
    services = request_services()
    quotas = request_quotas()
    job_id = new_job_id()
    quotas.admit_job(g.tenant, job_id)  # before the source probe: a refusal costs no read
    try:
        view = services.jobs.create(g.tenant, req, job_id=job_id)
    except BaseException:
        quotas.release_job(g.tenant, job_id)  # the rate stays spent: the attempt cost a probe
        raise
    if services.dispatcher is not None and view["push_stages"]:
        services.dispatcher.kick(view["job_id"])
    return view, 201


@bp.get("")
def list_jobs():
    """A page of the tenant's jobs (filters: status, flow_id, flow_version, created_after,
    created_before; order; cursor). While another page follows, its link is in ``next`` and in a
    ``Link: <...>; rel="next"`` header; the last page has neither (the body stays ``{"jobs": [...]}``
    for clients written before paging)."""
    query = parse_query(request.args.to_dict())
    page = request_services().jobs.list(g.tenant, query)
    if page.next_cursor is None:
        return jsonify({"jobs": page.jobs})
    link = f"{request.path}?{urlencode(query.link_params() | {'cursor': page.next_cursor})}"
    resp = jsonify({"jobs": page.jobs, "next": link})
    resp.headers["Link"] = f'<{link}>; rel="next"'
    return resp


@bp.get("/<job_id>")
def show(job_id: str):
    return jsonify(request_services().jobs.view(g.tenant, job_id))


@bp.get("/<job_id>/batches")
def batches(job_id: str):
    after = query_int("after", -1, -1, 2**53)
    limit = query_int("limit", 100, 1, 1000)
    found = request_services().jobs.batches(g.tenant, job_id, request.args.get("status"), after, limit)
    return jsonify({"batches": found})


@bp.get("/<job_id>/batches/<int:seq>")
def batch(job_id: str, seq: int):
    return jsonify(request_services().jobs.batch(g.tenant, job_id, seq))


@bp.get("/<job_id>/log")
def job_log(job_id: str):
    """Execution log entries, oldest first, after stream id ``after``."""
    services = request_services()
    spec = services.jobs.owned_spec(g.tenant, job_id)
    return jsonify({"entries": _read_stream(services, job_id, "log", [s.name for s in spec.flow.stages])})


def _read_stream(services, job_id: str, kind: str, stage_names: list[str] | None) -> list[dict]:
    """The job's ``kind`` entries (log, audit; a job at rest's past first) after ``?after=`` (a stream
    id), at most ``?limit=``, with typed values."""
    after = request.args.get("after", "-")
    limit = query_int("limit", 200, 1, 10_000)
    if not re.fullmatch(LOG_ID, after):
        raise InvalidRequest("after must be a log entry id such as 1700000000000-0")
    start = "-" if after == "-" else f"({after}"
    try:
        entries = archive.entries(services.redis, services.ledger.keys.job(job_id), kind, start, "+", limit)
    except REDIS_DOWN:
        raise  # a cluster's CLUSTERDOWN is a ResponseError too: a 503, not the caller's fault
    except redis.ResponseError as exc:  # a malformed stream id from the caller
        raise InvalidRequest("after must be a log entry id such as 1700000000000-0") from exc
    return [{"id": i, **_when(i), **typed_entry(fields, stage_names)} for i, fields in entries]


def _when(entry_id: str) -> dict:
    """``at_ms`` and ``at`` (ISO 8601, UTC): when Redis appended the entry (its stream id's time)."""
    ms = int(entry_id.split("-", 1)[0])
    at = datetime.fromtimestamp(ms / 1000, tz=timezone.utc).strftime("%Y-%m-%dT%H:%M:%S")
    return {"at_ms": ms, "at": f"{at}.{ms % 1000:03d}Z"}


@bp.get("/<job_id>/audit")
def job_audit(job_id: str):
    """Control events (created, paused, resumed, cursor moved, cancelled, ...), oldest first; never capped."""
    services = request_services()
    services.jobs.owned_spec(g.tenant, job_id)
    return jsonify({"entries": _read_stream(services, job_id, "audit", None)})


@bp.post("/<job_id>/pause")
def pause(job_id: str):
    """No new leases; answers for batches already in flight are still taken."""
    return jsonify(pause_job(request_services(), g.tenant, job_id, g.actor))


@bp.post("/<job_id>/release")
def release(job_id: str):
    """Let a job held by record-only recovery run again."""
    services = request_services()
    services.jobs.owned_spec(g.tenant, job_id)
    services.ledger.release(job_id, g.actor)
    if services.dispatcher is not None:
        services.dispatcher.kick(job_id)
    return jsonify(services.jobs.view(g.tenant, job_id))


class CancelRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    reason: str = Field(default="", max_length=500)


@bp.post("/<job_id>/cancel")
def cancel(job_id: str):
    """Final: voids every outstanding lease. Cancelling a cancelled job again answers 200."""
    request_services().jobs.owned_spec(g.tenant, job_id)  # another tenant's job: 404 before the body
    req = parse(CancelRequest, json_body(required=False), "cancel request")
    return jsonify(cancel_job(request_services(), g.tenant, job_id, g.actor, req))


@bp.post("/<job_id>/resume")
def resume(job_id: str):
    req = parse(ResumeRequest, json_body(required=False), "resume request")
    return jsonify(resume_job(request_services(), g.tenant, job_id, g.actor, req))


@bp.post("/<job_id>/retry-failed")
def retry_failed(job_id: str):
    return jsonify(retry_failed_job(request_services(), g.tenant, job_id, g.actor))


class QuarantineRetryRequest(BaseModel):
    """Which quarantined items to run again: ids ``<seq>.<index>`` as the listing shows them; none =
    every quarantined item of the job."""

    model_config = ConfigDict(extra="forbid")

    items: list[str] | None = Field(default=None, min_length=1, max_length=10_000)


@bp.get("/<job_id>/quarantine")
def quarantine(job_id: str):
    """Items bisection quarantined: each with its batch, index, the item, stage and the platform's error."""
    services = request_services()
    services.jobs.owned_spec(g.tenant, job_id)
    items = services.ledger.quarantined(job_id)
    return jsonify({"job_id": job_id, "count": len(items), "items": items})


@bp.post("/<job_id>/quarantine/retry")
def quarantine_retry(job_id: str):
    req = parse(QuarantineRetryRequest, json_body(required=False), "quarantine retry request")
    return jsonify(retry_quarantined_job(request_services(), g.tenant, job_id, g.actor, req.items))


@bp.post("/<job_id>/migrate")
def migrate(job_id: str):
    """Move a paused or failed job to another version of its flow; 409 names what is incompatible."""
    req = parse(MigrateRequest, json_body(), "migrate request")
    return jsonify(migrate_job(request_services(), g.tenant, job_id, g.actor, req))


# The job operations behind the routes above, shared with the web console (gateway/console): one
# place decides what an action does (quotas, dispatcher kicks, settling a migration), whoever asks.

def pause_job(services: Services, tenant: str, job_id: str, actor: str) -> dict:
    services.jobs.owned_spec(tenant, job_id)
    services.ledger.pause(job_id, actor)
    return services.jobs.view(tenant, job_id)


def cancel_job(services: Services, tenant: str, job_id: str, actor: str, req: CancelRequest) -> dict:
    services.jobs.owned_spec(tenant, job_id)
    result = services.ledger.cancel(job_id, actor, req.reason)
    return {**services.jobs.view(tenant, job_id), "cancel": result}


def resume_job(services: Services, tenant: str, job_id: str, actor: str, req: ResumeRequest) -> dict:
    view = services.jobs.resume(tenant, job_id, req, actor)
    request_quotas().track(tenant, job_id)  # a succeeded job resumed from a cursor is active again
    return view


def retry_failed_job(services: Services, tenant: str, job_id: str, actor: str) -> dict:
    spec = services.jobs.owned_spec(tenant, job_id)
    services.jobs.check_flow_version(spec)
    settle(services.ledger, services.ledger.job_fields(job_id))  # after a migration: see migrate.py
    reopened = services.ledger.reopen(job_id, actor, only_failed=True)
    request_quotas().track(tenant, job_id)
    if reopened and services.dispatcher is not None and any(s.target for s in spec.flow.stages):
        services.dispatcher.kick(job_id)
    return {**services.jobs.view(tenant, job_id), "reopened": reopened}


def retry_quarantined_job(services: Services, tenant: str, job_id: str, actor: str,
                          items: list[str] | None) -> dict:
    spec = services.jobs.owned_spec(tenant, job_id)
    services.jobs.check_flow_version(spec)
    result = services.ledger.retry_quarantined(job_id, items, actor)
    if result["retried"]:
        request_quotas().track(tenant, job_id)  # a job that had ended is active again
        if services.dispatcher is not None and any(s.target for s in spec.flow.stages):
            services.dispatcher.kick(job_id)
    return {**services.jobs.view(tenant, job_id), "quarantine_retry": result}


def migrate_job(services: Services, tenant: str, job_id: str, actor: str, req: MigrateRequest) -> dict:
    view = services.jobs.migrate(tenant, job_id, req, actor)
    if services.dispatcher is not None and view["push_stages"]:
        services.dispatcher.kick(job_id)  # registers the job with the push workers if it now has targets
    return view
