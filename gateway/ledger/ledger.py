"""The batch ledger: every fact about a job lives in Redis and changes only through the Lua scripts."""

from __future__ import annotations

import functools
import logging
import random
import secrets
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis

import chunker
from connectors.base import Usage
from gateway import metrics
from gateway.errors import (
    Conflict,
    CorruptRecord,
    InvalidRequest,
    JobCancelled,
    NotFound,
    RunTooLong,
    SourceUnavailable,
    StaleLease,
)
from gateway.ledger import archive, bisect
from gateway.ledger import due as due_index
from gateway.ledger.approvals import ApprovalOps, Approvals, gate_keys, gates_arg
from gateway.ledger.control import ControlOps
from gateway.ledger.creations import CreationJournal
from gateway.ledger.jobindex import Filed, JobIndex
from gateway.ledger.jobspec import JobSpec, RedisListView
from gateway.ledger.keys import JobKeys, Keys
from gateway.ledger.multi import multi
from gateway.ledger.planner import batches_per_plan, cut_batches
from gateway.ledger.quarantine import QuarantineOps
from gateway.ledger.records import digest, dumps, intact, loads_or_none, seal
from gateway.ledger.scripts import Scripts
from gateway.settings import Settings

log = logging.getLogger(__name__)

ABSENT = object()
LEASE_PATIENCE_S = 5.0  # how long a lease waits for another caller's planning before "nothing ready"
PLAN_AHEAD = 16  # batches one plan cuts where the source is cheap to read ahead (Ledger.plan_ahead)
PLAN_LOCK_MS = 30_000  # one reader of the source per job at a time; the lock expires if it dies
SPEC_RECHECK_S = 1.0  # a cached spec is checked against the job's spec_gen at most this often (spec())


@dataclass(frozen=True)
class Lease:
    """A leased batch stage: the envelope a worker or platform receives."""

    job_id: str
    seq: int
    stage: str
    stage_index: int
    attempt: int
    cursor: Any
    end_cursor: Any
    items: list[Any] | None
    input: Any
    params: dict[str, Any]
    lease_token: str
    lease_deadline_ms: int
    idempotency_key: str  # JobSpec.stage_key: stable per item range across attempts and re-plans
    generation: int = 0  # how many times the job was re-planned from a cursor before this batch
    piece: list[int] | None = None  # the batch's item indices this lease runs (bisection); None = all

    def envelope(self) -> dict[str, Any]:
        """The public, stable JSON envelope (README: pull mode)."""
        return {
            "job_id": self.job_id,
            "seq": self.seq,
            "stage": self.stage,
            "stage_index": self.stage_index,
            "attempt": self.attempt,
            "idempotency_key": self.idempotency_key,
            "generation": self.generation,
            "cursor": self.cursor,
            "end_cursor": self.end_cursor,
            "items": self.items,
            "input": self.input,
            "params": self.params,
            "lease_token": self.lease_token,
            "lease_deadline": _iso(self.lease_deadline_ms),
        } | ({} if self.piece is None else {"item_indices": self.piece})


def _iso(ms: int) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


class NextLeaseRefused(Exception):
    """complete_and_lease committed (``done``, its answer) but the lease quota refused the next lease
    (``refusal``, the 429 a lease would have had)."""

    def __init__(self, done: dict[str, Any], refusal: Exception) -> None:
        super().__init__(str(refusal))
        self.done, self.refusal = done, refusal


def with_quota(keys: list[str], args: list[Any], quota: Any) -> tuple[list[str], list[Any]]:
    """lease.lua's KEYS and ARGV with a request's lease quota (quotas.LeaseQuota) to count: the
    tenant's rate key before the outbox (always the last key), the limit and period after the pairs."""
    return [*keys[:-1], quota.key, keys[-1]], [*args, quota.limit, quota.period_ms]


