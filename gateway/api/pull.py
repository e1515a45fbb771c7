"""Pull mode: a platform loop leases a batch, heartbeats, then completes or fails it."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Literal

from flask import Blueprint, g, jsonify
from pydantic import BaseModel, ConfigDict, Field

from connectors.base import Usage
from gateway.api.common import json_body, request_services
from gateway.api.jobs import request_quotas
from gateway.errors import QuotaExceeded
from gateway.ledger.ledger import ABSENT, NextLeaseRefused
from gateway.validation import parse

bp = Blueprint("pull", __name__, url_prefix="/v1/jobs/<job_id>")


class LeaseRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    stage: str | None = Field(default=None, max_length=64,
                              description="lease only batches waiting for this stage")


class HeartbeatRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    progress: Any = None
    extend_s: float | None = Field(default=None, gt=0, le=86_400)


class CompleteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    output: Any = None
    next_cursor: Any = ABSENT
    items: list[Any] | None = None
    status: Literal["completed", "waiting_human"] = Field(
        default="completed", description="waiting_human: a person must decide first; the batch waits "
        "with an approval showing ``prompt`` and the lease is released")
    prompt: Any = None
    timeout_s: float | None = Field(default=None, ge=1, le=30 * 86_400,
                                    description="waiting_human: the approval's timeout (default: max_run)")
    lease_next: bool = Field(default=False, description="and lease the job's next ready batch in the same "
                             "request: the answer's ``next`` is its envelope, or null (then "
                             "Batchgate-Job-Status says whether to wait or stop); one round trip per step")
    next_stage: str | None = Field(default=None, max_length=64,
                                   description="lease_next: only a batch waiting for this stage")
    usage: UsageReport | None = Field(default=None, description="what the call cost (tokens, price, "
                                      "currency), counted in the job's cost ledger")


class UsageReport(BaseModel):
    """What the call cost, as the platform told the pull client (optional; counted in the cost ledger)."""

    model_config = ConfigDict(extra="forbid")

    tokens: int | None = Field(default=None, ge=0, le=10**12)
    price: float | None = Field(default=None, ge=0, le=10**9)
    currency: str | None = Field(default=None, pattern=r"^[A-Za-z]{1,8}$")

    def usage(self) -> Usage | None:
        return Usage.parse(self.tokens, self.price, self.currency)


class FailureDetail(BaseModel):
    model_config = ConfigDict(extra="forbid")

    message: str = Field(min_length=1, max_length=2000)
    retryable: bool = True
    type: str | None = Field(default=None, max_length=200)


class FailRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lease_token: str = Field(min_length=1, max_length=200)
    error: FailureDetail
    usage: UsageReport | None = None


@bp.post("/lease")
def lease(job_id: str):
    """200 with the batch envelope, or 204 (header Batchgate-Job-Status says why); 429 past the
    tenant's leases-per-second quota (every lease request counts, answered or not: on one Redis in the
    lease's own script, on a cluster by a call of its own first)."""
    services = request_services()
    quota = lease_quota(services)
    try:
        services.jobs.owned_spec(g.tenant, job_id)
        req = parse(LeaseRequest, json_body(required=False), "lease request")
    except Exception:
        if quota is not None:
            quota.admit()  # a request refused before the lease counts all the same
        raise
    leased = services.ledger.lease(job_id, req.stage, quota=quota)
    if leased is None:
        status = services.ledger.job_fields(job_id)["status"]
        return "", 204, {"Batchgate-Job-Status": status}
    # a batch was handed out, so the job was running: loops read one header whatever the answer
    return jsonify(leased.envelope()), 200, {"Batchgate-Job-Status": "running"}


@bp.post("/batches/<int:seq>/heartbeat")
def heartbeat(job_id: str, seq: int):
    services = request_services()
    services.jobs.owned_spec(g.tenant, job_id)
    req = parse(HeartbeatRequest, json_body(), "heartbeat")
    extend_ms = int(req.extend_s * 1000) if req.extend_s else None
    progress = ABSENT if req.progress is None else req.progress
    # past the stage's max_run the attempt is failed here and RunTooLong answers 409
    return jsonify(services.ledger.heartbeat(job_id, seq, req.lease_token, progress, extend_ms,
                                             actor=g.actor))


@bp.post("/batches/<int:seq>/complete")
def complete(job_id: str, seq: int):
    """Commit the stage; an exact duplicate gets the first answer back, a stale token 409."""
    services = request_services()
    services.jobs.owned_spec(g.tenant, job_id)
    req = parse(CompleteRequest, json_body(), "completion")
    if req.status == "waiting_human":
        timeout = timedelta(seconds=req.timeout_s) if req.timeout_s else None
        opened = services.ledger.open_platform_approval(job_id, seq, req.lease_token, req.prompt,
                                                        timeout=timeout)
        return jsonify({"job_id": job_id, "seq": seq, "status": "waiting_human", **opened})
    usage = req.usage.usage() if req.usage else None
    if not req.lease_next:
        return jsonify(services.ledger.complete(job_id, seq, req.lease_token, req.output, req.next_cursor,
                                                req.items, usage=usage))
    # the lease counts against the tenant's lease quota as a POST /lease would (in the step's one script
    # on one Redis; asked first on a cluster); a refusal is no error of the commit: next is null,
    # Retry-After says when
    try:
        done, leased = services.ledger.complete_and_lease(job_id, seq, req.lease_token, req.output,
                                                          req.next_cursor, req.items, stage=req.next_stage,
                                                          usage=usage, quota=lease_quota(services))
    except QuotaExceeded as exc:  # asked first (a cluster): the commit alone
        done = services.ledger.complete(job_id, seq, req.lease_token, req.output, req.next_cursor, req.items,
                                        usage=usage)
        return refused_next(done, exc)
    except NextLeaseRefused as refused:  # committed; the lease part refused
        return refused_next(refused.done, refused.refusal)
    if leased is None:
        status = services.ledger.job_fields(job_id)["status"]
        return jsonify({**done, "next": None}), 200, {"Batchgate-Job-Status": status}
    return jsonify({**done, "next": leased.envelope()}), 200, {"Batchgate-Job-Status": "running"}


def lease_quota(services) -> Any:
    """This request's lease quota for the ledger's lease script to count (quotas.LeaseQuota), or None:
    off, or (a cluster) counted now by a call of its own, which raises its 429 here."""
    return request_quotas().lease_quota(g.tenant, in_script=not services.ledger.cluster)


def refused_next(done: dict, refusal: QuotaExceeded):
    """A commit's answer with no next batch: the lease quota refused it (Retry-After says when)."""
    wait = int(refusal.retry_after.total_seconds()) if refusal.retry_after else 1
    return jsonify({**done, "next": None}), 200, {"Batchgate-Job-Status": "running",
                                                  "Retry-After": str(max(1, wait))}


@bp.post("/batches/<int:seq>/fail")
def fail(job_id: str, seq: int):
    services = request_services()
    services.jobs.owned_spec(g.tenant, job_id)
    req = parse(FailRequest, json_body(), "failure report")
    return jsonify(services.ledger.fail(job_id, seq, req.lease_token, req.error.message,
                                        req.error.retryable, req.error.type, actor=g.actor,
                                        usage=req.usage.usage() if req.usage else None))
