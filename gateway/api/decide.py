"""Signed decision links (gateway/ledger/decisions.py): a small HTML page that shows an approval and asks,
and the form POST that decides. Only the POST decides, so a link preview (a GET) never approves.

These routes take no bearer token: the signed token in the path is the credential (its log lines are
redacted like callback URLs). Errors are small HTML pages with the problem's status (401 forged, 410
expired, 404 gone), since a person in a browser reads them.
"""

from __future__ import annotations

import json
from html import escape
from typing import Any

from flask import Blueprint, Response, request

from gateway.api.approvals import wake
from gateway.api.common import request_services
from gateway.errors import BatchgateError, InvalidRequest
from gateway.ledger.approvals import ApprovalDecided, ApprovalRef
from gateway.ledger.decisions import read_token

bp = Blueprint("decide", __name__, url_prefix="/decide")

_PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><meta name="robots" content="noindex">
<meta name="referrer" content="no-referrer">
<meta name="viewport" content="width=device-width, initial-scale=1"><title>{title}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:46rem;margin:2rem auto;padding:0 1rem}}
pre{{background:#f4f4f4;padding:.8rem;overflow:auto;max-height:30rem}}
dt{{font-weight:600}}button{{font-size:1rem;padding:.4rem 1.2rem;margin-right:.6rem}}</style></head>
<body><h1>{title}</h1>{body}</body></html>"""


def _html(title: str, body: str, status: int = 200) -> Response:
    resp = Response(_PAGE.format(title=escape(title), body=body), status=status, mimetype="text/html")
    resp.headers["Cache-Control"] = "no-store"
    resp.headers["X-Frame-Options"] = "DENY"
    resp.headers["Content-Security-Policy"] = ("default-src 'none'; style-src 'unsafe-inline'; "
                                               "form-action 'self'")
    return resp


def _shown(value: Any) -> str:
    return f"<pre>{escape(json.dumps(value, indent=2, ensure_ascii=False)[:20000])}</pre>"


def _details(view: dict[str, Any]) -> str:
    items = view["items"]
    rows = [("Job", view["job_id"]), ("Batch", str(view["seq"])), ("Stage", view["stage"] or ""),
            ("Items", f"{items['count'] if items['count'] is not None else '?'} items from cursor "
                      f"{json.dumps(items['cursor'])} to {json.dumps(items['end_cursor'])}"),
            ("Decide before", view["deadline"] or ""), ("If nobody decides", view["on_timeout"] or "")]
    dl = "".join(f"<dt>{escape(k)}</dt><dd>{escape(v)}</dd>" for k, v in rows)
    shown = "" if view["shown_output"] is None else "<h2>Output to review</h2>" + _shown(view["shown_output"])
    prompt = ""
    if view["prompt"] is not None and view["kind"] == "platform":
        prompt = "<h2>The platform asks</h2>" + _shown(view["prompt"])
    return f"<dl>{dl}</dl>{prompt}{shown}"


def _decided(view: dict[str, Any]) -> str:
    d = view["decision"] or {}
    if view["status"] == "void":
        return "<p>This approval no longer applies (its batch was planned again).</p>"
    comment = f" ({escape(d['comment'])})" if d.get("comment") else ""
    return (f"<p><strong>Decided: {escape(view['status'])}</strong> by {escape(d.get('actor') or '')} "
            f"at {escape(d.get('decided_at') or '')}{comment}.</p>")


def _error(exc: BatchgateError) -> Response:
    return _html(exc.title, f"<p>{escape(exc.detail)}</p>", exc.status)


def _open(token: str) -> tuple[Any, dict[str, Any], str | None, dict[str, str]]:
    ledger = request_services().ledger
    approval_id, approver = read_token(ledger, token)
    ref = ApprovalRef.parse(approval_id)
    rec = ledger.approvals.record(ref)
    return ledger, ledger.approvals.view(rec), approver, rec


@bp.get("/<token>")
def page(token: str):
    """Show the approval and, while it is pending, a form whose buttons POST the decision."""
    try:
        _, view, approver, _ = _open(token)
    except BatchgateError as exc:
        return _error(exc)
    title = f"Approval for batch {view['seq']} of {view['job_id']}"
    if view["status"] != "pending":
        return _html(title, _details(view) + _decided(view))
    who = f"<p>Deciding as <strong>{escape(approver)}</strong>.</p>" if approver else ""
    form = (f'{who}<form method="post"><p><label>Comment (optional)<br><textarea name="comment" rows="3" '
            'cols="60" maxlength="2000"></textarea></label></p>'
            '<button type="submit" name="decision" value="approve">Approve</button>'
            '<button type="submit" name="decision" value="reject">Reject</button></form>')
    return _html(title, _details(view) + form)


@bp.post("/<token>")
def decide(token: str):
    """Decide once; a second POST (or one after the deadline's timeout) shows the decision made."""
    try:
        ledger, view, approver, rec = _open(token)
        decision = request.form.get("decision", "")
        if decision not in ("approve", "reject"):
            raise InvalidRequest("decision must be approve or reject")
        title = f"Approval for batch {view['seq']} of {view['job_id']}"
        actor = f"link:{approver}" if approver else "link"
        try:
            view, fresh = ledger.approvals.decide(rec["tenant"], view["id"], decision, actor,
                                                  comment=request.form.get("comment", "")[:2000],
                                                  approver=approver)
        except ApprovalDecided:
            fresh = False
            view = ledger.approvals.view(ledger.approvals.record(ApprovalRef.parse(view["id"])))
        if not fresh:  # one decision per approval: a second use shows the one made
            return _html(title, _details(view) + "<p>This link was used already.</p>" + _decided(view), 409)
        wake(request_services(), view["job_id"])
    except BatchgateError as exc:
        return _error(exc)
    return _html(title, _details(view) + _decided(view))
