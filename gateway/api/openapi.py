"""The OpenAPI 3.1 document of the whole API, built from the pydantic models that validate requests.

Request bodies are those models' JSON Schemas, so the document cannot drift from validation; the route
table below names every route (tests/test_openapi.py checks it against the app's URL map), and the
response schemas are deliberately modest: the key properties of each view, all of them true.
"""

from __future__ import annotations

import copy
import functools
import warnings
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, StrictBool
from pydantic.json_schema import GenerateJsonSchema, models_json_schema

from gateway.api import jobs
from gateway.api.approvals import DecisionRequest
from gateway.api.jobs import CancelRequest
from gateway.api.pull import CompleteRequest, FailRequest, HeartbeatRequest, LeaseRequest
from gateway.api.subscriptions import SubscriptionRequest
from gateway.ledger.events import EVENT_TYPES
from gateway.ledger import joblist
from gateway.ledger.flows import NAME, FlowSpec
from gateway.ledger.jobs import BATCH_STATUSES, STATUSES, JobRequest, MigrateRequest, ResumeRequest
from gateway.validation import MAX_DEPTH

REF = "#/components/schemas/{model}"
MICROSECOND = 1e-6
#: The widest integer a body may hold (validation.strict_loads): |n| < 2**64.
INT64_WIDE = 2**64 - 1
LEASE_BOUNDS = (0.05, 86_400.0)  # seconds (flows.Stage._positive_lease)
#: Any JSON value as the strict decoder takes it: integers within 64 bits, nested at most MAX_DEPTH.
JSON_VALUE: dict[str, Any] = {
    "description": f"any JSON value: integers within 64 bits (|n| < 2^64), nested at most "
                   f"{MAX_DEPTH} levels",
    "anyOf": [{"type": ["string", "boolean", "null"]},
              {"type": "number", "not": {"type": "integer"}},
              {"type": "integer", "minimum": -INT64_WIDE, "maximum": INT64_WIDE},
              {"type": "array", "items": {"$ref": "#/components/schemas/JsonValue"}},
              {"type": "object", "additionalProperties": {"$ref": "#/components/schemas/JsonValue"}}]}


class CallbackError(BaseModel):
    """``error`` of a failed answer."""

    message: str | None = Field(default=None, description="what went wrong (cut at 2000 characters)")
    retryable: StrictBool = True


class CallbackAnswer(BaseModel):
    """A platform's answer to a pushed stage (``connectors.base.Answer.parse`` validates it; other
    fields are ignored). Documentation only: tests/test_openapi.py checks Answer.parse agrees."""

    model_config = ConfigDict(extra="allow", json_schema_extra={"examples": [
        {"status": "succeeded", "output": {"scored": 3}},
        {"status": "failed", "error": {"message": "model quota exceeded", "retryable": True}},
        {"status": "waiting_human", "prompt": {"question": "send these 5 emails?"}}]})

    status: str = Field(json_schema_extra={"enum": ["succeeded", "failed", "waiting_human"]})
    output: Any = None
    prompt: Any = Field(default=None, description="waiting_human: what the person is asked (an approval "
                                                  "opens for the batch, showing it)")
    next_cursor: Any = Field(default=None, description="fetching first stage: the next batch's start")
    error: CallbackError | None = None


REQUEST_MODELS: tuple[type[BaseModel], ...] = (
    FlowSpec, JobRequest, ResumeRequest, MigrateRequest, CancelRequest, LeaseRequest, HeartbeatRequest,
    CompleteRequest, FailRequest, CallbackAnswer, SubscriptionRequest, DecisionRequest, jobs.QuarantineRetryRequest)

EXAMPLES: dict[str, Any] = {
    "FlowSpec": {"id": "resume-screening", "version": "1", "source": {"type": "sequence", "count": 10},
                 "batching": {"max_items": 5}, "stages": [{"name": "score", "lease": 60}]},
    "JobRequest": {"flow_id": "resume-screening", "params": {"threshold": 0.7}},
    "ResumeRequest": {"cursor": {"offset": 0}, "reason": "re-run after fixing the prompt"},
    "MigrateRequest": {"flow_version": "2", "reason": "store target fixed"},
    "CancelRequest": {"reason": "wrong input file"},
    "LeaseRequest": {"stage": "score"},
    "HeartbeatRequest": {"lease_token": "lt_9f3b2c", "progress": {"done": 2}, "extend_s": 30},
    "CompleteRequest": {"lease_token": "lt_9f3b2c", "output": {"scored": 5}},
    "FailRequest": {"lease_token": "lt_9f3b2c", "error": {"message": "model quota exceeded",
                                                          "retryable": True}},
    "SubscriptionRequest": {"url": "https://hooks.example.com/batchgate",
                            "events": ["job.succeeded", "job.failed"]},
    "DecisionRequest": {"decision": "approve", "comment": "looks right"},
}


class _Schemas(GenerateJsonSchema):
    """Durations as the API takes them: seconds (number, with the model's bounds) or ISO 8601."""

    def timedelta_schema(self, schema: Any) -> dict[str, Any]:
        seconds: dict[str, Any] = {"type": "number"}
        for bound, keyword in (("gt", "exclusiveMinimum"), ("ge", "minimum"),
                               ("lt", "exclusiveMaximum"), ("le", "maximum")):
            if schema.get(bound) is not None:
                seconds[keyword] = schema[bound].total_seconds()
        if seconds.get("exclusiveMinimum") == 0:  # a duration has microsecond resolution: 5e-324 is 0
            del seconds["exclusiveMinimum"]
            seconds["minimum"] = MICROSECOND
        return {"anyOf": [seconds, {"type": "string", "format": "duration"}],
                "description": "seconds, or an ISO 8601 duration such as PT30S (held to the same bounds)"}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