class Ledger(ControlOps, ApprovalOps, QuarantineOps):
    """Operations on jobs and batches; one instance per Redis client."""

    def __init__(self, client: redis.Redis, settings: Settings) -> None:
        self.r = client
        self.settings = settings
        self.keys = Keys(settings.key_prefix, settings.due_shards)
        self.index = JobIndex(client, self.keys, self.spec)  # follows every job script's status change
        #: a Redis Cluster: a tenant's keys live in other slots than a job's, so no script takes both
        self.cluster = isinstance(client, redis.RedisCluster)
        self.creations = CreationJournal(self.index, self.cancel)  # cluster: creations cut between slots
        if settings.redis_wait_replicas:  # durable commits: WAIT after each (JobIndex.run)
            self.index.wait = (settings.redis_wait_replicas,
                               int(settings.redis_wait_timeout.total_seconds() * 1000))
        self.scripts = Scripts.register(client, self.index)
        self._specs: OrderedDict[str, tuple[JobSpec, float]] = OrderedDict()  # spec, seen current at
        self._specs_lock = threading.Lock()  # gunicorn threads share the cache
        # lease.lua's KEYS and fixed ARGV per (job, stages, lease_ms), built from the cached spec
        self._lease_calls: OrderedDict[tuple, tuple[JobSpec, list[str], list[Any], list[Any]]] = OrderedDict()
        self.approvals = Approvals(self)  # approval records, decisions, the tenant's listing
        self.plan_ahead = PLAN_AHEAD
        self.spec_cache = settings.spec_cache  # specs (and lease calls) kept, least recently used dropped
        self._checked = False

    def check_digest_agreement(self) -> None:
        """Fail loudly if Redis's Lua sorts differently from Python (non-C collation)."""
        if self._checked:
            return
        sample = {"n_done": "1", "next_seq": "2", "st:0": "x", "start_cursor": "{}", "c:0": "1 t",
                  "committed_cursor": "null", "B": "upper", "a-b": "dash", "a_b": "underscore"}
        flat = [part for pair in sample.items() for part in pair]
        if self.scripts.selfcheck(keys=[], args=flat) != digest(sample):
            raise RuntimeError("this Redis's Lua sorts strings in another order than Python (is it "
                               "running under a non-C locale?); run redis-server with LC_ALL=C")
        self._checked = True

    # -- records ---------------------------------------------------------------------------

    def spec(self, job_id: str) -> JobSpec:
        """The job's spec (cached, LRU-bounded), or NotFound / CorruptRecord.

        A spec changes only by a flow migration (migrate.py), which raises the job hash's ``spec_gen``
        in the same script. A cached spec is trusted for SPEC_RECHECK_S after it was last seen current,
        then checked against ``spec_gen`` (one HGET) and read again if it is old; a migrated job resumes
        only SPEC_SETTLE_S after its migration (migrate.settle), so by the time anything runs again no
        process holds a spec it has not seen current since the migration. The hot path (lease,
        heartbeat, complete) costs no extra round trip.
        """
        now = time.monotonic()
        with self._specs_lock:
            cached = self._specs.get(job_id)
            if cached is not None and now - cached[1] < SPEC_RECHECK_S:
                self._specs.move_to_end(job_id)
                return cached[0]
        if cached is not None and self._spec_gen(job_id) == cached[0].spec_gen:
            with self._specs_lock:
                self._specs[job_id] = (cached[0], now)
                self._specs.move_to_end(job_id)
            return cached[0]
        return self.spec_from(job_id, archive.spec_fields(self.r, self.keys.job(job_id)))

    def fresh_spec(self, job_id: str) -> JobSpec | None:
        """The cached spec if it was seen current within SPEC_RECHECK_S (no round trip), else None."""
        with self._specs_lock:
            cached = self._specs.get(job_id)
        return cached[0] if cached is not None and time.monotonic() - cached[1] < SPEC_RECHECK_S else None

    def spec_from(self, job_id: str, fields: dict[str, str]) -> JobSpec:
        """The spec from its hash as just read (cached), or NotFound / CorruptRecord as spec() says;
        lets a caller read many specs in one pipeline (the job listing)."""
        if not fields:
            raise NotFound(f"job {job_id} not found")
        if not intact(fields):
            self.r.hset(self.keys.job(job_id).spec, "corrupt", "1")
            raise CorruptRecord(f"job {job_id} spec failed its checksum; it will not run")
        spec = JobSpec.from_fields(fields)
        with self._specs_lock:
            self._specs[job_id] = (spec, time.monotonic())
            while len(self._specs) > self.spec_cache:
                self._specs.popitem(last=False)
        return spec

    def _spec_gen(self, job_id: str) -> int:
        """The job hash's spec generation (0 until a migration; a missing job reads 0 too)."""
        return int(self.r.hget(self.keys.job(job_id).job, "spec_gen") or 0)

    def forget(self, job_id: str) -> None:
        """Drop the job's cached spec (the supervisor, once the job is finished and retired)."""
        with self._specs_lock:
            self._specs.pop(job_id, None)
            for key in [key for key in self._lease_calls if key[0] == job_id]:
                del self._lease_calls[key]

    def job_fields(self, job_id: str) -> dict[str, str]:
        """The job hash, checked against its checksum; a corrupt one is marked."""
        return self._checked_job(job_id, self.r.hgetall(self.keys.job(job_id).job))

    def job_and_leases(self, job_id: str) -> tuple[dict[str, str], int]:
        """The job hash (checked) and its number of leased batches, read at one instant (MULTI): a
        view never shows a lease of a batch its counters do not hold yet."""
        k = self.keys.job(job_id)
        pipe = multi(self.r)
        pipe.hgetall(k.job)
        pipe.zcard(k.leases)
        fields, leased = pipe.execute()
        return self._checked_job(job_id, fields), int(leased)

    def checked(self, job_id: str, fields: dict[str, str]) -> dict[str, str]:
        """A job hash read by the caller, checked against its checksum (a corrupt one is marked)."""
        return self._checked_job(job_id, fields)

    def _checked_job(self, job_id: str, fields: dict[str, str]) -> dict[str, str]:
        k = self.keys.job(job_id)
        if not fields:
            raise NotFound(f"job {job_id} not found")
        if not intact(fields):
            self.r.hset(k.job, "corrupt", "1")
            fields["corrupt"] = "1"
        return fields

    def create_job(self, spec: JobSpec, first_cursor: Any, inline_items: list | None) -> None:
        """Write a new job: its spec, its state at cursor ``first_cursor``, its indexes."""
        k = self.keys.job(spec.job_id)
        now = str(int(time.time() * 1000))
        cursor = dumps(first_cursor)
        state = {
            "status": "running", "created_ms": now, "updated_ms": now,
            "finished_ms": "", "next_seq": "0", "base_seq": "0", "wm": "0", "frontier": cursor,
            "committed_cursor": cursor, "plan_cursor": cursor, "exhausted": "0", "blocked": "",
            "n_open": "0", "n_done": "0", "n_failed": "0", "items_done": "0", "error": "",
            "src_failures": "0", "src_error": "", "src_retry_ms": "0", "held_reason": "",
        }
        self.creations.begin(spec.job_id, int(now))  # cluster: the MULTI below is one per slot
        pipe = multi(self.r)
        for start in range(0, len(inline_items or []), 1000):
            pipe.rpush(k.src, *[dumps(i) for i in inline_items[start:start + 1000]])
        pipe.hset(k.spec, mapping=seal(spec.to_fields()))
        pipe.hset(k.job, mapping=seal(state))
        pipe.xadd(k.log, {"event": "job_created", "cursor": cursor},
                  maxlen=self.settings.log_maxlen, approximate=True)
        pipe.xadd(k.audit, {"event": "job_created", "cursor": cursor, "actor": f"tenant:{spec.tenant}",
                            "flow": f"{spec.flow.id}@{spec.flow.version}"})
        pipe.zadd(self.keys.jobs(spec.tenant), {spec.job_id: int(now)})
        self.index.file(pipe, spec.tenant, spec.job_id,
                        Filed("running", spec.flow.id, spec.flow.version, int(now)))
        pipe.sadd(self.keys.active, spec.job_id)
        if spec.sink:  # results.py: the sink deliverer follows it
            pipe.sadd(self.keys.sink_jobs, spec.job_id)
        pipe.zadd(self.keys.due_for(spec.job_id), {spec.job_id: float("inf")})  # watched; nothing due until a lease
        pipe.execute()
        self.creations.end(spec.job_id)
        log.info("job created job_id=%s flow=%s@%s", spec.job_id, spec.flow.id, spec.flow.version)

    # -- pull mode -------------------------------------------------------------------------

    def lease(self, job_id: str, stage: str | None = None, quota: Any = None) -> Lease | None:
        """Lease the next ready pull-mode stage (planning a new batch if needed); None if none is ready.

        Stages with a platform ``target`` are left to the dispatcher (push mode). ``quota``: the
        request's lease quota (quotas.LeaseQuota), counted by lease.lua in the same script.
        """
        spec = self.spec(job_id)
        return self.lease_stages(job_id, self._stage_filter(spec, stage), quota=quota)

    def lease_stages(self, job_id: str, stages: list[int], lease_ms: int | None = None,
                     first: tuple[list, str, str, int] | None = None, quota: Any = None) -> Lease | None:
        """Lease the next ready batch at one of ``stages`` (indices); None only when nothing is ready.

        ``lease_ms`` overrides the stage's lease length (push mode: the dispatch queue timeout, until
        begin.lua restarts the clock with the stage's lease when the call starts).

        One round trip when a batch is ready (lease.lua checks the job, reads the ready sets and leases in
        one script); two when batches must be planned first (lease.lua takes the plan lock and says where
        to read, plan.lua records up to ``plan_ahead`` batches and leases the first). A caller that finds
        another one planning waits for its batches, for up to LEASE_PATIENCE_S, so a lost race never
        surfaces as "nothing ready". ``first`` is lease.lua's answer already had (complete_and_lease),
        with the lease token, plan lock holder and read-ahead it was asked with.

        ``quota`` (quotas.LeaseQuota, a pull request's): the first lease.lua call counts it in its own
        script (no round trip of its own) and a refusal raises its 429; the later calls of the same
        request (after planning) are not counted again.
        """
        if not stages:
            if quota is not None:
                quota.admit()  # counted all the same, as every lease request is
            return None
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        patience = time.monotonic() + LEASE_PATIENCE_S
        pause = 0.001
        while True:
            if first is not None:
                res, token, holder, ahead = first
                first = None
            else:
                keys, args, token, holder, ahead = self._lease_args(spec, tuple(stages), lease_ms)
                hint = self._min_lease(args)
                if quota is not None:  # the request's first call counts it
                    keys, args = with_quota(keys, args, quota)
                with due_index.hinted(job_id, hint):  # its due entry, same round trip
                    res = self.scripts.lease(keys=keys, args=args)
            tag = res[0]
            if tag == "rate":
                raise quota.refusal(int(res[1]))
            quota = None
            if tag == "ok":
                _, seq, idx, attempt, deadline, start, end, items, prev, gen = res[:10]
                return self._lease_from(spec, int(idx), token, int(seq), attempt, deadline, start, end,
                                        items, prev, gen, res[10] if len(res) > 10 else "")
            if tag in ("none", "busy", "status"):
                return None
            if tag == "corrupt":
                raise CorruptRecord(f"job {job_id} failed its checksum; it will not run")
            if tag == "source_wait":
                wait_ms = max(int(res[1]) - int(time.time() * 1000), 1)
                raise SourceUnavailable(f"source of job {job_id} unavailable: {res[2]}",
                                        retry_after=timedelta(milliseconds=wait_ms))
            if tag == "plan":
                got = self._plan(spec, k, res, holder, token, ahead, lease_ms)
                if got is not None:
                    return got
            else:  # 'planning': another caller is reading the source; its batches come soon
                time.sleep(pause)
                pause = min(pause * 2, 0.05)
            if time.monotonic() > patience:
                log.warning("lease gave up waiting for a planner job_id=%s", job_id)
                return None

    def _lease_args(self, spec: JobSpec, stages: tuple[int, ...],
                    lease_ms: int | None) -> tuple[list[str], list[Any], str, str, int]:
        """lease.lua's KEYS and ARGV for one call (a fresh lease token, which is also the plan lock's
        holder when the first stage is offered), with the token, holder and read-ahead."""
        keys, fixed, pairs = self._lease_call(spec, self.keys.job(spec.job_id), stages, lease_ms)
        plans = 0 in stages
        ahead = self._plan_ahead(spec) if plans else 0
        inline = plans and spec.source["type"] == "inline"
        prefetch = ahead * spec.flow.batching.max_items + 1 if inline else 0  # the items plans read
        token = secrets.token_urlsafe(16)
        holder = token if plans else ""  # the plan lock's holder: this lease's random token
        return keys, [token, *fixed, holder, PLAN_LOCK_MS, prefetch, *pairs], token, holder, ahead

    @staticmethod
    def _min_lease(args: list[Any]) -> int:
        """The shortest lease length among lease.lua's (stage, lease ms) pairs (ARGV[10..])."""
        return min(args[10::2])

    def _lease_call(self, spec: JobSpec, k: JobKeys, stages: tuple[int, ...],
                    lease_ms: int | None) -> tuple[list[str], list[Any], list[Any]]:
        """lease.lua's KEYS, its ARGV[2..5] and its (stage, lease ms) pairs for these stages, kept beside
        the cached spec (both never change for a job)."""
        cache_key = (spec.job_id, stages, lease_ms)
        cached = self._lease_calls.get(cache_key)
        if cached is None or cached[0] is not spec:
            ordered = sorted(stages, reverse=True)  # the latest stage first: finish batches before new ones
            keys = [k.job, k.leases, k.log, k.failed, k.plan_lock, k.src, *[k.ready(i) for i in ordered],
                    k.events]
            fixed = [spec.flow.concurrency, self.settings.log_maxlen, spec.budget_total,
                     spec.flow.tolerated_failure_percentage]
            pairs = [len(ordered), *[v for i in ordered for v in (
                i, lease_ms or int(spec.flow.stages[i].lease.total_seconds() * 1000))]]
            cached = (spec, keys, fixed, pairs)
            with self._specs_lock:
                self._lease_calls[cache_key] = cached
                while len(self._lease_calls) > self.spec_cache:
                    self._lease_calls.popitem(last=False)
        return cached[1], cached[2], cached[3]

    def _stage_filter(self, spec: JobSpec, stage: str | None) -> list[int]:
        pull = [i for i, s in enumerate(spec.flow.stages) if s.target is None and s.approval is None]
        if stage is None:
            return pull
        idx = spec.stage_index(stage)
        if idx is None:
            raise NotFound(f"job {spec.job_id} has no stage {stage!r}")
        if idx not in pull and spec.flow.stages[idx].approval is not None:
            raise Conflict(f"stage {stage!r} is an approval stage (a person decides); it cannot be leased")
        if idx not in pull:
            raise Conflict(f"stage {stage!r} is run by batchgate (push mode); it cannot be leased")
        return [idx]

    def _plan_ahead(self, spec: JobSpec) -> int:
        """How many batches one plan cuts (planner.batches_per_plan)."""
        return batches_per_plan(spec, self.plan_ahead)

    def _plan(self, spec: JobSpec, k: JobKeys, res: list, holder: str, token: str, ahead: int,
              lease_ms: int | None) -> Lease | None:
        """Cut batches at the frontier lease.lua answered with (this caller holds the plan lock) and lease
        the first; None when another look is needed (raced, the source failed, the job changed)."""
        next_seq, frontier = res[1], res[2]
        planned = False
        try:
            if spec.external:
                batches = [("", "0", "", 0)]
            else:
                window = (int(res[3]), res[4:]) if len(res) > 3 else None
                batches = self._read_ahead(spec, k, frontier, ahead, window)
                if not batches:
                    return None  # the job's status changed (failed by the source): look again
            first = int(next_seq)
            keys = [k.job, k.ready(0), k.log, k.leases, k.plan_lock,
                    *[key for i in range(len(batches)) for key in (k.batch(first + i), k.items(first + i))],
                    k.events]
            planned = True
            first_lease_ms = lease_ms or int(spec.flow.stages[0].lease.total_seconds() * 1000)
            with due_index.hinted(spec.job_id, first_lease_ms):
                out = self.scripts.plan(
                    keys=keys,
                    args=[next_seq, frontier, holder, self.settings.log_maxlen, spec.budget_total,
                          spec.flow.tolerated_failure_percentage, token, first_lease_ms,
                          spec.flow.concurrency, len(batches), *[v for b in batches for v in b]])
        finally:
            if not planned and self.r.get(k.plan_lock) == holder:
                self.r.delete(k.plan_lock)
        if out[0] == "ok":
            log.info("batches planned job_id=%s seq=%s count=%s", spec.job_id, out[1], out[2])
            if len(out) > 3:
                _, seq, _, attempt, deadline, start, end, items, gen = out
                return self._lease_from(spec, 0, token, int(seq), attempt, deadline, start, end, items, "",
                                        gen)
            return None
        if out[0] == "corrupt":
            raise CorruptRecord(f"job {spec.job_id} failed its checksum; it will not run")
        # 'raced': someone planned first; 'exhausted'/'status': the next look sees the new state
        return None

    def _read_ahead(self, spec: JobSpec, k: JobKeys, frontier: str, ahead: int,
                    window: tuple[int, list[str]] | None) -> list[tuple[str, str, str, int]]:
        """Up to ``ahead`` batches from the frontier, cut by the planner (planner.cut_batches); [] when the
        first read failed and the job was failed for it (source_fail.lua).

        The ledger's part is Redis only: inline items are read from the job's src list, through the
        ``window`` lease.lua already read (its length and its items from the frontier on) where there is
        one, so the planner reads them without another round trip.
        """
        cursor = loads_or_none(frontier)
        inline: RedisListView | WindowedListView | None = None
        if spec.source["type"] == "inline":
            offset = cursor.get("offset") if isinstance(cursor, dict) else None
            inline = (WindowedListView(self.r, k.src, window[0], offset, window[1])
                      if window is not None and isinstance(offset, int) else RedisListView(self.r, k.src))
        try:
            return cut_batches(spec, cursor, ahead, inline, self.settings)
        except chunker.SourceReadError as exc:
            # a file removed or an API down may come back: retried under the policy, then the job fails
            self._source_failed(spec, k, str(exc), True, getattr(exc, "retry_after_s", None))
            return []
        except chunker.SourceSpecError as exc:
            self._source_failed(spec, k, f"bad cursor or source: {exc}", False, None)
            return []

    def _source_failed(self, spec: JobSpec, k: JobKeys, message: str, retryable: bool,
                       retry_after_s: float | None) -> None:
        policy = spec.flow.stages[0].retry
        res = self.scripts.source_fail(
            keys=[k.job, k.log, k.audit, k.events],
            args=[message[:2000], "1" if retryable else "0", *self._policy_args(policy),
                  self.settings.log_maxlen])
        if res[0] in ("retry", "wait"):
            wait_ms = max(int(res[1]) - int(time.time() * 1000), int((retry_after_s or 0) * 1000), 1000)
            raise SourceUnavailable(f"source of job {spec.job_id} unavailable: {message}",
                                    retry_after=timedelta(milliseconds=wait_ms))
        if res[0] == "corrupt":
            raise CorruptRecord(f"job {spec.job_id} failed its checksum; it will not run")
        log.warning("job failed: source unreadable job_id=%s: %s", spec.job_id, message)
        return None

    @staticmethod
    def _lease_from(spec: JobSpec, idx: int, token: str, seq: int, attempt: Any, deadline: Any, start: str,
                    end: str, items: str, prev: str, gen: str, piece: str = "") -> Lease:
        name, cursor, end_cursor = spec.flow.stages[idx].name, loads_or_none(start), loads_or_none(end)
        indices = loads_or_none(piece) if piece else None  # a piece of the batch (bisection)
        run_items, run_input = bisect.cut(indices, loads_or_none(items), loads_or_none(prev))
        return Lease(job_id=spec.job_id, seq=seq, stage=name, stage_index=idx,
                     attempt=int(attempt), cursor=cursor, end_cursor=end_cursor,
                     items=run_items, input=run_input, params=spec.params,
                     lease_token=token, lease_deadline_ms=int(deadline),
                     idempotency_key=spec.stage_key(seq, name, cursor, end_cursor, bisect.key_suffix(indices)),
                     generation=int(gen or 0), piece=indices)

    def heartbeat(self, job_id: str, seq: int, token: str, progress: Any = ABSENT,
                  extend_ms: int | None = None, actor: str = "worker") -> dict[str, Any]:
        """Extend a live lease (by the stage's lease length unless ``extend_ms``), never past the
        attempt's start + the stage's ``max_run``; 409 if stale.

        An attempt at or past its ``max_run`` is failed by this very call (heartbeat.lua; retried only
        for an idempotent stage) and RunTooLong (409) is raised: the token is void from then on.
        """
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        batch = self._batch_fields(job_id, seq)
        stage = spec.flow.stages[int(batch["stage"])]
        extend = extend_ms or int(stage.lease.total_seconds() * 1000)
        res = self.scripts.heartbeat(
            keys=[k.job, k.batch(seq), k.leases, k.failed, k.log, *self._ready_keys(spec), k.events],
            args=[token, extend, "" if progress is ABSENT else dumps(progress), stage.max_run_ms,
                  "1" if stage.target is not None else "0", "1" if stage.max_run_retryable else "0",
                  *self._policy_args(stage.retry), self.settings.log_maxlen, spec.budget_total,
                  spec.flow.tolerated_failure_percentage, actor])
        self._raise_for(res, job_id, seq)
        return {"job_id": job_id, "seq": seq, "lease_deadline": _iso(int(res[1])), "job_status": res[2]}

    def complete(self, job_id: str, seq: int, token: str, output: Any,
                 next_cursor: Any = ABSENT, items: list | None = None,
                 actor: str = "worker", usage: Usage | None = None) -> dict[str, Any]:
        """Commit the leased stage's output: one script, one round trip.

        A fetching first stage gives the batch its items in ``items``, or as ``output["items"]``. The call
        is counted in the job's cost ledger in the same script, with ``usage`` (what the platform or pull
        client reported it cost) when given.
        """
        spec = self.spec(job_id)
        keys, args = self._complete_call(spec, seq, token, output, next_cursor, items, actor, usage)
        started = time.monotonic()
        res = self.scripts.complete(keys=keys, args=args)
        return self._completed(spec, seq, res, started, usage)

    def complete_and_lease(self, job_id: str, seq: int, token: str, output: Any,
                           next_cursor: Any = ABSENT, items: list | None = None, actor: str = "worker",
                           stage: str | None = None, usage: Usage | None = None,
                           quota: Any = None) -> tuple[dict[str, Any], Lease | None]:
        """Commit the leased stage's output and lease the job's next ready pull stage (only ``stage``
        if given), in one script and one round trip when a batch is ready: a pull loop's step.

        The commit stands whatever the lease answers; the lease is as ``lease`` (planning a new batch
        first, with a second round trip, when none is ready), ``quota`` counted by its script. Answers
        (as ``complete``, the next lease or None); a lease the quota refused raises NextLeaseRefused
        with the commit's answer."""
        spec = self.spec(job_id)
        stages = self._stage_filter(spec, stage)
        if not stages:  # no pull stage to lease: the commit alone
            return self.complete(job_id, seq, token, output, next_cursor, items, actor, usage), None
        keys, args = self._complete_call(spec, seq, token, output, next_cursor, items, actor, usage)
        lkeys, largs, lease_token, holder, ahead = self._lease_args(spec, tuple(stages), None)
        hint = self._min_lease(largs)
        if quota is not None:
            lkeys, largs = with_quota(lkeys, largs, quota)
        started = time.monotonic()
        with due_index.hinted(job_id, hint):
            both = self.scripts.complete_lease(keys=[*keys, *lkeys],
                                               args=[len(keys), len(args), *args, *largs])
        done = self._completed(spec, seq, both[0], started, usage)
        if both[1] is None:
            return done, None
        if both[1][0] == "rate":
            raise NextLeaseRefused(done, quota.refusal(int(both[1][1])))
        try:
            return done, self.lease_stages(job_id, stages, first=(both[1], lease_token, holder, ahead))
        except SourceUnavailable as exc:  # the commit stands: no next batch yet, a lease will say why
            log.info("no next lease after a commit job_id=%s: %s", job_id, exc)
            return done, None

    def _complete_call(self, spec: JobSpec, seq: int, token: str, output: Any, next_cursor: Any,
                       items: list | None, actor: str,
                       usage: Usage | None = None) -> tuple[list[str], list[Any]]:
        """complete.lua's KEYS and ARGV."""
        fetches = spec.flow.stages[0].fetches
        if items is not None and not fetches:
            raise InvalidRequest("items may only be sent by a fetching first stage (fetches: true)")
        from_output = (items is None and fetches and isinstance(output, dict)
                       and isinstance(output.get("items"), list))
        if from_output:
            items = output["items"]
        k = self.keys.job(spec.job_id)
        ready = self._ready_keys(spec)
        keys = [k.job, k.batch(seq), k.items(seq), k.leases, k.done, k.log, *ready,
                k.approvals, k.approvals_due, *gate_keys(self, spec, seq), k.cost, k.events]
        args = [token, dumps(output), "" if next_cursor is ABSENT else dumps(next_cursor),
                "" if items is None else dumps(items), len(items or ()), spec.stage_count,
                self.settings.log_maxlen, spec.budget_total, spec.flow.tolerated_failure_percentage,
                "1" if from_output else "0", actor, gates_arg(spec, 9 + len(ready)), spec.job_id, spec.tenant,
                *cost_args(spec, usage)]
        return keys, args

    def _completed(self, spec: JobSpec, seq: int, res: list, started: float,
                   usage: Usage | None = None) -> dict[str, Any]:
        """complete.lua's answer as the API gives it (or raised as a problem)."""
        job_id = spec.job_id
        if res[0] == "duplicate":
            stage, attempt = int(res[1]), int(res[2])
        else:
            self._raise_for(res, job_id, seq)
            stage, attempt = int(res[4]), int(res[3])
            metrics.COMMIT_SECONDS.observe(time.monotonic() - started)
            metrics.BATCHES_COMMITTED.labels(spec.flow.stages[stage].name).inc()
            if len(res) > 6:  # the call was counted in the cost ledger, for this reason
                metrics.count_call(spec.flow.stages[stage].name, res[6], usage, paused=res[6 + 1] == "1")
            log.info("stage committed job_id=%s seq=%s stage=%s attempt=%s job_status=%s",
                     job_id, seq, stage, attempt, res[2])
            if len(res) > 5 and res[5]:
                self.approvals._file_opened(spec.tenant, job_id, res[5])
        return {"job_id": job_id, "seq": seq, "stage": spec.flow.stages[stage].name,
                "attempt": attempt, "status": "committed", "duplicate": res[0] == "duplicate"}

    def fail(self, job_id: str, seq: int, token: str, message: str, retryable: bool = True,
             error_type: str | None = None, actor: str = "worker",
             min_delay: timedelta | None = None, usage: Usage | None = None) -> dict[str, Any]:
        """Record a failed attempt: retried with backoff, or failed for good; the call is counted in the
        job's cost ledger in the same script (with ``usage`` when the platform reported one)."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        stage = spec.flow.stages[int(self._batch_fields(job_id, seq)["stage"])]
        policy = stage.retry
        if error_type and error_type in policy.non_retryable_error_types:
            retryable = False
        ready = self._ready_keys(spec)
        # bisection: an on_fatal: bisect stage's non-transient error, never one where the flow may have run
        cap = (stage.bisect_max_calls if stage.on_fatal == "bisect" and not retryable
               and error_type not in bisect.NEVER_BISECT else 0)
        res = self.scripts.fail(
            keys=[k.job, k.batch(seq), k.leases, k.failed, k.log, *ready,
                  k.quarantine, k.done, k.items(seq), k.approvals, k.approvals_due,
                  *gate_keys(self, spec, seq), k.cost, k.events],
            args=[token, message[:2000], "1" if retryable else "0", *self._policy_args(policy),
                  self.settings.log_maxlen, spec.budget_total,
                  spec.flow.tolerated_failure_percentage, actor,
                  int(min_delay.total_seconds() * 1000) if min_delay else 0, error_type or "",
                  cap, spec.stage_count, gates_arg(spec, 11 + len(ready)), job_id, spec.tenant,
                  *cost_args(spec, usage)])
        self._raise_for(res, job_id, seq)
        if res[0] in ("split", "quarantined"):
            log.info("batch bisected job_id=%s seq=%s attempt=%s outcome=%s", job_id, seq, res[1], res[0])
        counter = {"retry": metrics.BATCHES_RETRIED, "failed": metrics.BATCHES_FAILED}.get(res[0])
        if counter is not None:
            counter.labels(stage.name, metrics.error_class(error_type, retryable)).inc()
        if len(res) > 3 and res[3]:
            metrics.count_call(stage.name, res[3], usage, paused=res[4] == "1")
        if res[0] == "quarantined" and len(res) > 5:
            metrics.ITEMS_QUARANTINED.labels(stage.name).inc(int(res[5]))
        log.info("stage failed job_id=%s seq=%s attempt=%s outcome=%s", job_id, seq, res[1], res[0])
        return {"job_id": job_id, "seq": seq, "attempt": int(res[1]), "outcome": res[0]}

    def _ready_keys(self, spec: JobSpec) -> tuple[str, ...]:
        return _ready_keys(self.keys.prefix, spec.job_id, spec.stage_count)

    @staticmethod
    def _policy_args(policy: Any) -> list[Any]:
        return [policy.maximum_attempts, int(policy.initial_interval.total_seconds() * 1000),
                policy.backoff_coefficient, int(policy.maximum_interval.total_seconds() * 1000),
                random.random()]

    def expire_due(self, job_id: str, actor: str = "supervisor") -> list[tuple[int, str]]:
        """Expire every lease of ``job_id`` past its deadline; returns (seq, outcome) pairs."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        now = int(time.time() * 1000)
        out = []
        for seq in self.r.zrangebyscore(k.leases, "-inf", now):
            stage = spec.flow.stages[int(self.r.hget(k.batch(int(seq)), "stage") or 0)]
            policy = stage.retry
            res = self.scripts.expire(
                keys=[k.job, k.batch(int(seq)), k.leases, k.failed, k.log,
                      *self._ready_keys(spec), k.events],
                args=[seq, *self._policy_args(policy), self.settings.log_maxlen,
                      spec.budget_total, spec.flow.tolerated_failure_percentage, actor,
                      "1" if stage.target is not None else "0", stage.max_run_ms,
                      "1" if stage.max_run_retryable else "0"])
            if res[0] == "held":
                break
            if res[0] in ("retry", "failed"):
                metrics.LEASE_EXPIRIES.labels(stage.name, res[0]).inc()
                if res[0] == "failed":
                    metrics.BATCHES_FAILED.labels(stage.name, "lease_expired").inc()
                log.info("lease expired job_id=%s seq=%s attempt=%s outcome=%s",
                         job_id, seq, res[1], res[0])
                out.append((int(seq), res[0]))
        return out

    def clear_waiting(self, job_id: str) -> None:
        """The target the job waited on answers again: its ``waiting`` reason goes (unwait.lua)."""
        k = self.keys.job(job_id)
        self.scripts.unwait(keys=[k.job, k.log], args=[self.settings.log_maxlen])

    def note(self, job_id: str, event: str, **fields: Any) -> None:
        """Append an event (platform ids, call outcomes) to the job's capped log."""
        entry = {"event": event, **{k: v if isinstance(v, str) else dumps(v)
                                    for k, v in fields.items() if v is not None}}
        self.r.xadd(self.keys.job(job_id).log, entry, maxlen=self.settings.log_maxlen, approximate=True)

    def batch_record(self, job_id: str, seq: int) -> dict[str, str]:
        """The batch hash as stored."""
        return self._batch_fields(job_id, seq)

    def _batch_fields(self, job_id: str, seq: int) -> dict[str, str]:
        fields = self.r.hgetall(self.keys.job(job_id).batch(seq))
        if not fields:
            self._raise_for(["missing"], job_id, seq)  # compacted: a stale lease; else NotFound
        return fields

    def _raise_for(self, res: list, job_id: str, seq: int) -> None:
        if res[0] == "max_run":
            outcome, attempt, max_run_s = res[1], int(res[2]), int(res[3]) / 1000
            then = ("it will be retried (the stage is idempotent)" if outcome == "retry"
                    else "it failed for good (the stage is not idempotent, or out of attempts)")
            raise RunTooLong(f"batch {seq} of job {job_id}, attempt {attempt}, ran past its stage's "
                             f"max_run ({max_run_s:g} s); the attempt was failed and {then}; its lease "
                             f"token is no longer valid", outcome=outcome, attempt=attempt,
                             max_run_s=max_run_s, error_type="max_run")
        if res[0] == "cancelled":
            raise JobCancelled(f"job {job_id} is cancelled; the answer for batch {seq} was not "
                               f"committed (it is in the job's log)", job_status="cancelled")
        if res[0] == "stale":
            raise StaleLease(f"lease token is not current for job {job_id} batch {seq} "
                             f"(batch is {res[1]}, attempt {res[2]})",
                             batch_status=res[1], attempt=int(res[2] or 0))
        if res[0] == "corrupt":
            raise CorruptRecord(f"job {job_id} batch {seq} failed its checksum; it will not run")
        if res[0] == "missing" and int(self.r.hget(self.keys.job(job_id).sink, "seq") or 0) > seq:
            # delivered to the job's result sink and compacted (results.py): long done, like a stale one
            if self.r.hget(self.keys.job(job_id).job, "status") == "cancelled":
                self._raise_for(["cancelled"], job_id, seq)
            raise StaleLease(f"batch {seq} of job {job_id} was committed, delivered to the job's result "
                             "sink and compacted; this answer was not committed",
                             batch_status="compacted", attempt=0)
        if res[0] == "missing":
            raise NotFound(f"job {job_id} has no batch {seq}")
        if res[0] == "invalid":
            raise InvalidRequest(res[1])

    # -- retention -------------------------------------------------------------------------

    def _all_keys(self, job_id: str) -> list[str]:
        """The job's keys that retention expires and a resume persists. Not the recovery claim and the
        plan lock: they live by their own short TTL, which retention must not stretch and a resume must
        not remove (a claim or lock that never expires would block recovery or planning for good)."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        planned = int(self.job_fields(job_id)["next_seq"])
        compacted = int(self.r.hget(k.sink, "seq") or 0)  # records below it are range summaries now
        approvals = self.r.zrange(k.approvals, 0, -1)
        # below it, only batches with quarantined items kept their records (compact.lua), and those whose
        # retried items the sink still owes an amendment (amend.lua)
        kept = ({int(m.split(".")[0]) for m in self.r.zrange(k.quarantine, 0, -1)}
                | {int(m) for m in self.r.zrange(k.sink_late, 0, -1)}) if compacted else set()
        return [k.job, k.spec, k.src, k.leases, k.done, k.failed, k.log, k.audit, k.events, k.cost,
                k.approvals, k.approvals_due, k.sink, k.sink_late, k.quarantine, k.past,
                *[k.approval(*(int(x) for x in a.split(".")[-3:])) for a in approvals],
                *self._ready_keys(spec),
                *[key for s in sorted(kept & set(range(compacted))) for key in (k.batch(s), k.items(s))],
                *[key for s in range(compacted, planned) for key in (k.batch(s), k.items(s))]]

    def expire_job(self, job_id: str, retention: timedelta) -> None:
        """Let every key of a finished job expire after ``retention`` (never for failed jobs)."""
        ttl_ms = max(int(retention.total_seconds() * 1000), 1)
        pipe = self.r.pipeline(transaction=False)
        for key in self._all_keys(job_id):
            pipe.pexpire(key, ttl_ms)
        pipe.execute()

    def persist_job(self, job_id: str) -> None:
        """Cancel a retention expiry: the job runs again."""
        pipe = self.r.pipeline(transaction=False)
        for key in self._all_keys(job_id):
            pipe.persist(key)
        pipe.execute()
        pipe = self.r.pipeline(transaction=False)
        pipe.sadd(self.keys.active, job_id)
        pipe.sadd(self.keys.sink_jobs, job_id)  # a job without a sink is dropped by the deliverer
        pipe.zadd(self.keys.due_for(job_id), {job_id: int(time.time() * 1000)}, lt=True)  # look at it next pass
        pipe.execute()


class WindowedListView(RedisListView):
    """An inline source's items as RedisListView serves them, with a window already read: the list's
    length and the items from ``offset`` on, as lease.lua returned them. Slices inside the window cost
    no round trip; others are read from Redis."""

    def __init__(self, client: redis.Redis, key: str, length: int, offset: int, window: list[str]) -> None:
        super().__init__(client, key)
        self._len = length
        self._offset = offset
        self._window = window

    def covers(self, cursor: Any, max_items: int) -> bool:
        """Whether a batch read at ``cursor`` (max_items and the one item it peeks at) is in the window."""
        start = cursor.get("offset") if isinstance(cursor, dict) else None
        if not isinstance(start, int):
            return False
        stop = min(start + max_items + 1, len(self))
        return self._offset <= start and stop <= self._offset + len(self._window)

    def _read(self, start: int, stop: int) -> list[Any]:
        if self._offset <= start and stop <= self._offset + len(self._window):
            return [loads_or_none(v) for v in self._window[start - self._offset:stop - self._offset]]
        return super()._read(start, stop)


def cost_args(spec: JobSpec, usage: Usage | None) -> list[str]:
    """complete.lua's ARGV[15..16] and fail.lua's ARGV[20..21]: the call's usage and the flow's budget (lib.lua
    record_cost)."""
    used = "" if usage is None else dumps({"t": usage.tokens, "p": usage.price, "c": usage.currency})
    return [used, spec.flow.budget.arg() if spec.flow.budget is not None else ""]


@functools.lru_cache(maxsize=4096)
def _ready_keys(prefix: str, job_id: str, stage_count: int) -> tuple[str, ...]:
    k = Keys(prefix).job(job_id)
    return tuple(k.ready(i) for i in range(stage_count))
