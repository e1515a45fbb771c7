"""Approval routes: the tenant's approvals (paged), one approval, and deciding it."""

from __future__ import annotations

from typing import Any, Literal
from urllib.parse import urlencode

from flask import Blueprint, g, jsonify, request
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.common import json_body, query_int, request_services
from gateway.errors import InvalidRequest
from gateway.ledger.approvals import LISTED, PAGE_MAX
from gateway.ledger.decisions import links_for
from gateway.validation import parse

bp = Blueprint("approvals", __name__, url_prefix="/v1/approvals")


class DecisionRequest(BaseModel):
    """A person's decision on an approval."""

    model_config = ConfigDict(extra="forbid")
    decision: Literal["approve", "reject"]
    comment: str | None = Field(default=None, max_length=2000)
    output: Any = Field(default=None, description="approve only: replaces the shown output; it is what "
                                                   "the approval stage commits")


@bp.get("")
def list_approvals():
    """``?status=pending|approved|rejected`` (default pending), newest first, ``limit`` and ``cursor``;
    ``next`` (and a Link header) while another page follows."""
    status = request.args.get("status", "pending")
    limit = query_int("limit", 50, 1, PAGE_MAX)
    if status not in LISTED:
        raise InvalidRequest(f"status must be one of {', '.join(LISTED)}")
    approvals = request_services().ledger.approvals
    page, cursor = approvals.list(g.tenant, status, limit, request.args.get("cursor"))
    if cursor is None:
        return jsonify({"approvals": page, "next": None})
    link = f"{request.path}?{urlencode({'status': status, 'limit': limit, 'cursor': cursor})}"
    resp = jsonify({"approvals": page, "next": link})
    resp.headers["Link"] = f'<{link}>; rel="next"'
    return resp


@bp.get("/<approval_id>")
def show(approval_id: str):
    """One approval: job, seq, stage, items range, shown output, prompt, times, approvers, decision;
    ``links`` (signed decision links) while it is pending."""
    services = request_services()
    view = services.ledger.approvals.get(g.tenant, approval_id)
    if view["status"] == "pending":
        _, rec = services.ledger.approvals.owned(g.tenant, approval_id)
        data = {"approval_id": view["id"], "deadline_ms": int(rec["deadline_ms"]),
                "approvers": view["approvers"]}
        view["links"] = links_for(services.ledger, data, services.settings, request.url_root)["links"]
    return jsonify(view)


@bp.post("/<approval_id>")
def decide(approval_id: str):
    """Decide as the token's actor: 200 with the record (also for the same decision again), 409
    approval-decided for another one, 403 when the approval names approvers and the actor is not one."""
    req = parse(DecisionRequest, json_body(), "the decision")
    if req.decision == "reject" and req.output is not None:
        raise InvalidRequest("output: only an approval may replace the shown output")
    services = request_services()
    view, fresh = services.ledger.approvals.decide(
        g.tenant, approval_id, req.decision, g.actor, comment=req.comment or "", output=req.output)
    if fresh:
        wake(services, view["job_id"])
    return jsonify(view)


def wake(services: Any, job_id: str) -> None:
    """A decision may have made a batch ready for a push stage: wake the workers (the supervisor's
    pump would find it within a tick anyway)."""
    if services.dispatcher is not None:
        services.dispatcher.kick(job_id)