INT, NUM, STR, BOOL, OBJ = ({"type": "integer"}, {"type": "number"}, {"type": "string"},
                            {"type": "boolean"}, {"type": "object"})


def _obj(required: list[str], **props: Any) -> dict[str, Any]:
    return {"type": "object", "required": required, "properties": props}


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(model=name)}


VIEW_SCHEMAS: dict[str, Any] = {
    "Problem": {
        "type": "object", "description": "RFC 9457 problem details",
        "required": ["type", "title", "status", "detail"],
        "properties": {
            "type": STR, "title": STR, "status": {"type": "integer", "minimum": 400, "maximum": 599},
            "detail": STR,
            "instance": {**STR, "description": "500 only: urn:batchgate:error:<error_id>"},
            "error_id": {**STR, "description": "500 only: quote it to find the server's log line"},
            "errors": {"type": "array", "description": "422: each invalid field (values never echoed)",
                       "items": _obj(["field", "message"], field=STR, message=STR)},
            "quota": {"enum": ["active_jobs", "job_creations_per_minute", "leases_per_second"],
                      "description": "429: the tenant quota that refused the request"},
            "limit": {**INT, "description": "429: that quota's limit"},
            "retry_after_s": {**NUM, "description": "429: seconds until a retry can be admitted"}}},
    "Health": _obj(["status"], status={"const": "ok"}, instance=STR),
    "Live": _obj(["status"], status={"const": "ok"}),
    "Readiness": _obj(["status", "checks"], status={"const": "ready"},
                      checks={"type": "object", "additionalProperties": _obj(["ok"], ok=BOOL)}),
    "FlowRecord": _obj(["flow", "hash", "content_hash", "created_ms"],
                       flow=_obj(["id", "version", "stages"], id=STR, version=STR,
                                 stages={"type": "array", "items": OBJ}),
                       hash=STR, content_hash=STR, created_ms=INT),
    "FlowList": _obj(["flows"], flows={"type": "array", "items": _ref("FlowRecord")}),
    "FlowLatest": {"allOf": [_ref("FlowRecord"),
                             _obj(["versions"], versions={"type": "array", "items": STR})]},
    "JobView": _obj(
        ["job_id", "status", "flow", "stages", "batches", "items_done", "created_ms", "updated_ms"],
        job_id=STR, status={"enum": list(STATUSES)}, corrupt=BOOL,
        flow=_obj(["id", "version", "hash"], id=STR, version=STR, hash=STR,
                  previous=_nullable(_obj(["version", "hash"], version=STR, hash=STR))),
        params=OBJ, stages={"type": "array", "items": STR}, push_stages={"type": "array", "items": STR},
        committed_cursor={"description": "any JSON: where the next uncommitted batch starts"},
        committed_seq=INT,
        batches=_obj(["planned", "completed", "failed", "open", "leased"], planned=INT, completed=INT,
                     failed=INT, open=INT, leased=INT,
                     waiting_human={**INT, "description": "open batches waiting for a person's decision"}),
        retryable_failed={**INT, "description": "failed batches of a job that succeeded within its failure "
                          "budget: their items were never stored; retry-failed runs them"},
        items_done=INT, items_total=_nullable(INT), progress=_nullable(NUM),
        items_quarantined={**INT, "description": "items bisection set apart (GET .../quarantine)"},
        rate_items_per_s=NUM, eta_s=_nullable(NUM), source_exhausted=BOOL,
        error=_nullable(STR), held_reason=_nullable(STR), source_error=_nullable(STR),
        paused_reason={**_nullable(STR), "description": "why the job paused itself (its flow's cost budget)"},
        waiting=_nullable(_obj(["reason"], reason=STR, target=_nullable(STR), since_ms=_nullable(INT),
                               retry_at_ms=_nullable(INT))),
        bytes_done=_nullable(INT), bytes_total=_nullable(INT), bytes_read=_nullable(INT), items_planned=INT,
        sink=_obj(["type", "delivered_below_seq"], type=STR, delivered_below_seq=INT, batches_delivered=INT,
                  items_delivered=INT, behind=INT, amendments_owed=INT, amendments_delivered=INT,
                  error=_nullable(STR), error_ms=_nullable(INT)),
        created_ms=INT, updated_ms=INT, finished_ms=_nullable(INT),
        cost={**_ref("JobCost"), "description": "the cost ledger (docs/design.md \"Cost ledger\")"}),
    "JobCost": _obj(
        ["calls", "paid_calls", "tokens", "price", "call_seconds", "by_reason", "redone"],
        calls=INT, paid_calls=INT, tokens=INT, price=_nullable(NUM), call_seconds=NUM,
        by_reason={**OBJ, "description": "calls by why they ran: first, retry, rerun (after a lost worker "
                   "or callback), bisection"},
        redone={**_obj(["calls", "tokens"], calls=INT, tokens=INT, price=_nullable(NUM)),
                "description": "calls re-run after a lost worker or callback, and what they cost"},
        currency=_nullable(STR), stages=OBJ, budget=_nullable(OBJ)),
    "JobPlan": _obj(
        ["dry_run", "batches", "calls", "stages", "duration_s", "cost"],
        dry_run={"const": True}, flow=OBJ, batches=_nullable(INT), items=_nullable(INT),
        batches_confidence={"enum": ["exact", "lower_bound", "unknown"]}, batches_why=STR,
        calls={**OBJ, "description": "calls per stage in a run without faults"},
        stages={"type": "array", "items": OBJ}, duration_s=_nullable(NUM),
        duration_confidence={"enum": ["unknown", "low", "medium", "high"]},
        cost=_obj(["tokens", "price", "confidence"], tokens=_nullable(INT), price=_nullable(NUM),
                  confidence={"enum": ["unknown", "low", "medium", "high"]})),
    "JobList": _obj(["jobs"], jobs={"type": "array", "items": _ref("JobView")},
                    next={"type": "string", "description": "the next page (the same filters and a cursor); "
                          "absent on the last page, as is the Link: <...>; rel=\"next\" header"}),
    "MigratedJob": {"allOf": [_ref("JobView"), _obj(["migration"], migration=_obj(
        ["from", "to", "spec_gen"], spec_gen=INT, **{
            end: _obj(["version", "hash"], version=STR, hash=STR) for end in ("from", "to")}))]},
    "BatchView": _obj(["seq", "stage", "attempt", "items"],
                      seq=INT, status=_nullable(STR), stage=_nullable(STR), attempt=INT,
                      items={"anyOf": [INT, {"type": "null"}], "description": "null: one batch of a "
                             "compacted range (its record went to the job's result sink)"},
                      error=_nullable(STR), error_type=_nullable(STR),
                      attempts_spent=INT, stages=OBJ,
                      compacted={**BOOL, "description": "delivered to the job's result sink: the row stands "
                                 "for seqs first_seq..last_seq"},
                      first_seq=INT, last_seq=INT, range=OBJ,
                      approval_id={**STR, "description": "waiting_human: the approval it waits on"},
                      quarantined_items={"type": "array", "items": INT,
                                         "description": "indices of the batch's quarantined items"},
                      bisecting=_obj(["pieces", "extra_calls"], pieces={"type": "array", "items": {
                          "type": "array", "items": INT}}, extra_calls=INT),
                      lease_deadline_ms=_nullable(INT)),
    "BatchList": _obj(["batches"], batches={"type": "array", "items": _ref("BatchView")}),
    "LogEntries": _obj(["entries"], entries={"type": "array",
                                             "items": _obj(["id", "at_ms", "at"], id=STR, event=STR,
                                                           at_ms=INT, at=STR)}),
    "LeaseEnvelope": _obj(
        ["job_id", "seq", "stage", "stage_index", "attempt", "idempotency_key", "lease_token",
         "lease_deadline"],
        job_id=STR, seq=INT, stage=STR, stage_index=INT, attempt=INT, idempotency_key=STR, generation=INT,
        item_indices={"type": "array", "items": INT,
                      "description": "bisection: the batch's items this lease runs (absent: all)"},
        cursor={}, end_cursor={}, items=_nullable({"type": "array"}), input={}, params=OBJ,
        lease_token=STR, lease_deadline={**STR, "format": "date-time"}),
    "HeartbeatResult": _obj(["job_id", "seq", "lease_deadline", "job_status"], job_id=STR, seq=INT,
                            lease_deadline={**STR, "format": "date-time"}, job_status=STR),
    "CompleteResult": _obj(["job_id", "seq", "stage", "attempt", "status", "duplicate"],
                           job_id=STR, seq=INT, stage=STR, attempt=INT, status=STR, duplicate=BOOL,
                           next=_nullable(_ref("LeaseEnvelope"))),
    "FailResult": _obj(["job_id", "seq", "attempt", "outcome"], job_id=STR, seq=INT, attempt=INT,
                       outcome=STR),
    "CallbackResult": OBJ,
    "Quarantine": _obj(["job_id", "count", "items"], job_id=STR, count=INT, items={"type": "array", "items": _obj(
        ["id", "seq", "index", "item", "stage", "error"], id=STR, seq=INT, index=INT, item={},
        stage=STR, error=STR, error_type=_nullable(STR), quarantined_ms=INT)}),
    "QuarantineRetried": {"allOf": [_ref("JobView"), _obj(["quarantine_retry"], quarantine_retry=_obj(
        ["retried", "busy_batches"], retried=INT, busy_batches={"type": "array", "items": INT},
        job_status=_nullable(STR)))]},
    "Subscription": _obj(["id", "url", "events", "created_ms"], id=STR, url=STR,
                         events={"type": "array", "items": {"enum": list(EVENT_TYPES)}}, created_ms=INT),
    "SubscriptionCreated": {"allOf": [_ref("Subscription"), _obj(
        ["secret"], secret={**STR, "description": "whsec_ + base64: the signing key, shown only now"})]},
    "SubscriptionList": _obj(["subscriptions"],
                             subscriptions={"type": "array", "items": _ref("Subscription")}),
    "DeliveryList": _obj(["deliveries"], deliveries={"type": "array", "items": _obj(
        ["event_id", "attempt", "at_ms", "ok"], event_id=STR, type=STR, job_id=STR, attempt=INT, at_ms=INT,
        status=_nullable(INT), answer=STR, ok=BOOL, gave_up=BOOL)}),
    "Items": {"type": "array", "description": "the batch's items"},
    "ApprovalView": _obj(
        ["id", "job_id", "seq", "stage", "stage_index", "kind", "status", "items", "created", "deadline"],
        id=STR, job_id=STR, seq=INT, stage=_nullable(STR), stage_index=INT, round=INT,
        kind={"enum": ["stage", "platform"]},
        status={"enum": ["pending", "approved", "rejected", "void"]},
        items=_obj([], cursor={}, end_cursor={}, count=_nullable(INT)),
        shown_output={"description": "any JSON: the output of the stage the approval shows"},
        prompt={"description": "any JSON: what the platform asks (platform approvals)"},
        created={**STR, "format": "date-time"}, deadline={**STR, "format": "date-time"},
        on_timeout=_nullable({"enum": ["reject", "approve", "fail"]}),
        approvers=_nullable({"type": "array", "items": STR}),
        decision=_nullable(_obj(["decision", "actor", "decided_at"], decision=_nullable(STR), actor=STR,
                                comment=_nullable(STR), decided_at={**STR, "format": "date-time"},
                                edited_output=BOOL)),
        links={"type": "array", "description": "pending only: signed decision links",
               "items": _obj(["approver", "url"], approver=_nullable(STR), url=STR)}),
    "ApprovalList": _obj(["approvals"], approvals={"type": "array", "items": _ref("ApprovalView")},
                         next=_nullable({**STR, "description": "the next page; null on the last"})),
}

