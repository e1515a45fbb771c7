"""Flows: versioned, immutable job templates, validated at the edge and stored by content hash."""

from __future__ import annotations

import hashlib
import json
import re
import time
from datetime import timedelta
from typing import Annotated, Any, Literal

import redis
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SerializerFunctionWrapHandler,
    field_validator,
    model_serializer,
    model_validator,
)

import chunker
import connectors
from gateway.errors import FlowConflict, InvalidRequest, NotFound, shown
from gateway.ledger.keys import Keys
from gateway.ledger.records import dumps
from gateway.ledger.results import parse_sink
from gateway.validation import parse

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"
_NAME = re.compile(NAME)


def is_name(value: object) -> bool:
    """Whether ``value`` is a valid flow id, version or stage name (no ``:``: keys stay unambiguous)."""
    return isinstance(value, str) and _NAME.fullmatch(value) is not None
ZERO, ONE_DAY = timedelta(0), timedelta(days=1)  # durations are positive and bounded
#: A stage attempt's maximum total run time when the flow names none: generous (a day), but finite, so a
#: platform run stuck in ``running`` or a worker heartbeating forever ends and its retry class decides.
DEFAULT_MAX_RUN = timedelta(hours=24)
MAX_RUN_ERROR = "max_run"  # the error type of an attempt that ran past its stage's max_run
MAX_MAX_RUN = timedelta(days=30)


class FlowRetired(FlowConflict):
    """The flow id and version was deleted: its tombstone keeps the label from ever being reused."""

    title = "Flow version retired"
    type_slug = "flow-retired"


# Registration and retirement act on the one hash of a flow version atomically. A retired version keeps
# its hash, created_ms and retired_ms (a tombstone) and loses its definition, so get() answers 404 and
# register() answers 409 forever, whatever the content.
_REGISTER = """
local h = redis.call('HGET', KEYS[1], 'hash')
if not h then
  redis.call('HSET', KEYS[1], 'hash', ARGV[1], 'definition', ARGV[2], 'created_ms', ARGV[3])
  return {'created', ARGV[1]}
end
local retired = redis.call('HGET', KEYS[1], 'retired_ms')
if retired then return {'retired', h, retired} end
if h ~= ARGV[1] then return {'conflict', h} end
return {'exists', h}
"""
_RETIRE = """
if redis.call('HEXISTS', KEYS[1], 'definition') == 0 then return 0 end
redis.call('HDEL', KEYS[1], 'definition')
redis.call('HSET', KEYS[1], 'retired_ms', ARGV[1])
return 1
"""


class RetryPolicy(BaseModel):
    """When and how often a failed stage attempt is tried again (Temporal's vocabulary)."""

    model_config = ConfigDict(extra="forbid")

    initial_interval: timedelta = Field(default=timedelta(seconds=1), gt=ZERO, le=ONE_DAY)
    backoff_coefficient: float = Field(default=2.0, ge=1.0, le=10.0)
    maximum_interval: timedelta = Field(default=timedelta(seconds=60), gt=ZERO, le=ONE_DAY)
    maximum_attempts: int = Field(default=3, ge=1, le=100)
    non_retryable_error_types: list[str] = Field(default_factory=list)


DEFAULT_BISECT_MAX_CALLS = 32  # about 2 * log2(50) extra calls for each of 2-3 poison items in a batch of 50
MIN_APPROVAL_TIMEOUT = timedelta(seconds=1)
MAX_APPROVAL_TIMEOUT = timedelta(days=30)


class Approval(BaseModel):
    """A stage where a person decides instead of a platform (docs/design.md "Approvals")."""

    model_config = ConfigDict(extra="forbid")

    timeout: timedelta = Field(ge=MIN_APPROVAL_TIMEOUT, le=MAX_APPROVAL_TIMEOUT,
                               description="how long a batch waits for a decision (1 s .. 30 d)")
    on_timeout: Literal["reject", "approve", "fail"] = Field(
        default="reject", description="what the supervisor decides at the deadline: reject the batch, "
        "approve it as shown, or fail the job")
    approvers: list[Annotated[str, Field(min_length=1, max_length=200)]] | None = Field(
        default=None, min_length=1, max_length=50,
        description="who may decide (the token's actor, e.g. tenant:acme, "
        "or a name a signed link was made for); none = anyone of the tenant")
    show: str | None = Field(default=None, pattern=NAME,
                             description="an earlier stage whose output the approval shows and, approved, "
                                         "commits (default: the stage just before)")

    @field_validator("approvers")
    @classmethod
    def _unique(cls, value: list[str] | None) -> list[str] | None:
        if value is not None and len(set(value)) != len(value):
            raise ValueError("approvers must be distinct names")
        return value

    @property
    def timeout_ms(self) -> int:
        return int(self.timeout.total_seconds() * 1000)


