"""Job service: create, view, control and resume jobs on top of the ledger and the flow registry."""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

import chunker
from gateway.errors import CorruptRecord, FlowVersionMismatch, InvalidRequest, NotFound, shown
from gateway.ledger import dryrun
from gateway.ledger.cost import cost_view
from gateway.ledger.flows import NAME, FlowRegistry, FlowSpec, validate_source
from gateway.ledger.jobindex import STATUSES as STATUSES  # re-exported (openapi)
from gateway.ledger.joblist import ListQuery, Page, list_jobs
from gateway.ledger.jobspec import JobSpec, initial_cursor, open_source, probe_source, total_hint
from gateway.ledger.ledger import ABSENT, Ledger
from gateway.ledger.migrate import migrate, settle
from gateway.ledger.planner import check_batch_bound
from gateway.ledger.progress import progress_of
from gateway.ledger import bisect
from gateway.ledger.records import loads_or_none
from gateway.ledger.results import (
    SinkState,
    check_sink_s3,
    check_sink_url,
    create_sink_file,
    compacted_batch_view,
    job_sink,
    parse_sink,
    range_view,
    summary_rows,
)

BATCH_STATUSES = ("pending", "leased", "waiting_human", "completed", "failed", "superseded")


class JobRequest(BaseModel):
    """Body of ``POST /v1/jobs``."""

    model_config = ConfigDict(extra="forbid")

    flow_id: str = Field(pattern=NAME)
    flow_version: str | None = Field(default=None, pattern=NAME)
    params: dict[str, Any] = Field(default_factory=dict)
    source: dict[str, Any] | None = None
    sink: dict[str, Any] | None = Field(default=None, description="where committed outputs go (overrides "
                                        "the flow's): jsonl/csv file, http endpoint or discard")
    dry_run: bool = Field(default=False, description="plan only: answer the batches, calls, duration and "
                          "cost the job would take (docs/design.md \"Plan\"); no job is created, no "
                          "call made")


class ResumeRequest(BaseModel):
    """Body of ``POST /v1/jobs/<id>/resume`` (all optional)."""

    model_config = ConfigDict(extra="forbid")

    cursor: Any = Field(default=ABSENT, description="re-plan from this cursor (rewind or skip)")
    reason: str = Field(default="", max_length=500)


class MigrateRequest(BaseModel):
    """Body of ``POST /v1/jobs/<id>/migrate``."""

    model_config = ConfigDict(extra="forbid")

    flow_version: str = Field(pattern=NAME, description="the version of the job's flow to move to")
    reason: str = Field(min_length=1, max_length=500, description="why, for the audit trail")


_JOB_ID = re.compile(r"job_[A-Za-z0-9_-]{1,60}")


def is_job_id(value: str) -> bool:
    """Whether ``value`` can be a job id: ``job_`` and up to 60 of ``[A-Za-z0-9_-]`` (new_job_id makes
    23 hex digits); never ``{``, ``}`` or ``:``, which would change the job's key names."""
    return _JOB_ID.fullmatch(value) is not None


def new_job_id() -> str:
    """Time-ordered, unguessable job id."""
    return f"job_{int(time.time() * 1000):011x}{secrets.token_hex(6)}"