PROBLEM_TEXT = {
    400: f"malformed body: not JSON, not an object, nested deeper than {MAX_DEPTH} levels, NaN/Infinity, "
         "a number out of range, a duplicate key or a lone surrogate",
    401: "no valid bearer token (signed URLs: forged token)",
    403: "the caller may not do this (not one of the approval's approvers)",
    404: "no such resource for this tenant",
    409: "the resource's state does not allow it (stale lease, cancelled job, conflict; on a heartbeat: "
         "run-too-long, the attempt ran past its stage's max_run and was failed)",
    410: "the signed URL has expired",
    413: "the body exceeds BATCHGATE_MAX_BODY_BYTES",
    415: "a body that is not application/json",
    422: "the request failed validation (errors names each field)",
    429: "a tenant quota refuses the request (nothing was written): quota, limit and retry_after_s "
         "say which, how much and when; see Retry-After",
    500: "unexpected error; error_id identifies the log line",
    503: "the ledger (its Redis down, restarting or loading) or a source is unavailable; see Retry-After",
}
AUTH = (401,)
BODY = (400, 413, 415, 422)
SERVER = (500, 503)


@dataclass(frozen=True)
class Rule:
    """A check validation makes that JSON Schema cannot state (it spans fields, or the ledger's state):
    listed in the operation as ``x-batchgate-rules``. A 4xx of problem type ``problem`` whose detail or
    error messages match ``match`` is this rule (tests/test_schemathesis.py holds schema-valid requests
    to exactly these refusals)."""

    says: str
    problem: str
    match: str

    def document(self) -> dict[str, str]:
        return {"rule": self.says, "problem": self.problem, "match": self.match}


