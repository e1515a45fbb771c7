"""The console's approvals inbox: the tenant's approvals by status (the listing's cursor for paging), one
job's pending approvals, an approval's page, and approving (with an edited output) or rejecting it.

Reads go through ``ledger.approvals`` with the session's tenant (``owned``: another tenant's approval is
the same 404 as a missing one); a decision goes through ``ledger.approvals.decide`` as the API's does,
with the session's actor ``tenant:<name> (console)``, and wakes the workers as the API does. A refused
decision (409 decided already, 403 not an approver, the job cancelled, an output that is not JSON)
re-renders the approval page with the problem under its status; nothing is decided.
"""

from __future__ import annotations

import json
from typing import Any

from flask import redirect, render_template, request, url_for

from gateway.api.approvals import DecisionRequest, wake
from gateway.console.auth import NAV, NavItem, bp, current, services
from gateway.errors import BatchgateError, InvalidRequest, MalformedBody
from gateway.ledger.approvals import LISTED
from gateway.ledger.records import loads_or_none
from gateway.validation import parse, strict_loads

PAGE_SIZE = 25
OUTPUT_MAX = 1_000_000  # characters of an edited output (the API's body limit is of the same order)
NOTICES = {"approve": "Approved: the batch goes on to its next stage.",
           "reject": "Rejected: the batch failed (type rejected); the failure budget decides the job."}


def pending_count(tenant: str) -> int:
    """The tenant's pending approvals as listed (an entry of a job cancelled since leaves at the next
    listing, so the number may run one listing ahead of the page)."""
    svc = services()
    return int(svc.redis.zcard(svc.ledger.keys.approval_index(tenant, "pending")))


NAV.append(NavItem("console.approvals", "Approvals", "console.approval", count=pending_count))


# ---------------------------------------------------------------------------------------------- inbox

@bp.get("/approvals")
def approvals() -> Any:
    """``?status=`` one of pending, approved, rejected (newest first, ``cursor`` pages on); ``?job=``
    one job's pending approvals, soonest deadline first (``after`` pages on)."""
    status = request.args.get("status", "pending")
    job_id = request.args.get("job", "").strip()
    cursor = request.args.get("cursor") or None
    problem, rows, next_url = None, [], None
    try:
        if status not in LISTED:
            raise InvalidRequest(f"status must be one of {', '.join(LISTED)}")
        if job_id:
            rows, after = _job_pending(job_id)
            if after is not None:
                next_url = url_for("console.approvals", job=job_id, after=after)
        else:
            rows, nxt = services().ledger.approvals.list(current().tenant, status, PAGE_SIZE, cursor)
            if nxt is not None:
                next_url = url_for("console.approvals", status=status, cursor=nxt)
    except InvalidRequest as exc:
        problem = exc.problem()
    paged = bool(cursor or request.args.get("after"))
    return render_template(
        "console/approvals.html", approvals=rows, status="pending" if job_id else status, statuses=LISTED,
        job_id=job_id or None, problem=problem, next_url=next_url,
        first_url=url_for("console.approvals", status=status, job=job_id or None) if paged else None,
    ), 422 if problem else 200


def _job_pending(job_id: str) -> tuple[list[dict[str, Any]], int | None]:
    """One page of a job's pending approvals (its due set: soonest deadline first); NotFound for a job
    the tenant does not own. Returns the views and the offset of the next page (None: last page)."""
    svc = services()
    svc.jobs.owned_spec(current().tenant, job_id)
    raw = request.args.get("after", "0")
    start = int(raw) if raw.isdigit() and len(raw) < 10 else 0
    k = svc.ledger.keys.job(job_id)
    ids = svc.redis.zrange(k.approvals_due, start, start + PAGE_SIZE)
    pipe = svc.redis.pipeline(transaction=False)
    for approval_id in ids[:PAGE_SIZE]:
        _, seq, stage, rnd = approval_id.rsplit(".", 3)
        pipe.hgetall(k.approval(int(seq), int(stage), int(rnd)))
        pipe.hgetall(k.batch(int(seq)))
    got = pipe.execute()
    views = [svc.ledger.approvals.view(rec, batch) for rec, batch in zip(got[::2], got[1::2], strict=True)
             if rec.get("status") == "pending"]
    return views, start + PAGE_SIZE if len(ids) > PAGE_SIZE else None


# ---------------------------------------------------------------------------------------------- one

def _edit_text(value: Any) -> str:
    """The shown output as the approve form's textarea holds it (indented JSON, whole)."""
    return json.dumps(value, ensure_ascii=False, indent=2)


def render_approval(approval_id: str, problem: dict[str, Any] | None = None, status: int = 200,
                    form: dict[str, str] | None = None) -> tuple[str, int]:
    svc = services()
    view = svc.ledger.approvals.get(current().tenant, approval_id)
    form = form or {}
    notice = None if problem else NOTICES.get(request.args.get("done", ""))
    committed = None
    if view["status"] == "approved" and view["decision"] and view["decision"]["edited_output"]:
        batch = svc.redis.hgetall(svc.ledger.keys.job(view["job_id"]).batch(view["seq"]))
        # {} once the batch was delivered to the job's sink and compacted: the sink holds the output
        committed = loads_or_none(batch.get(f"out:{view['stage_index']}"))
    return render_template(
        "console/approval.html", a=view, problem=problem, notice=notice, form=form, committed=committed,
        output_text=form["output"] if form.get("action") == "approve" else _edit_text(view["shown_output"]),
    ), status


@bp.get("/approvals/<approval_id>")
def approval(approval_id: str) -> Any:
    return render_approval(approval_id)


def _edited_output(text: str, shown: Any) -> Any:
    """The approve form's output: None when it is the shown output unchanged (nothing edited), else the
    parsed JSON; InvalidRequest when it is not JSON."""
    if not text.strip():
        raise InvalidRequest("output: empty; enter the JSON to commit (the shown output as it was, or "
                             "edited, or null); nothing was decided")
    if len(text) > OUTPUT_MAX:
        raise InvalidRequest(f"output: longer than {OUTPUT_MAX} characters")
    try:
        value = strict_loads(text.encode())
    except MalformedBody as exc:
        why = exc.detail.removeprefix("body is not valid JSON: ").removeprefix("body ")
        raise InvalidRequest(f"output: the edited output is not valid JSON ({why}); nothing was decided") \
            from None
    return None if value == shown else value


@bp.post("/approvals/<approval_id>/<any(approve, reject):decision>")
def approval_decide(approval_id: str, decision: str) -> Any:
    """Approve (the textarea's JSON replaces the shown output when edited) or reject (a comment)."""
    svc, session = services(), current()
    view = svc.ledger.approvals.get(session.tenant, approval_id)  # another tenant's: the 404 page
    form = {"action": decision, "output": request.form.get("output", ""),
            "comment": request.form.get("comment", "")}
    try:
        output = _edited_output(form["output"], view["shown_output"]) if decision == "approve" else None
        req = parse(DecisionRequest, {"decision": decision, "comment": form["comment"].strip() or None,
                                      "output": output}, "the decision")
        _, fresh = svc.ledger.approvals.decide(session.tenant, approval_id, req.decision, session.actor,
                                               comment=req.comment or "", output=req.output)
    except BatchgateError as exc:
        if exc.status >= 500:
            raise  # unavailable: the 503 page
        return render_approval(approval_id, {**exc.problem(), "action": decision}, exc.status, form)
    if fresh:
        wake(svc, view["job_id"])
    return redirect(url_for("console.approval", approval_id=approval_id, done=decision), code=303)