class JobService:
    """The job operations the API and the CLI share."""

    def __init__(self, ledger: Ledger, flows: FlowRegistry) -> None:
        self.ledger = ledger
        self.flows = flows

    def create(self, tenant: str, req: JobRequest, job_id: str | None = None) -> dict[str, Any]:
        """Create a job (under ``job_id`` if given: the id a quota admitted); reads (and drops) at most
        the source's first batch, to refuse an unreadable one."""
        spec, inline = self.prepare(tenant, req, job_id or new_job_id())
        create_sink_file(spec.sink, self.ledger.settings, tenant)  # the last check: it makes the file
        self.ledger.create_job(spec, initial_cursor(spec.source, len(inline or ())), inline)
        return self.view(tenant, spec.job_id)

    def prepare(self, tenant: str, req: JobRequest, job_id: str) -> tuple[JobSpec, list | None]:
        """The spec a job made from ``req`` would have, and its inline items, checked as creation checks
        them (the flow, the source, the batch bound, the source's first batch); nothing is written."""
        record = self.flows.get(tenant, req.flow_id, req.flow_version)
        flow = FlowSpec.model_validate(record["flow"])
        source = req.source if req.source is not None else flow.source
        if source is None:
            raise InvalidRequest("the flow defines no source; give one in the job's source field")
        inline = source.get("items") if source.get("type") == "inline" else None
        try:
            source = validate_source(source, fetch_stage=flow.stages[0].fetches)
        except ValueError as exc:
            raise InvalidRequest(str(exc)) from exc
        if inline is not None:
            source = {"type": "inline", "count": len(inline)}
        check_batch_bound(flow.batching, source, self.ledger.settings)  # 422 before the probe reads
        # 422/503 now rather than failing every lease later; a path must be one the tenant may read
        total_bytes = probe_source(source, flow, self.ledger.settings, tenant)
        sink = job_sink(parse_sink(req.sink) if req.sink is not None else flow.sink, job_id)
        if sink and sink["type"] == "http":
            check_sink_url(sink["url"], self.ledger.settings)
        check_sink_s3(sink, self.ledger.settings, tenant)
        spec = JobSpec(job_id=job_id, tenant=tenant, flow=flow, flow_hash=record["hash"],
                       source=source, params=req.params,
                       total_hint=total_hint(source, len(inline) if inline is not None else None),
                       total_bytes=total_bytes, key_scheme="range", sink=sink)
        return spec, inline

    def plan(self, tenant: str, req: JobRequest, target_id: Any) -> dict[str, Any]:
        """A dry run (dryrun.py): what the job would take; nothing is written, no platform called."""
        spec, inline = self.prepare(tenant, req, "job_dryrun")
        return dryrun.plan(spec, inline, self.ledger.r, self.ledger.keys, self.ledger.settings, target_id)

    def owned_spec(self, tenant: str, job_id: str) -> JobSpec:
        """The job's spec if ``tenant`` owns it; NotFound otherwise (no hint that it exists)."""
        if not is_job_id(job_id):
            raise NotFound(f"job {shown(job_id)} not found")
        spec = self.ledger.spec(job_id)
        if spec.tenant != tenant:
            raise NotFound(f"job {job_id} not found")
        return spec

    def view(self, tenant: str, job_id: str) -> dict[str, Any]:
        """Status, committed cursor, batch counts, progress, rate and ETA."""
        spec = self.owned_spec(tenant, job_id)
        job, leased = self.ledger.job_and_leases(job_id)
        view = self.render(spec, job_id, job, leased)
        if spec.sink:
            state = SinkState.from_fields(self.ledger.r.hgetall(self.ledger.keys.job(job_id).sink))
            view["sink"] = state.view(spec.sink, int(job["wm"]))
        view["cost"] = self.cost(tenant, job_id, spec)
        return view

    def cost(self, tenant: str, job_id: str, spec: JobSpec | None = None) -> dict[str, Any]:
        """The job's cost ledger (cost.py): calls, paid and redone calls, tokens, price, per stage."""
        spec = spec or self.owned_spec(tenant, job_id)
        return cost_view(spec, self.ledger.r.hgetall(self.ledger.keys.job(job_id).cost))

    @staticmethod
    def render(spec: JobSpec, job_id: str, job: dict[str, str], leased: int) -> dict[str, Any]:
        """The view of a job from its spec, its (checked) record and its number of leased batches."""
        done, total = int(job["items_done"]), spec.total_hint
        if total is None and job["exhausted"] == "1":  # read to the end: the count is known now
            total = max(int(job.get("items_planned") or 0), done) or None
        created, updated = int(job["created_ms"]), int(job["updated_ms"])
        elapsed_s = max((updated - created) / 1000, 1e-3)
        rate = done / elapsed_s if done else 0.0
        # items_done counts the current plan; after a cursor move the plan starts at its offset
        plan_cursor = loads_or_none(job.get("plan_cursor"))
        start = plan_cursor.get("offset", 0) if isinstance(plan_cursor, dict) and total else 0
        position = min(done + (start if isinstance(start, int) else 0), total or 0)
        remaining = None if total is None else max(total - position, 0)
        view = {
            "job_id": job_id,
            "status": job["status"],
            "corrupt": bool(job.get("corrupt")),
            "flow": {"id": spec.flow.id, "version": spec.flow.version, "hash": spec.flow_hash,
                     # the version and hash it ran before its last migration (None: never migrated)
                     "previous": {"version": spec.prev_flow_version, "hash": spec.prev_flow_hash}
                     if spec.spec_gen else None},
            "params": spec.params,
            "stages": [s.name for s in spec.flow.stages],
            "push_stages": [s.name for s in spec.flow.stages if s.target is not None],
            "committed_cursor": loads_or_none(job["committed_cursor"]),
            "committed_seq": int(job["wm"]) - 1,
            "batches": {"planned": int(job["next_seq"]) - int(job["base_seq"]),
                        "completed": int(job["n_done"]),
                        "failed": int(job["n_failed"]), "open": int(job["n_open"]),
                        "leased": leased},
            # succeeded within its failure budget, with batches whose items were never stored
            "retryable_failed": int(job["n_failed"]) if job["status"] == "succeeded" else 0,
            "items_done": done,
            # items bisection set apart (GET /v1/jobs/<id>/quarantine); they count against the budget
            "items_quarantined": int(job.get("n_quar") or 0),
            "items_planned": int(job.get("items_planned") or 0),
            "items_total": total,
            "progress": None if not total else round(position / total, 4),
            "rate_items_per_s": round(rate, 2),
            "eta_s": None if remaining is None or not rate else round(remaining / rate, 1),
            "source_exhausted": job["exhausted"] == "1",
            "error": job.get("error") or None,
            "held_reason": job.get("held_reason") or None,
            # why the job paused itself (its cost budget, lib.lua record_cost); None after a resume
            "paused_reason": (job.get("paused_reason") or None) if job["status"] == "paused" else None,
            "source_error": job.get("src_error") or None,
            # batches waiting for an unavailable platform target (no attempt spent while they wait)
            "waiting": {"reason": job["waiting"], "target": job.get("waiting_target") or None,
                        "since_ms": int(job.get("waiting_since_ms") or 0) or None,
                        "retry_at_ms": int(job.get("waiting_until_ms") or 0) or None}
            if job.get("waiting") else None,
            "created_ms": created,
            "updated_ms": updated,
            "finished_ms": int(job["finished_ms"]) if job.get("finished_ms") else None,
        }
        waiting = int(job.get("n_waiting") or 0)
        if waiting or spec.flow.gates():  # batches waiting for a person (flows with approval stages)
            view["batches"]["waiting_human"] = waiting
        return view | progress_of(spec, job)  # files: progress and ETA by bytes

    def list(self, tenant: str, query: ListQuery) -> Page:
        """One page of the tenant's jobs, filtered and ordered by the job index (joblist.py)."""
        return list_jobs(self, tenant, query)

    def batches(self, tenant: str, job_id: str, status: str | None, after: int,
                limit: int) -> list[dict[str, Any]]:
        """Batch summaries in seq order from ``after`` + 1, optionally filtered by status."""
        if status is not None and status not in BATCH_STATUSES:
            raise InvalidRequest(f"status must be one of {', '.join(BATCH_STATUSES)}")
        spec = self.owned_spec(tenant, job_id)
        k = self.ledger.keys.job(job_id)
        planned = int(self.ledger.job_fields(job_id)["next_seq"])
        out: list[dict[str, Any]] = []
        start = after + 1
        if spec.sink:  # delivered batches below the sink cursor are range summaries: a row per range
            compacted, rows = self.compacted(job_id)
            for row in rows:
                if row["last"] >= start and len(out) < limit and _range_has(row, status):
                    out.append(range_view(row))
            start = max(start, compacted)
        while start < planned and len(out) < limit:
            seqs = range(start, min(start + 500, planned))
            pipe = self.ledger.r.pipeline(transaction=False)
            for seq in seqs:
                pipe.hgetall(k.batch(seq))
            for fields in pipe.execute():
                if fields and (status is None or fields.get("status") == status):
                    out.append(batch_view(spec, fields, full=False))
                    if len(out) >= limit:
                        break
            start = seqs.stop
        return out

    def compacted(self, job_id: str) -> tuple[int, list[dict[str, Any]]]:
        """The seq below which a job's batch records are summaries, and the summaries (one MULTI)."""
        fields = self.ledger.r.hgetall(self.ledger.keys.job(job_id).sink)
        return int(fields.get("seq") or 0), summary_rows(fields)

    def batch(self, tenant: str, job_id: str, seq: int) -> dict[str, Any]:
        """One batch in full: cursors, stage statuses, outputs, errors; a batch compacted after its
        delivery to the job's sink is shown as the range summary that stands for it."""
        spec = self.owned_spec(tenant, job_id)
        fields = self.ledger.r.hgetall(self.ledger.keys.job(job_id).batch(seq))
        if not fields and spec.sink:
            for row in self.compacted(job_id)[1]:
                if row["first"] <= seq <= row["last"]:
                    return compacted_batch_view(row, seq)
        if not fields:
            raise NotFound(f"job {job_id} has no batch {seq}")
        return batch_view(spec, fields, full=True)

    def resume(self, tenant: str, job_id: str, req: ResumeRequest, actor: str) -> dict[str, Any]:
        """Resume on the recorded flow version only; re-open uncommitted batches or re-plan."""
        spec = self.owned_spec(tenant, job_id)
        self.check_flow_version(spec)
        job = self.ledger.job_fields(job_id)
        if job.get("corrupt"):
            raise CorruptRecord(f"job {job_id} failed its checksum; it will not run")
        settle(self.ledger, job)  # a job migrated a moment ago: every process sees its new spec first
        result: dict[str, Any] = {"reopened": 0}
        if req.cursor is not ABSENT:
            self._check_cursor(spec, req.cursor)
            result.update(self.ledger.replan(job_id, req.cursor, actor, req.reason))
        else:  # the script decides by the status it reads: paused runs, others re-open, final refuse
            result["reopened"] = self.ledger.reopen(job_id, actor)
        return {**self.view(tenant, job_id), "resume": result}

    def migrate(self, tenant: str, job_id: str, req: MigrateRequest, actor: str) -> dict[str, Any]:
        """Move a paused or failed job to another version of its flow (migrate.py); resume runs it."""
        spec = self.owned_spec(tenant, job_id)
        record = self.flows.get(tenant, spec.flow.id, req.flow_version)
        if record["hash"] != record["content_hash"]:
            raise CorruptRecord(f"flow {spec.flow.id} version {req.flow_version} no longer hashes as "
                                "registered; it will not be used")
        flow = FlowSpec.model_validate(record["flow"])
        result = migrate(self.ledger, spec, flow, record["hash"], actor, req.reason)
        return {**self.view(tenant, job_id), "migration": result}

    def check_flow_version(self, spec: JobSpec) -> None:
        """Refuse when the job's flow version is gone or its definition no longer hashes the same."""
        try:
            record = self.flows.get(spec.tenant, spec.flow.id, spec.flow.version)
        except NotFound:
            raise FlowVersionMismatch(
                f"flow {spec.flow.id} version {spec.flow.version} is gone; the job recorded "
                f"hash {spec.flow_hash}", recorded_hash=spec.flow_hash, current_hash=None) from None
        current = record["content_hash"]
        if record["hash"] != spec.flow_hash or current != spec.flow_hash:
            raise FlowVersionMismatch(
                f"flow {spec.flow.id} version {spec.flow.version} changed: the job recorded hash "
                f"{spec.flow_hash}, the registry now holds {current}",
                recorded_hash=spec.flow_hash, current_hash=current)

    @staticmethod
    def _check_cursor(spec: JobSpec, cursor: Any) -> None:
        if spec.external:
            return
        try:
            open_source(spec.source, inline_items=()).validate_cursor(cursor)
        except chunker.SourceSpecError as exc:
            raise InvalidRequest(f"cursor: {exc}") from exc