SOURCE_RULE = Rule("a source is checked by its type (README, Sources) and read once at creation",
                   "invalid-request", r"^(source|the source|file sources|a fetching first stage|an external "
                   r"source|the flow defines no source)")
SINK_RULE = Rule("a result sink is checked by its type (README, Result sinks): a file sink's path under "
                 "BATCHGATE_SINK_ROOTS, a new file (a flow's with {job_id}), an http sink's URL, an s3 "
                 "sink's bucket and prefix under BATCHGATE_SINK_S3_BUCKETS",
                 "invalid-request", r"sink")
FLOW_RULES = (
    Rule("stage names are unique", "invalid-request", "stage names must be unique"),
    SINK_RULE,
    Rule("only the first stage may fetch items", "invalid-request", "only the first stage may fetch"),
    Rule("a stage's max_run is at least its lease", "invalid-request", "must be at least the stage's lease"),
    Rule("a duration given as an ISO 8601 string is held to the bounds stated for seconds",
         "invalid-request", r"^Input should be (greater|less) than|^Value error, lease must be between"),
    Rule("a target is checked by its type (connectors/)", "invalid-request", r"target"),
    Rule("a target's *_secret fields name secrets the tenant has", "invalid-request", "names the secret"),
    Rule(SOURCE_RULE.says, "invalid-request", r"source|a fetching first stage|an external source"),
    Rule("an approval stage is not the first, has no target, does not fetch, shows an earlier stage and "
         "names distinct approvers", "invalid-request",
         r"approval stage|is not an earlier stage|approvers must be distinct"),
)
JOB_RULES = (
    Rule("an Idempotency-Key is used with one body only", "idempotency-mismatch", ""),
    SOURCE_RULE,
    SINK_RULE,
)
COMPLETE_RULES = (
    Rule("items come only from a job whose first stage fetches", "invalid-request",
         "items may only be sent by a fetching first stage"),
)
SUBSCRIPTION_RULES = (
    Rule("the URL passes the outbound guard (a public address, or one BATCHGATE_OUTBOUND_ALLOW admits)",
         "unsafe-url", ""),
    Rule("at most 50 subscriptions per tenant", "invalid-request", "at most 50 subscriptions"),
)
RESUME_RULES = (Rule("a cursor is checked against the job's source type", "invalid-request", "^cursor"),)


