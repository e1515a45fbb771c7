"""The console's job pages: the jobs list (filters, index paging, live rows), a job's page (progress,
committed cursor, batches, failures, log, audit trail) and its control forms.

Every read goes through ``JobService`` with the session's tenant, so another tenant's job is a 404 as
in the API; every action calls the API's own job operations (gateway/api/jobs.py), so the console and
the API cannot disagree on what "pause" or "migrate" does. A refused action re-renders the job page
with the problem (status, title, detail, what is incompatible) and the problem's HTTP status.
"""

from __future__ import annotations

import re
from typing import Any

from flask import redirect, render_template, request, url_for

from gateway.api.jobs import (
    CancelRequest,
    cancel_job,
    migrate_job,
    pause_job,
    resume_job,
    retry_failed_job,
    retry_quarantined_job,
)
from gateway.console.auth import bp, current, services
from gateway.errors import BatchgateError, InvalidRequest
from gateway.ledger import archive
from gateway.ledger.jobindex import STATUSES
from gateway.ledger.joblist import Page, parse_query
from gateway.ledger.jobs import BATCH_STATUSES, MigrateRequest, ResumeRequest, batch_view
from gateway.ledger.records import typed_entry
from gateway.validation import parse, strict_loads

PAGE_SIZE = 25
BATCH_PAGE = 20
FAILED_SHOWN = 20
STREAM_SHOWN = 30  # newest log and audit entries on the job page
STREAM_ID = r"[0-9]{1,19}-[0-9]{1,19}"  # a log or audit entry id (paging back)
FINAL = frozenset({"succeeded", "failed", "cancelled"})
#: What the page says after an action went through (the redirect names the action, never free text).
NOTICES = {"pause": "Paused.", "resume": "Resumed.", "cancel": "Cancelled.",
           "retry-failed": "Failed batches re-opened.", "resume-cursor": "Re-planned from the cursor.",
           "migrate": "Migrated; resume the job to run it on the new version.",
           "retry-quarantined": "Quarantined items running again."}
QUARANTINE_SHOWN = 50  # quarantined items the job page lists (the API lists them all)


# ---------------------------------------------------------------------------------------------- list

def _list_args() -> dict[str, str]:
    """The list's filters and cursor as given (empty ones dropped)."""
    return {name: value for name in ("status", "flow_id", "cursor")
            if (value := request.args.get(name, "").strip())}


def _list_page(args: dict[str, str]) -> tuple[Page, dict[str, Any] | None]:
    try:
        query = parse_query(args | {"limit": PAGE_SIZE})
        return services().jobs.list(current().tenant, query), None
    except InvalidRequest as exc:
        return Page([], None), exc.problem()


@bp.get("/jobs")
def jobs() -> Any:
    args = _list_args()
    page, problem = _list_page(args)
    filters = {k: v for k, v in args.items() if k != "cursor"}
    return render_template(
        "console/jobs.html", jobs=page.jobs, problem=problem, filters=filters, statuses=STATUSES,
        flow_ids=sorted({fid for fid, _ in _flow_versions()}), paged=("cursor" in args),
        next_url=url_for("console.jobs", **filters, cursor=page.next_cursor) if page.next_cursor else None,
        first_url=url_for("console.jobs", **filters), poll_url=url_for("console.job_rows", **args),
    ), 422 if problem else 200


@bp.get("/jobs/rows")
def job_rows() -> Any:
    """The list's rows alone: the live region polls this every 2 s (same filters, same cursor)."""
    page, _ = _list_page(_list_args())
    return render_template("console/_job_rows.html", jobs=page.jobs)


def _flow_versions() -> list[tuple[str, str]]:
    """(flow id, version) of every flow version the tenant registered, oldest first (one read)."""
    svc = services()
    members = svc.redis.zrange(svc.ledger.keys.flows(current().tenant), 0, -1)
    return [(fid, ver) for fid, _, ver in (m.rpartition(":") for m in members)]


# ---------------------------------------------------------------------------------------------- job

def _int_arg(name: str, default: int) -> int:
    raw = request.args.get(name, "")
    return int(raw) if raw.lstrip("-").isdigit() and -1 <= int(raw) < 2**53 else default


def _recent(k: Any, kind: str, stage_names: list[str] | None,
            arg: str) -> tuple[list[dict[str, Any]], str | None]:
    """The newest entries of a log or audit stream (newest first), before the entry id in query
    argument ``arg`` if given; and that argument's value for the older page (None: no older entries)."""
    before = request.args.get(arg, "")
    top = f"({before}" if re.fullmatch(STREAM_ID, before) else "+"
    found = archive.entries(services().redis, k, kind, top, "-", STREAM_SHOWN + 1, reverse=True)
    entries = [{"id": i, **typed_entry(fields, stage_names)} for i, fields in found[:STREAM_SHOWN]]
    return entries, entries[-1]["id"] if len(found) > STREAM_SHOWN else None


def _failed(job_id: str, spec: Any) -> list[dict[str, Any]]:
    """The first failed batches (by seq) from the job's failed set, with their errors and attempts."""
    svc = services()
    k = svc.ledger.keys.job(job_id)
    seqs = svc.redis.zrange(k.failed, 0, FAILED_SHOWN - 1)
    pipe = svc.redis.pipeline(transaction=False)
    for seq in seqs:
        pipe.hgetall(k.batch(int(seq)))
    return [batch_view(spec, fields, full=False) for fields in pipe.execute() if fields]


