"""Flows: versioned, immutable job templates, validated at the edge and stored by content hash."""

from __future__ import annotations

import hashlib
import json
import time
from datetime import timedelta
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

import chunker
import connectors
from gateway.errors import FlowConflict, NotFound
from gateway.keys import Keys
from gateway.records import dumps
from gateway.validation import parse

NAME = r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$"


class RetryPolicy(BaseModel):
    """When and how often a failed stage attempt is tried again (Temporal's vocabulary)."""

    model_config = ConfigDict(extra="forbid")

    initial_interval: timedelta = timedelta(seconds=1)
    backoff_coefficient: float = Field(default=2.0, ge=1.0, le=10.0)
    maximum_interval: timedelta = timedelta(seconds=60)
    maximum_attempts: int = Field(default=3, ge=1, le=100)
    non_retryable_error_types: list[str] = Field(default_factory=list)


class Stage(BaseModel):
    """One step every batch passes through, run by a platform workflow or a pull-mode worker."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(pattern=NAME)
    lease: timedelta = Field(default=timedelta(seconds=60), description="time a holder has per attempt")
    retry: RetryPolicy = Field(default_factory=RetryPolicy)
    fetches: bool = Field(default=False, description="this stage yields the batch's items and next cursor")
    target: dict[str, Any] | None = Field(
        default=None, description="push mode: the platform workflow batchgate triggers (connectors/)")
    idempotent: bool = Field(
        default=False, description="safe to re-run after a failure that may have had effects")
    timeout: timedelta = Field(default=timedelta(seconds=30), description="per outbound call")
    poll_interval: timedelta = Field(default=timedelta(seconds=2))

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


class Batching(BaseModel):
    """How the source is cut into batches."""

    model_config = ConfigDict(extra="forbid")

    max_items: int = Field(default=100, ge=1, le=100_000)
    max_bytes: int | None = Field(default=None, ge=64)


class FlowSpec(BaseModel):
    """A flow as registered: the public contract of ``POST /v1/flows`` and the YAML files."""

    model_config = ConfigDict(extra="forbid")

    id: str = Field(pattern=NAME)
    version: str = Field(pattern=NAME)
    description: str = ""
    source: dict[str, Any] | None = None
    batching: Batching = Field(default_factory=Batching)
    stages: list[Stage] = Field(min_length=1, max_length=16)
    concurrency: int = Field(default=4, ge=1, le=1000)
    tolerated_failure_percentage: float = Field(default=0.0, ge=0.0, le=100.0)
    retention: timedelta = timedelta(days=7)

    @model_validator(mode="after")
    def _check(self) -> FlowSpec:
        names = [s.name for s in self.stages]
        if len(set(names)) != len(names):
            raise ValueError("stage names must be unique")
        if any(s.fetches for s in self.stages[1:]):
            raise ValueError("only the first stage may fetch items")
        if self.source is not None:
            self.source = validate_source(self.source, fetch_stage=self.stages[0].fetches)
        return self

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

    def register(self, tenant: str, flow: FlowSpec) -> tuple[dict[str, Any], bool]:
        """Store ``flow``; returns (record, created). Same id+version, other content: FlowConflict."""
        key = self._keys.flow(tenant, flow.id, flow.version)
        digest = flow.content_hash()
        record = {"definition": dumps(flow.model_dump(mode="json")), "hash": digest,
                  "created_ms": str(int(time.time() * 1000))}
        if self._r.hsetnx(key, "hash", digest):
            self._r.hset(key, mapping=record)
            self._r.zadd(self._keys.flows(tenant), {f"{flow.id}:{flow.version}": time.time()})
            return self._view(self._r.hgetall(key)), True
        existing = self._r.hgetall(key)
        if existing.get("hash") != digest:
            raise FlowConflict(
                f"flow {flow.id} version {flow.version} is registered with other content; "
                "register a new version instead",
                registered_hash=existing.get("hash"), submitted_hash=digest)
        return self._view(existing), False

    def get(self, tenant: str, flow_id: str, version: str | None = None) -> dict[str, Any]:
        """One version (latest registered when ``version`` is None), or NotFound."""
        if version is None:
            version = self.latest_version(tenant, flow_id)
        raw = self._r.hgetall(self._keys.flow(tenant, flow_id, version))
        if not raw.get("definition"):
            raise NotFound(f"flow {flow_id} version {version} not found")
        return self._view(raw)

    def latest_version(self, tenant: str, flow_id: str) -> str:
        """The most recently registered version of ``flow_id``."""
        for member in reversed(self._r.zrange(self._keys.flows(tenant), 0, -1)):
            fid, _, ver = member.rpartition(":")
            if fid == flow_id:
                return ver
        raise NotFound(f"flow {flow_id} not found")

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
        """Retire one version; jobs recorded on it can no longer resume."""
        if not self._r.delete(self._keys.flow(tenant, flow_id, version)):
            raise NotFound(f"flow {flow_id} version {version} not found")
        self._r.zrem(self._keys.flows(tenant), f"{flow_id}:{version}")

    @staticmethod
    def _view(raw: dict[str, str]) -> dict[str, Any]:
        definition = json.loads(raw["definition"])
        current = hashlib.sha256(dumps(definition).encode()).hexdigest()
        return {"flow": definition, "hash": raw["hash"], "content_hash": current,
                "created_ms": int(raw.get("created_ms") or 0)}


def parse_flow(payload: Any) -> FlowSpec:
    """Validate a flow definition from JSON or YAML input; InvalidRequest on bad input."""
    return parse(FlowSpec, payload, "flow definition")