@dataclass(frozen=True)
class Route:
    method: str
    path: str
    summary: str
    ok: dict[int, tuple[str, str | None]]  # status -> (description, schema name or None)
    problems: tuple[int, ...] = ()
    body: type[BaseModel] | None = None
    body_required: bool = True
    params: tuple[dict[str, Any], ...] = ()
    public: bool = False  # no bearer token (health, the document, signed URLs)
    tags: tuple[str, ...] = field(default=())
    rules: tuple[Rule, ...] = ()
    html: bool = False  # a page for a person (signed decision links): text/html, also for errors


def _path_param(name: str, schema: dict[str, Any], example: Any, description: str) -> dict[str, Any]:
    return {"name": name, "in": "path", "required": True, "schema": schema, "example": example,
            "description": description}


def _query(name: str, schema: dict[str, Any], description: str) -> dict[str, Any]:
    return {"name": name, "in": "query", "required": False, "schema": schema, "description": description}


JOB = _path_param("job_id", {"type": "string", "maxLength": 64}, "job_0190c0ffee01a2b3c4d5e6",
                  "a job id (job_...)")
FLOW = _path_param("flow_id", {"type": "string"}, "resume-screening", "a flow id")
VERSION = _path_param("version", {"type": "string"}, "1", "a flow version")
SEQ = _path_param("seq", {"type": "integer", "minimum": 0, "maximum": 2**53}, 0, "a batch's sequence")
TOKEN = _path_param("token", {"type": "string"}, "eyJqIjoiam9iXzAxIn0.c2ln", "the signed token")
APPROVAL = _path_param("approval_id", {"type": "string", "maxLength": 100},
                       "job_0190c0ffee01a2b3c4d5e6.0.1.1", "an approval id (<job_id>.<seq>.<stage>.<round>)")
SUB = _path_param("sub_id", {"type": "string", "maxLength": 64}, "sub_0123456789abcdef",
                  "a subscription id (sub_...)")
LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 1000}, "at most this many")
#: A log entry id XRANGE takes: ``-`` (from the start), ``<ms>`` or ``<ms>-<seq>`` (19 digits each at
#: most, so every id the pattern admits is below Redis's 2^64 - 1 ceiling).
LOG_ID = f"^({jobs.LOG_ID})$"
AFTER_ID = _query("after", {"type": "string", "pattern": LOG_ID},
                  "a log entry id (1700000000000-0): entries after it")
LIST_PARAMS = (
    _query("status", {"enum": list(STATUSES)}, "only jobs in this status"),
    _query("flow_id", {"type": "string", "pattern": NAME}, "only jobs of this flow"),
    _query("flow_version", {"type": "string", "pattern": NAME}, "only this version of flow_id"),
    _query("created_after", {"type": "string", "pattern": joblist.TIME},
           "created at or after: epoch milliseconds or ISO 8601 (UTC if no zone)"),
    _query("created_before", {"type": "string", "pattern": joblist.TIME},
           "created before: epoch milliseconds or ISO 8601 (UTC if no zone)"),
    _query("order", {"enum": ["newest", "oldest"]}, "newest first (the default) or oldest first"),
    _query("cursor", {"type": "string", "pattern": joblist.CURSOR},
           "where the previous page ended, from its next link; only with the same filters"),
    LIMIT)
LIST_RULES = (
    Rule("flow_version is given only with flow_id", "invalid-request", "flow_version needs flow_id"),
    Rule("created_after is before created_before; both are real times from 1970 to 2286",
         "invalid-request", r"created_after must be before|is not a real date|is out of range"),
    Rule("a cursor is one a listing returned, used with the same filters and order", "invalid-request",
         r"^cursor "),
)
LOG_LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 10_000}, "at most this many")
IDEMPOTENCY_KEY = {"name": "Idempotency-Key", "in": "header", "required": False,
                   "schema": {"type": "string", "minLength": 1, "maxLength": 255},
                   "description": "replays the first answer to the same key and body for 24 h; the same "
                                  "key with another body is a 422 (idempotency-mismatch), while the first "
                                  "is in flight a 409; a 409 or 429 answer is not kept for the key"}
CONTROL = (404, 409, 413, 415)  # POSTs without a body model still refuse a non-JSON body