def _job_context(job_id: str) -> dict[str, Any]:
    """Everything the job page shows; NotFound (a 404 page) for a job the tenant does not own."""
    svc = services()
    tenant = current().tenant
    spec = svc.jobs.owned_spec(tenant, job_id)
    view = svc.jobs.view(tenant, job_id)
    status = request.args.get("batches")
    status = status if status in BATCH_STATUSES else None
    after = _int_arg("after", -1)
    listed = svc.jobs.batches(tenant, job_id, status, after, BATCH_PAGE + 1)
    more = len(listed) > BATCH_PAGE
    listed = listed[:BATCH_PAGE]
    k = svc.ledger.keys.job(job_id)
    names = [s.name for s in spec.flow.stages]
    log, log_older = _recent(k, "log", names, "log_before")
    audit, audit_older = _recent(k, "audit", None, "audit_before")
    return {
        "job": view, "counts": batch_counts(view), "batches": listed, "batch_status": status,
        "batch_statuses": BATCH_STATUSES,
        "batches_next": url_for("console.job", job_id=job_id, batches=status, after=listed[-1]["seq"])
        if more else None,
        "batches_first": url_for("console.job", job_id=job_id, batches=status) if after >= 0 else None,
        "failed": _failed(job_id, spec) if view["batches"]["failed"] else [],
        "quarantined": svc.ledger.quarantined(job_id, QUARANTINE_SHOWN) if view["items_quarantined"] else [],
        "log": log, "log_older": _older(job_id, "log_before", log_older),
        "audit": audit, "audit_older": _older(job_id, "audit_before", audit_older),
        "versions": [ver for fid, ver in _flow_versions() if fid == spec.flow.id],
    }


def _older(job_id: str, arg: str, before: str | None) -> str | None:
    """The job page with one stream's older entries (the other arguments kept)."""
    if before is None:
        return None
    return url_for("console.job", job_id=job_id, **(request.args.to_dict() | {arg: before}))


def batch_counts(view: dict[str, Any]) -> dict[str, int]:
    """Batches by status from the job's counters (open = pending, leased or waiting for a person; the
    rest superseded)."""
    b = view["batches"]
    waiting = b.get("waiting_human", 0)
    counts = {"completed": b["completed"], "failed": b["failed"], "leased": b["leased"],
              "pending": max(b["open"] - b["leased"] - waiting, 0)}
    if "waiting_human" in b:  # a flow with approval stages
        counts["waiting_human"] = waiting
    counts["superseded"] = max(b["planned"] - b["open"] - b["completed"] - b["failed"], 0)
    return counts


@bp.get("/jobs/<job_id>")
def job(job_id: str) -> Any:
    return render_job(job_id)


@bp.get("/jobs/<job_id>/batches/<int:seq>")
def job_batch(job_id: str, seq: int) -> Any:
    """One batch in full: cursors, each stage's status and output, its error and attempts."""
    view = services().jobs.view(current().tenant, job_id)
    return render_template("console/batch.html", job=view,
                           batch=services().jobs.batch(current().tenant, job_id, seq))


@bp.get("/jobs/<job_id>/live")
def job_live(job_id: str) -> Any:
    """The job's status and progress alone: the live region polls this every 2 s."""
    view = services().jobs.view(current().tenant, job_id)
    return render_template("console/_job_live.html", job=view, counts=batch_counts(view), final=FINAL)


def render_job(job_id: str, problem: dict[str, Any] | None = None, status: int = 200,
               form: dict[str, str] | None = None) -> tuple[str, int]:
    notice = None if problem else NOTICES.get(request.args.get("done", ""))
    return render_template("console/job.html", **_job_context(job_id), problem=problem, notice=notice,
                           form=form or {}, final=FINAL), status


# ---------------------------------------------------------------------------------------------- act

def _act(action: str, job_id: str) -> None:
    """Run one control action through the API's operations; BatchgateError when it is refused."""
    svc, session, form = services(), current(), request.form
    if action == "pause":
        pause_job(svc, session.tenant, job_id, session.actor)
    elif action == "resume":
        resume_job(svc, session.tenant, job_id, session.actor, ResumeRequest())
    elif action == "cancel":
        req = parse(CancelRequest, {"reason": form.get("reason", "")}, "cancel request")
        cancel_job(svc, session.tenant, job_id, session.actor, req)
    elif action == "retry-failed":
        retry_failed_job(svc, session.tenant, job_id, session.actor)
    elif action == "retry-quarantined":
        item = form.get("item", "").strip()
        retry_quarantined_job(svc, session.tenant, job_id, session.actor, [item] if item else None)
    elif action == "resume-cursor":
        cursor = strict_loads(form.get("cursor", "").encode())
        req = parse(ResumeRequest, {"cursor": cursor, "reason": form.get("reason", "")}, "resume request")
        resume_job(svc, session.tenant, job_id, session.actor, req)
    elif action == "migrate":
        req = parse(MigrateRequest, {"flow_version": form.get("flow_version", "").strip(),
                                     "reason": form.get("reason", "").strip()}, "migrate request")
        migrate_job(svc, session.tenant, job_id, session.actor, req)


@bp.post("/jobs/<job_id>/<any(pause, resume, cancel, 'retry-failed', 'retry-quarantined', 'resume-cursor', "
         "migrate):action>")
def job_act(job_id: str, action: str) -> Any:
    """Pause, resume, cancel, retry-failed, retry-quarantined (one item or all), resume-by-cursor,
    migrate; a refusal shows its problem."""
    services().jobs.owned_spec(current().tenant, job_id)  # another tenant's job: the 404 page
    try:
        _act(action, job_id)
    except BatchgateError as exc:
        if exc.status >= 500:
            raise  # unavailable: the 503 page
        form = {k: v for k, v in request.form.items() if k in ("cursor", "reason", "flow_version")}
        return render_job(job_id, {**exc.problem(), "action": action}, exc.status, form | {"action": action})
    return redirect(url_for("console.job", job_id=job_id, done=action), code=303)