def _range_has(row: dict[str, Any], status: str | None) -> bool:
    """Whether a range summary holds batches of ``status`` (None: any)."""
    return (status is None or status == "completed" and row["batches"] > 0
            or status == "superseded" and row["superseded"] > 0)


def batch_view(spec: JobSpec, fields: dict[str, str], full: bool) -> dict[str, Any]:
    """Public JSON for one batch."""
    names = [s.name for s in spec.flow.stages]
    stage = int(fields.get("stage") or 0)
    view: dict[str, Any] = {
        "seq": int(fields["seq"]),
        "status": "corrupt" if fields.get("corrupt") else fields.get("status"),
        "stage": names[stage] if stage < len(names) else None,
        "attempt": int(fields.get("attempt") or 0),
        "cursor": loads_or_none(fields.get("start_cursor")),
        "end_cursor": loads_or_none(fields.get("end_cursor")),
        "items": int(fields.get("n_items") or 0),
        "error": fields.get("error") or None,
        # outcome_unknown: the flow may have run and its outcome could not be learned (never re-run)
        "error_type": fields.get("error_type") or None,
        # attempts that count against maximum_attempts (a wait for an unavailable target does not)
        "attempts_spent": int(fields.get("attempt") or 0) - int(fields.get("unspent") or 0),
    }
    if fields.get("approval"):  # waiting for a person: GET /v1/approvals/<id>
        view["approval_id"] = fields["approval"]
    view |= bisect.batch_fields(fields)  # run in pieces, quarantined items (bisection)
    if full:
        view["stages"] = {
            name: {"status": fields.get(f"st:{i}", "pending"),
                   "output": loads_or_none(fields.get(f"out:{i}"))}
            for i, name in enumerate(names)}
        view["progress"] = loads_or_none(fields.get("progress"))
        deadline = fields.get("deadline_ms")
        view["lease_deadline_ms"] = int(deadline) if deadline else None
    return view