ROUTES: tuple[Route, ...] = (
    Route("get", "/healthz", "Redis answers", {200: ("Redis answers", "Health")},
          public=True, tags=("health",)),
    Route("get", "/metrics", "Prometheus metrics (text exposition format)",
          {200: ("every process's counters and the ledger's state", None)}, public=True, tags=("health",)),
    Route("get", "/livez", "Liveness: the process serves requests", {200: ("alive", "Live")},
          public=True, tags=("health",)),
    Route("get", "/readyz", "Readiness: Redis, the ledger's scripts and a live supervisor",
          {200: ("ready", "Readiness")}, (503,), public=True, tags=("health",)),
    Route("get", "/openapi.json", "This document", {200: ("the OpenAPI 3.1 document", None)},
          public=True, tags=("health",)),
    Route("post", "/v1/flows", "Register a flow version",
          {201: ("registered", "FlowRecord"), 200: ("already registered, identical", "FlowRecord")},
          (*BODY, 409), body=FlowSpec, tags=("flows",), rules=FLOW_RULES),
    Route("get", "/v1/flows", "Every version of every flow", {200: ("flows", "FlowList")},
          tags=("flows",)),
    Route("get", "/v1/flows/{flow_id}", "The latest version, and every version's name",
          {200: ("the latest version", "FlowLatest")}, (404,), params=(FLOW,), tags=("flows",)),
    Route("get", "/v1/flows/{flow_id}/versions/{version}", "One version",
          {200: ("the version", "FlowRecord")}, (404,), params=(FLOW, VERSION), tags=("flows",)),
    Route("delete", "/v1/flows/{flow_id}/versions/{version}", "Retire a version",
          {204: ("retired", None)}, (404,), params=(FLOW, VERSION), tags=("flows",)),
    Route("post", "/v1/jobs", "Create a job (or, with dry_run, plan it)",
          {201: ("created", "JobView"), 200: ("dry_run: the plan; nothing created", "JobPlan")},
          (*BODY, 404, 409, 429),
          body=JobRequest, params=(IDEMPOTENCY_KEY,), tags=("jobs",), rules=JOB_RULES),
    Route("get", "/v1/jobs", "Jobs, newest first (or oldest), filtered, paged by an opaque cursor",
          {200: ("jobs", "JobList")}, (422,), params=LIST_PARAMS, tags=("jobs",), rules=LIST_RULES),
    Route("get", "/v1/jobs/{job_id}", "A job's status, cursor, counts and progress",
          {200: ("the job", "JobView")}, (404, 409), params=(JOB,), tags=("jobs",)),
    Route("get", "/v1/jobs/{job_id}/batches", "Batch summaries in seq order",
          {200: ("batches", "BatchList")}, (404, 409, 422),
          params=(JOB, _query("status", {"enum": list(BATCH_STATUSES)}, "only batches in this status"),
                  _query("after", {"type": "integer", "minimum": -1, "maximum": 2**53},
                         "batches after this seq"), LIMIT), tags=("jobs",)),
    Route("get", "/v1/jobs/{job_id}/batches/{seq}", "One batch in full",
          {200: ("the batch", "BatchView")}, (404, 409), params=(JOB, SEQ), tags=("jobs",)),
    Route("get", "/v1/jobs/{job_id}/log", "Execution log, oldest first",
          {200: ("entries", "LogEntries")}, (404, 409, 422), params=(JOB, AFTER_ID, LOG_LIMIT),
          tags=("jobs",)),
    Route("get", "/v1/jobs/{job_id}/audit", "Control events, oldest first",
          {200: ("entries", "LogEntries")}, (404, 409, 422), params=(JOB, AFTER_ID, LOG_LIMIT),
          tags=("jobs",)),
    Route("post", "/v1/jobs/{job_id}/pause", "Stop handing out batches", {200: ("the job", "JobView")},
          CONTROL, params=(JOB,), tags=("control",)),
    Route("post", "/v1/jobs/{job_id}/release", "Let a held job run again",
          {200: ("the job", "JobView")}, CONTROL, params=(JOB,), tags=("control",)),
    Route("post", "/v1/jobs/{job_id}/cancel", "Cancel for good", {200: ("the job", "JobView")},
          (*BODY, 404, 409), body=CancelRequest, body_required=False, params=(JOB,), tags=("control",)),
    Route("post", "/v1/jobs/{job_id}/resume", "Resume, re-open, or re-plan from a cursor",
          {200: ("the job", "JobView")}, (*BODY, 404, 409), body=ResumeRequest, body_required=False,
          params=(JOB,), tags=("control",), rules=RESUME_RULES),
    Route("post", "/v1/jobs/{job_id}/migrate", "Move a paused or failed job to another flow version",
          {200: ("the job on its new version", "MigratedJob")}, (*BODY, 404, 409), body=MigrateRequest,
          params=(JOB,), tags=("control",)),
    Route("post", "/v1/jobs/{job_id}/retry-failed", "Re-open failed batches",
          {200: ("the job", "JobView")}, CONTROL, params=(JOB,), tags=("control",)),
    Route("get", "/v1/jobs/{job_id}/quarantine", "Items bisection quarantined, with the platform's error",
          {200: ("quarantined items", "Quarantine")}, (404, 409), params=(JOB,), tags=("jobs",)),
    Route("post", "/v1/jobs/{job_id}/quarantine/retry", "Run quarantined items again (some or all)",
          {200: ("the job", "QuarantineRetried")}, (*BODY, 404, 409), body=jobs.QuarantineRetryRequest,
          body_required=False, params=(JOB,), tags=("control",)),
    Route("post", "/v1/jobs/{job_id}/lease", "Lease the next ready batch (pull mode)",
          {200: ("a batch", "LeaseEnvelope"),
           204: ("nothing ready; Batchgate-Job-Status says whether to wait or stop", None)},
          (*BODY, 404, 409, 429), body=LeaseRequest, body_required=False, params=(JOB,),
          tags=("pull",)),
    Route("post", "/v1/jobs/{job_id}/batches/{seq}/heartbeat", "Extend a lease, report progress",
          {200: ("the new deadline", "HeartbeatResult")}, (*BODY, 404, 409), body=HeartbeatRequest,
          params=(JOB, SEQ), tags=("pull",)),
    Route("post", "/v1/jobs/{job_id}/batches/{seq}/complete", "Commit a stage's output",
          {200: ("committed (or the first answer again)", "CompleteResult")}, (*BODY, 404, 409),
          body=CompleteRequest, params=(JOB, SEQ), tags=("pull",), rules=COMPLETE_RULES),
    Route("post", "/v1/jobs/{job_id}/batches/{seq}/fail", "Report a failed attempt",
          {200: ("retry scheduled, or failed for good", "FailResult")}, (*BODY, 404, 409),
          body=FailRequest, params=(JOB, SEQ), tags=("pull",)),
    Route("post", "/v1/callbacks/{token}", "A platform's answer to a pushed stage (signed URL)",
          {200: ("committed (or the first answer again)", "CallbackResult")},
          (*BODY, 401, 404, 409, 410), body=CallbackAnswer, params=(TOKEN,), public=True,
          tags=("push",)),
    Route("post", "/v1/subscriptions", "Subscribe a URL to job events",
          {201: ("created; the signing secret is shown only now", "SubscriptionCreated")}, BODY,
          body=SubscriptionRequest, tags=("webhooks",), rules=SUBSCRIPTION_RULES),
    Route("get", "/v1/subscriptions", "The tenant's subscriptions",
          {200: ("subscriptions", "SubscriptionList")}, tags=("webhooks",)),
    Route("get", "/v1/subscriptions/{sub_id}", "One subscription",
          {200: ("the subscription", "Subscription")}, (404,), params=(SUB,), tags=("webhooks",)),
    Route("delete", "/v1/subscriptions/{sub_id}", "Delete a subscription",
          {204: ("deleted", None)}, (404,), params=(SUB,), tags=("webhooks",)),
    Route("get", "/v1/subscriptions/{sub_id}/deliveries", "Delivery attempts and answers, newest first",
          {200: ("deliveries", "DeliveryList")}, (404, 422),
          params=(SUB, _query("limit", {"type": "integer", "minimum": 1, "maximum": 100},
                              "at most this many")), tags=("webhooks",)),
    Route("get", "/v1/blobs/{token}", "A batch's items (signed URL)", {200: ("the items", "Items")},
          (401, 404, 410), params=(TOKEN,), public=True, tags=("push",)),
    Route("get", "/v1/approvals", "The tenant's approvals in one status, newest first, paged",
          {200: ("approvals", "ApprovalList")}, (422,),
          params=(_query("status", {"enum": ["pending", "approved", "rejected"]}, "pending (default)"),
                  _query("limit", {"type": "integer", "minimum": 1, "maximum": 200}, "at most this many"),
                  _query("cursor", {"type": "string"}, "where the previous page ended, from its next link")),
          tags=("approvals",), rules=(Rule("a cursor is one this listing made, for the same status",
                                           "invalid-request", "^cursor"),)),
    Route("get", "/v1/approvals/{approval_id}", "One approval, with signed decision links while pending",
          {200: ("the approval", "ApprovalView")}, (404,), params=(APPROVAL,), tags=("approvals",)),
    Route("post", "/v1/approvals/{approval_id}", "Decide an approval as the token's actor",
          {200: ("decided (or the same decision again: the first record)", "ApprovalView")},
          (*BODY, 403, 404, 409), body=DecisionRequest, params=(APPROVAL,), tags=("approvals",),
          rules=(Rule("only an approval may replace the shown output", "invalid-request", "^output"),)),
    Route("get", "/decide/{token}", "A signed decision link: an HTML page that shows the approval and asks",
          {200: ("the page", None)}, (401, 404, 410), params=(TOKEN,), public=True, tags=("approvals",),
          html=True),
    Route("post", "/decide/{token}", "A signed decision link's form: decides once",
          {200: ("decided", None)}, (401, 404, 409, 410, 422), params=(TOKEN,), public=True,
          tags=("approvals",), html=True),
)