class Stage(BaseModel):
    """One step every batch passes through, run by a platform workflow or a pull-mode worker."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME)
    lease: timedelta = Field(default=timedelta(seconds=60), description="time a holder has per attempt")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    fetches: bool = Field(default=False, description="this stage yields the batch's items and next cursor")
    target: dict[str, Any] | None = Field(
        default=None, description="push mode: the platform workflow batchgate triggers (connectors/)")
    approval: Approval | None = Field(
        default=None, description="a person decides (no target): the batch waits, holding no lease")
    idempotent: bool = Field(
        default=False, description="safe to re-run after a failure that may have had effects")
    timeout: timedelta = Field(default=timedelta(seconds=30), gt=ZERO, le=ONE_DAY,
                               description="per outbound call")
    poll_interval: timedelta = Field(default=timedelta(seconds=2), gt=ZERO, le=ONE_DAY)
    max_run: timedelta = Field(
        default=DEFAULT_MAX_RUN, gt=ZERO, le=MAX_MAX_RUN,
        description="maximum total run time of one attempt (schedule-to-close), counted from the "
                    "lease (pull) or the platform call (push) across heartbeats and polls; past it the "
                    "attempt fails with error type max_run, retried only if the stage is idempotent")

    on_fatal: Literal["fail", "bisect"] = Field(
        default="fail", description="what a non-transient error does to a batch: fail it, or bisect it "
        "(run it in halves, down to single items, and quarantine the items that fail: docs/design.md "
        "\"Bisection\")")
    bisect_max_calls: int = Field(
        default=DEFAULT_BISECT_MAX_CALLS, ge=2, le=10_000,
        description="with on_fatal: bisect, the most extra calls bisection makes per batch; past it the "
                    "failing piece is quarantined whole")

    @model_serializer(mode="wrap")
    def _omit_default_max_run(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``max_run`` at its default is left out of the stored definition, so flows that do not set it
        keep the content hash they had before the field existed (re-registering them is no conflict)."""
        data = handler(self)
        if isinstance(data, dict) and self.max_run == DEFAULT_MAX_RUN:
            data.pop("max_run", None)
        if isinstance(data, dict) and self.approval is None:
            data.pop("approval", None)  # likewise: flows without approvals keep their hash
        if isinstance(data, dict) and self.on_fatal == "fail":
            data.pop("on_fatal", None)  # and without bisection
        if isinstance(data, dict) and self.bisect_max_calls == DEFAULT_BISECT_MAX_CALLS:
            data.pop("bisect_max_calls", None)
        return data

    @field_validator("target")
    @classmethod
    def _valid_target(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is None:
            return None
        return connectors.validate_target(value)

    @field_validator("lease")
    @classmethod
    def _positive_lease(cls, value: timedelta) -> timedelta:
        if not timedelta(milliseconds=50) <= value <= timedelta(days=1):
            raise ValueError("lease must be between 0.05 s and 1 day")
        return value

    @model_validator(mode="after")
    def _approval_has_no_target(self) -> Stage:
        if self.approval is not None and (self.target is not None or self.fetches):
            raise ValueError("an approval stage has no target and does not fetch")
        return self

    @model_validator(mode="after")
    def _bisects_items(self) -> Stage:
        if self.on_fatal == "bisect" and (self.fetches or self.approval is not None):
            raise ValueError("on_fatal: bisect needs a stage that runs the batch's items (not a fetching "
                             "or an approval stage)")
        return self

    @model_validator(mode="after")
    def _max_run_covers_lease(self) -> Stage:
        if self.max_run < self.lease:
            raise ValueError(f"max_run ({self.max_run.total_seconds():g} s) must be at least the stage's "
                             f"lease ({self.lease.total_seconds():g} s)")
        return self

    @property
    def max_run_ms(self) -> int:
        return int(self.max_run.total_seconds() * 1000)

    @property
    def max_run_retryable(self) -> bool:
        """A run that went past max_run may have had effects (it may still be running): it is retried
        only if the stage is idempotent and ``max_run`` is not one of its non-retryable error types."""
        return self.idempotent and MAX_RUN_ERROR not in self.retry.non_retryable_error_types


class Batching(BaseModel):
    """How the source is cut into batches."""

    model_config = ConfigDict(extra="forbid")

    max_items: int = Field(default=100, ge=1, le=100_000)
    max_bytes: int | None = Field(default=None, ge=64)


class Budget(BaseModel):
    """What one job of the flow may spend on platform calls (docs/design.md "Cost ledger"): a job whose
    spend passes it, or whose next call would at its mean cost per call, pauses with the reason."""

    # the schema says what _check says: tokens or price, or both
    model_config = ConfigDict(extra="forbid", json_schema_extra={"anyOf": [
        {"required": ["tokens"], "properties": {"tokens": {"type": "integer", "minimum": 1}}},
        {"required": ["price"], "properties": {"price": {"type": "number", "exclusiveMinimum": 0}}}]})

    tokens: int | None = Field(default=None, ge=1)
    price: float | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _check(self) -> Budget:
        if self.tokens is None and self.price is None:
            raise ValueError("a budget needs tokens or price")
        return self

    def arg(self) -> str:
        """The JSON lib.lua record_cost takes."""
        return json.dumps({k: v for k, v in (("t", self.tokens), ("p", self.price)) if v is not None})


class FlowSpec(BaseModel):
    """A flow as registered: the public contract of ``POST /v1/flows`` and the YAML files."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=NAME)
    version: str = Field(pattern=NAME)
    description: str = ""
    source: dict[str, Any] | None = None
    batching: Batching = Field(default_factory=Batching)
    stages: list[Stage] = Field(min_length=1, max_length=16)
    concurrency: int = Field(default=4, ge=1, le=10_000)
    tolerated_failure_percentage: float = Field(default=0.0, ge=0.0, le=100.0)
    retention: timedelta = Field(default=timedelta(days=7), gt=ZERO, le=timedelta(days=3650))
    sink: dict[str, Any] | None = Field(default=None, description="where committed outputs go "
                                        "(gateway/ledger/results.py); a job's own sink overrides it")
    budget: Budget | None = None

    @model_serializer(mode="wrap")
    def _omit_unset_options(self, handler: SerializerFunctionWrapHandler) -> dict[str, Any]:
        """``sink`` and ``budget`` unset are left out of the stored definition: flows without them keep
        their hash."""
        data = handler(self)
        if isinstance(data, dict):
            for name in ("sink", "budget"):
                if getattr(self, name) is None:
                    data.pop(name, None)
        return data

    @model_validator(mode="after")
    def _check(self) -> FlowSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        if any(s.fetches for s in self.stages[1:]):
            raise ValueError("only the first stage may fetch items")
        for i, stage in enumerate(self.stages):
            if stage.approval is None:
                continue
            if i == 0:
                raise ValueError("stages[0].approval: an approval stage needs an earlier stage to decide on")
            show = stage.approval.show
            if show is not None and show not in names[:i]:
                raise ValueError(f"stages[{i}].approval.show: {show!r} is not an earlier stage")
        if self.source is not None:
            self.source = validate_source(self.source, fetch_stage=self.stages[0].fetches)
        if self.sink is not None:
            try:
                self.sink = parse_sink(self.sink, in_flow=True)
            except InvalidRequest as exc:
                raise ValueError(str(exc)) from None
        return self

    def gates(self) -> dict[int, Approval]:
        """The approval stages by index."""
        return {i: s.approval for i, s in enumerate(self.stages) if s.approval is not None}

    def content_hash(self) -> str:
        """sha256 of the canonical JSON of the definition."""
        return hashlib.sha256(dumps(self.model_dump(mode="json")).encode()).hexdigest()


def validate_source(spec: dict[str, Any], *, fetch_stage: bool) -> dict[str, Any]:
    """Normalise a source spec; ``external`` sources are fed by a fetching first stage."""
    if spec.get("type") == "external":
        if not fetch_stage:
            raise ValueError("an external source needs a first stage with fetches: true")
        extra = set(spec) - {"type", "start"}
        if extra:
            raise ValueError(f"unknown fields for external source: {sorted(extra)}")
        return {"type": "external", "start": spec.get("start")}
    if fetch_stage:
        raise ValueError("a fetching first stage needs source type external")
    try:
        return chunker.validate_spec(spec)
    except chunker.SourceSpecError as exc:
        raise ValueError(f"source: {exc}") from exc


class FlowRegistry:
    """Flow versions stored per tenant; a version's content never changes once registered."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self._r = client
        self._keys = keys
        self._register = client.register_script(_REGISTER)
        self._retire = client.register_script(_RETIRE)

    def register(self, tenant: str, flow: FlowSpec) -> tuple[dict[str, Any], bool]:
        """Store ``flow``; returns (record, created).

        Same id+version with other content: FlowConflict. A retired (deleted) id+version: FlowRetired,
        even with the content it had, so a label never comes back.
        """
        key = self._key(tenant, flow.id, flow.version)
        digest = flow.content_hash()
        res = self._register(keys=[key], args=[digest, dumps(flow.model_dump(mode="json")),
                                               str(int(time.time() * 1000))])
        if res[0] == "retired":
            raise FlowRetired(
                f"flow {flow.id} version {flow.version} was deleted and is retired for good; "
                "register a new version instead", registered_hash=res[1], submitted_hash=digest,
                retired_ms=int(res[2]))
        if res[0] == "conflict":
            raise FlowConflict(
                f"flow {flow.id} version {flow.version} is registered with other content; "
                "register a new version instead",
                registered_hash=res[1], submitted_hash=digest)
        if res[0] == "created":
            self._r.zadd(self._keys.flows(tenant), {f"{flow.id}:{flow.version}": time.time()})
        raw = self._r.hgetall(key)
        if not raw.get("definition"):  # retired between the script and this read
            raise NotFound(f"flow {flow.id} version {flow.version} not found")
        return self._view(raw), res[0] == "created"

    def get(self, tenant: str, flow_id: str, version: str | None = None) -> dict[str, Any]:
        """One version (latest registered when ``version`` is None), or NotFound."""
        if version is None:
            version = self.latest_version(tenant, flow_id)
        raw = self._r.hgetall(self._key(tenant, flow_id, version))
        if not raw.get("definition"):
            raise NotFound(f"flow {shown(flow_id)} version {shown(version)} not found")
        return self._view(raw)

    def latest_version(self, tenant: str, flow_id: str) -> str:
        """The most recently registered version of ``flow_id``."""
        if is_name(flow_id):
            for member in reversed(self._r.zrange(self._keys.flows(tenant), 0, -1)):
                fid, _, ver = member.rpartition(":")
                if fid == flow_id:
                    return ver
        raise NotFound(f"flow {shown(flow_id)} not found")

    def _key(self, tenant: str, flow_id: str, version: str) -> str:
        """The key of a flow version; NotFound for an id or version no flow can have (one holding
        ``:`` would name a key of another tenant: ``acme`` + ``x:f`` = ``acme:x`` + ``f``)."""
        if not (is_name(flow_id) and is_name(version)):
            raise NotFound(f"flow {shown(flow_id)} version {shown(version)} not found")
        return self._keys.flow(tenant, flow_id, version)

    def list(self, tenant: str) -> list[dict[str, Any]]:
        """Every registered version of every flow of ``tenant``, oldest first."""
        out = []
        for member in self._r.zrange(self._keys.flows(tenant), 0, -1):
            fid, _, ver = member.rpartition(":")
            raw = self._r.hgetall(self._keys.flow(tenant, fid, ver))
            if raw.get("definition"):
                out.append(self._view(raw))
        return out

    def delete(self, tenant: str, flow_id: str, version: str) -> None:
        """Retire one version for good: it leaves a tombstone, so the id+version is never registered
        again (whatever the content), and jobs recorded on it can no longer resume."""
        key = self._key(tenant, flow_id, version)
        if not self._retire(keys=[key], args=[str(int(time.time() * 1000))]):
            raise NotFound(f"flow {shown(flow_id)} version {shown(version)} not found")
        self._r.zrem(self._keys.flows(tenant), f"{flow_id}:{version}")

    @staticmethod
    def _view(raw: dict[str, str]) -> dict[str, Any]:
        definition = json.loads(raw["definition"])
        current = hashlib.sha256(dumps(definition).encode()).hexdigest()
        return {"flow": definition, "hash": raw["hash"], "content_hash": current,
                "created_ms": int(raw.get("created_ms") or 0)}


def secret_refs(flow: FlowSpec) -> list[tuple[str, str, str]]:
    """(stage, target field, secret name) for every ``*_secret`` field of the flow's targets."""
    return [(stage.name, field, name) for stage in flow.stages
            for field, name in (stage.target or {}).items()
            if field.endswith("_secret") and isinstance(name, str) and name]


def check_secrets(flow: FlowSpec, tenant: str, available: set[str]) -> None:
    """422 when a target names a secret ``tenant`` does not have (its own or a shared ``*`` one).

    The message is the same whether another tenant has a secret of that name or nobody does.
    """
    missing = [(stage, field, name) for stage, field, name in secret_refs(flow) if name not in available]
    if missing:
        stage, field, name = missing[0]
        raise InvalidRequest(
            f"stage {stage!r}: {field} names the secret {name!r}, which tenant {tenant!r} does not have; "
            "the gateway's BATCHGATE_SECRETS must hold it under this tenant or under \"*\" (shared)",
            missing=[{"stage": s, "field": f, "secret": n} for s, f, n in missing])


def parse_flow(payload: Any) -> FlowSpec:
    """Validate a flow definition from JSON or YAML input; InvalidRequest on bad input."""
    return parse(FlowSpec, payload, "flow definition")