def _problem_response(status: int) -> dict[str, Any]:
    resp: dict[str, Any] = {"description": PROBLEM_TEXT[status],
                            "content": {"application/problem+json": {"schema": _ref("Problem")}}}
    if status in (429, 503):
        resp["headers"] = {"Retry-After": {"schema": {"type": "integer"},
                                           "description": "seconds to wait"}}
    if status == 401:
        resp["headers"] = {"WWW-Authenticate": {"schema": {"type": "string"}}}
    return resp


def _operation(route: Route) -> dict[str, Any]:
    op: dict[str, Any] = {"summary": route.summary, "tags": list(route.tags),
                          "operationId": f"{route.method}_{route.path.strip('/')}".replace("/", "_")
                          .replace("{", "").replace("}", "").replace(".", "_").replace("-", "_")}
    if route.params:
        op["parameters"] = [copy.deepcopy(p) for p in route.params]
    if route.html:
        return _html_operation(route, op)
    if route.body is not None:
        name = route.body.__name__
        media: dict[str, Any] = {"schema": _ref(name)}
        if name in EXAMPLES:
            media["example"] = EXAMPLES[name]
        op["requestBody"] = {"required": route.body_required, "content": {"application/json": media}}
    if route.public:
        op["security"] = []
    if route.rules:
        op["x-batchgate-rules"] = [rule.document() for rule in route.rules]
        op["description"] = "Also checked (JSON Schema cannot say it): " + "; ".join(
            rule.says for rule in route.rules) + "."
    responses: dict[str, Any] = {}
    for status, (description, schema) in route.ok.items():
        resp: dict[str, Any] = {"description": description}
        if schema is not None:
            resp["content"] = {"application/json": {"schema": _ref(schema)}}
        elif route.path == "/openapi.json":
            resp["content"] = {"application/json": {"schema": OBJ}}
        elif route.path == "/metrics":
            resp["content"] = {"text/plain": {"schema": {"type": "string"}}}
        if status in (200, 204) and route.path.endswith("/lease"):
            resp["headers"] = {"Batchgate-Job-Status": {
                "schema": {"enum": list(STATUSES)}, "description": "the job's status: wait or stop"}}
        responses[str(status)] = resp
    statuses = set(route.problems) | set(SERVER if route.path != "/openapi.json" else (500,))
    if not route.public:
        statuses |= set(AUTH)
    for status in sorted(statuses):
        responses[str(status)] = _problem_response(status)
    op["responses"] = responses
    return op


def _html_operation(route: Route, op: dict[str, Any]) -> dict[str, Any]:
    """A page for a person: HTML answers (errors too), a form body for the POST."""
    page = {"text/html": {"schema": STR}}
    if route.method == "post":
        form = _obj(["decision"], decision={"enum": ["approve", "reject"]},
                    comment={**STR, "maxLength": 2000})
        op["requestBody"] = {"required": True,
                             "content": {"application/x-www-form-urlencoded": {"schema": form}}}
    op["security"] = []
    responses = {str(status): {"description": description, "content": page}
                 for status, (description, _) in route.ok.items()}
    for status in sorted(set(route.problems) | set(SERVER)):
        responses[str(status)] = {"description": PROBLEM_TEXT[status], "content": page}
    op["responses"] = responses
    return op


def request_schemas() -> dict[str, Any]:
    """JSON Schemas of every request model (and what they reference), as OpenAPI components."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # defaults that are sentinels (ABSENT) are left out
        _, top = models_json_schema([(m, "validation") for m in REQUEST_MODELS], ref_template=REF,
                                    schema_generator=_Schemas)
    defs = _json_values(top.get("$defs", {}))
    lease = defs["Stage"]["properties"]["lease"]  # Stage._positive_lease, a validator pydantic cannot show
    lease["anyOf"][0].update(minimum=LEASE_BOUNDS[0], maximum=LEASE_BOUNDS[1])
    lease["description"] = (f"time a holder has per attempt: {LEASE_BOUNDS[0]:g} s to 1 day, seconds or "
                            "an ISO 8601 duration")
    flow = defs["FlowSpec"]["properties"]
    flow["stages"]["description"] = ("stage names are unique; only the first stage may fetch; each "
                                     "stage's max_run is at least its lease")
    flow["source"]["description"] = "the items: checked by their type (README, Sources)"
    flow["sink"]["description"] = "where committed outputs go: checked by their type (README, Result sinks)"
    defs["Stage"]["properties"]["target"]["description"] = (
        "push mode: the platform workflow batchgate triggers, checked by its type (connectors/)")
    defs["CompleteRequest"]["properties"]["items"]["description"] = (
        "the batch's items: only from a job whose first stage fetches (fetches: true)")
    return {**defs, "JsonValue": JSON_VALUE}


def _json_values(node: Any) -> Any:
    """Free-form values (``Any``, ``dict[str, Any]``, ``list[Any]``) as ``JsonValue``: what the strict
    decoder takes, integers within 64 bits."""
    if isinstance(node, list):
        return [_json_values(n) for n in node]
    if not isinstance(node, dict):
        return node
    out = {}
    for key, value in node.items():
        if key == "properties":
            out[key] = {name: _any_or(_json_values(prop)) for name, prop in value.items()}
        elif key in ("additionalProperties", "items") and (value is True or value == {}):
            out[key] = {"$ref": REF.format(model="JsonValue")}
        else:
            out[key] = _json_values(value)
    return out


def _any_or(prop: dict[str, Any]) -> dict[str, Any]:
    """A property that says nothing of its type takes any JSON value."""
    if any(k in prop for k in ("type", "anyOf", "oneOf", "allOf", "$ref", "const", "enum")):
        return prop
    return {**prop, "allOf": [{"$ref": REF.format(model="JsonValue")}]}


@functools.cache
def document() -> dict[str, Any]:
    """The OpenAPI 3.1 document (built once per process)."""
    paths: dict[str, dict[str, Any]] = {}
    for route in ROUTES:
        paths.setdefault(route.path, {})[route.method] = _operation(route)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "batchgate",
            "version": "1",
            "description": (
                "External checkpoint-and-resume state service for long batch jobs. Bodies are strict "
                f"JSON (application/json, at most {MAX_DEPTH} levels deep, no NaN or Infinity, numbers "
                "in range, no duplicate keys, valid Unicode); every error is application/problem+json "
                "(RFC 9457)."),
            "license": {"name": "Apache-2.0", "identifier": "Apache-2.0"},
        },
        "servers": [{"url": "/"}],
        "security": [{"bearerAuth": []}],
        "tags": [{"name": t} for t in ("health", "flows", "jobs", "control", "pull", "push", "approvals")],
        "paths": paths,
        "components": {
            "securitySchemes": {"bearerAuth": {
                "type": "http", "scheme": "bearer",
                "description": "a token from BATCHGATE_TOKENS (or `batchgate up`'s dev token)"}},
            "schemas": {**request_schemas(), **VIEW_SCHEMAS},
        },
    }
