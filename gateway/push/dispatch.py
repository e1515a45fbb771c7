"""Push mode: batchgate triggers each platform stage itself.

A ``batchgate worker`` process (gateway/push/worker.py) feeds its call threads straight from the ledger: it
leases a ready push-stage batch only when one of its threads is free, so the lease clock starts when the
call starts and no lease waits in a queue. Per batch:

feed            ``lease_next`` leases the next ready batch of a fed job whose target is open (not
                cooling down, not full).
run_leased      takes a slot on the stage's target (slot.lua: ``max_in_flight``, the circuit breaker),
                starts the call in the ledger (begin.lua), calls the connector and acts on the outcome:
                commit or fail through the ledger, wait for the callback, schedule a poll (RQ), or, when
                the target is unavailable, give the batch back without spending an attempt and cool the
                target down (breaker.lua, outage.lua).
poll_stage      (an RQ job, scheduled with ``enqueue_in``) heartbeats the lease and polls the platform run;
                the next poll waits twice as long as the last, from the stage's ``poll_interval`` up to
                :func:`poll_cap` (60 s, at most half the stage's lease so the lease stays alive), and the
                batch log records a poll only when the run's state changes (``PollState``).

The ledger's lease token fences everything: a late worker, a duplicate poll or a callback that beat the
trigger's answer all end as 'stale' or 'duplicate' in the ledger and change nothing.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import requests
from rq import Queue
from rq.serializers import JSONSerializer

import connectors
from connectors.base import (
    WAITING_HUMAN,
    Accepted,
    Answer,
    Connector,
    Done,
    Outcome,
    PlatformError,
    Retry,
    Running,
    StageCall,
    WaitingHuman,
)
from gateway import metrics, tracing
from gateway.errors import BatchgateError, JobCancelled, NotFound, RunTooLong, StaleLease
from gateway.ledger import bisect
from gateway.ledger.embedded import REDIS_DOWN, client_for, queue_client_for
from gateway.ledger.flows import Stage
from gateway.ledger.jobspec import JobSpec
from gateway.ledger.ledger import ABSENT, Lease, Ledger
from gateway.ledger.multi import multi
from gateway.ledger.records import dumps, loads_or_none
from gateway.net.keepalive import idle_limit
from gateway.net.outbound import session_for
from gateway.net.urlguard import Allowlist, UnsafeURL, check_url
from gateway.push.resumer import settle_wait
from gateway.security import sign
from gateway.settings import Settings

log = logging.getLogger(__name__)

QUEUE_NAME = "batchgate"
DEFAULT_TARGET_LIMIT = 8
#: The first wait before an unavailable target is tried again (it doubles up to outage_cooldown_max).
OUTAGE_FIRST_COOLDOWN_MS = 1000
#: The longest wait between probes of a target that answers it is starting (n8n registers its webhooks
#: 17-99 s after a restart; a probe every 2 s resumes the job within 2 s of that, not up to 30 s later).
BOOTING_COOLDOWN_MAX_MS = 2000
#: The longest wait between two polls of a platform run (polls back off from the stage's poll_interval).
POLL_BACKOFF_MAX_MS = 60_000
#: Call durations kept per target for dry runs' estimates (Dispatcher._note_latency).
LATENCY_KEPT = 200
#: Longest list of kicked job ids kept for the workers (older kicks add nothing).
WAKE_LIST_MAX = 1000
#: Set when this worker process is stopping (SIGTERM): no new pump, and a stage attempt dequeued now
#: gives its lease back without a call (no attempt spent) instead of calling the platform.
STOPPING = threading.Event()


def target_id(target: dict[str, Any]) -> str:
    """Targets are limited per platform endpoint: the scheme, host and port they call."""
    parts = urlsplit(target.get("url") or target.get("base_url") or "")
    return hashlib.sha1(f"{parts.scheme}://{parts.netloc}".encode()).hexdigest()[:16]


def push_stages(spec: JobSpec) -> list[int]:
    """Indices of the stages batchgate calls a platform for (those with a ``target``)."""
    return [i for i, s in enumerate(spec.flow.stages) if s.target is not None]


def target_urls(target: dict[str, Any]) -> list[str]:
    """Every URL a target may call (trigger and poll)."""
    return [target[k] for k in ("url", "base_url", "api_url") if target.get(k)]


def poll_cap(stage: Stage) -> timedelta:
    """The longest wait between two polls of ``stage``'s runs: POLL_BACKOFF_MAX_MS, but at most half the
    stage's lease (each poll heartbeats it) and never below its ``poll_interval``."""
    cap = min(timedelta(milliseconds=POLL_BACKOFF_MAX_MS), stage.lease / 2)
    return max(cap, stage.poll_interval)


@dataclass(frozen=True)
class PollState:
    """What one scheduled poll carries besides the handle (RQ arguments, JSON): the wait that preceded it
    and the run state the batch log last recorded, so the log records changes, not every poll."""

    wait_ms: int | None = None
    seen: str = ""

    def after(self, stage: Stage, seen: str | None = None) -> PollState:
        """The state of the next poll: its wait doubled (from ``poll_interval``, capped), ``seen`` updated."""
        first = int(stage.poll_interval.total_seconds() * 1000)
        cap = int(poll_cap(stage).total_seconds() * 1000)
        wait = first if self.wait_ms is None else min(max(self.wait_ms * 2, first), cap)
        return PollState(wait, self.seen if seen is None else seen)

    def changed(self, seen: str) -> bool:
        return seen != self.seen


#: Leading arguments of each RQ entry point that are safe to show; the rest (lease token, handle) never are.
SHOWN_ARGS = {"run_stage": 4, "poll_stage": 4, "pump_job": 1}


class TokenlessQueue(Queue):
    """An RQ queue whose job descriptions never carry a lease token.

    RQ describes a job by its call (``run_stage('job_..', 0, 0, 1, '<lease token>', 0)``), logs that at
    INFO when a worker starts it and keeps it in Redis for dashboards; here a job is described by its
    function and the leading arguments ``SHOWN_ARGS`` names (job, seq, stage, attempt) only.
    """

    def create_job(self, func: Any, *args: Any, **kwargs: Any) -> Any:
        if kwargs.get("description") is None and len(args) < 7:  # description not given positionally
            name = getattr(func, "__name__", None) or str(func).rpartition(".")[2]
            call_args = kwargs.get("args") if "args" in kwargs else (args[0] if args else None)
            shown = list(call_args or ())[:SHOWN_ARGS.get(name, 0)]
            kwargs["description"] = " ".join([name, *map(str, shown)])
        return super().create_job(func, *args, **kwargs)


@dataclass
class Dispatcher:
    """Push-mode operations for one thread (a worker's feeder or call thread, the API, the supervisor)."""

    settings: Settings
    ledger: Ledger
    queue: Queue
    session: requests.Session
    allow: Allowlist

    @classmethod
    def build(cls, settings: Settings, ledger: Ledger | None = None) -> Dispatcher:
        url = settings.redis_url.get_secret_value() if settings.redis_url else None
        if url is None:
            raise RuntimeError("push mode needs BATCHGATE_REDIS_URL (set by `batchgate up`)")
        ledger = ledger or Ledger(client_for(url, settings), settings)
        queue = TokenlessQueue(QUEUE_NAME, connection=queue_client_for(settings), serializer=JSONSerializer)
        # every trigger and poll goes through the outbound guard: checked addresses, checked redirect hops
        return cls(settings, ledger, queue, session_for(settings), Allowlist.parse(settings.outbound_allow))

    # -- waking the workers -----------------------------------------------------------------

    def kick(self, job_id: str) -> None:
        """Tell the workers ``job_id`` may have work now (a job created, resumed, a callback committed):
        it joins the fed jobs and its idle backoff ends. A job without push stages is left out (the
        supervisor kicks each running job it looks at; its spec is in this process's cache)."""
        if not push_stages(self.ledger.spec(job_id)):
            return
        pipe = self.ledger.r.pipeline(transaction=False)
        pipe.sadd(self.ledger.keys.push_jobs, job_id)
        pipe.lpush(self.ledger.keys.push_wake, job_id)
        pipe.ltrim(self.ledger.keys.push_wake, 0, WAKE_LIST_MAX - 1)
        pipe.execute()

    pump = kick  # the supervisor's and older callers' name for it

    def woken(self) -> list[str]:
        """Take the job ids kicked since the last look (one round trip)."""
        pipe = multi(self.ledger.r)
        pipe.lrange(self.ledger.keys.push_wake, 0, -1)
        pipe.delete(self.ledger.keys.push_wake)
        found, _ = pipe.execute()
        return list(dict.fromkeys(found))

    def fed_jobs(self, rescan: bool = False) -> list[str]:
        """Job ids with push stages the workers feed. ``rescan`` also looks through the active set (jobs
        created before a kick could register them, e.g. by an older version)."""
        r, k = self.ledger.r, self.ledger.keys
        if rescan:
            # two reads, not SDIFF: the two sets may sit on two slots of a Redis Cluster
            for job_id in r.smembers(k.active) - r.smembers(k.push_jobs):
                try:
                    spec = self.ledger.spec(job_id)
                except BatchgateError:
                    continue
                if push_stages(spec):
                    r.sadd(k.push_jobs, job_id)
        return sorted(r.smembers(k.push_jobs))

    def drop_fed(self, job_id: str) -> None:
        self.ledger.r.srem(self.ledger.keys.push_jobs, job_id)

    # -- leasing -----------------------------------------------------------------------------

    def open_stages(self, spec: JobSpec) -> list[int]:
        """The job's push stages whose target may take a call now: breaker not cooling, not full."""
        push = push_stages(spec)
        if not push:
            return []
        k = self.ledger.keys
        now = int(time.time() * 1000)  # slot.lua decides on Redis's clock; this only skips the obvious
        pipe = self.ledger.r.pipeline(transaction=False)
        for i in push:
            tid = target_id(spec.flow.stages[i].target)
            pipe.hmget(k.target_breaker(tid), "until_ms", "probe_ms")
            pipe.zcount(k.target_slots(tid), f"({now}", "+inf")
        res = pipe.execute()
        out = []
        for n, i in enumerate(push):
            until, probing = res[2 * n]
            if until is not None and (int(until) > now or (probing and int(probing) > now)):
                continue  # cooling down, or its one probe call is in flight
            if res[2 * n + 1] >= spec.flow.stages[i].target.get("max_in_flight", DEFAULT_TARGET_LIMIT):
                continue
            out.append(i)
        return out

    def lease_next(self, job_id: str, stages: list[int]) -> Lease | None:
        """Lease the next ready batch at one of the push ``stages``, with its stage's lease length: the
        caller runs it at once (``run_leased``)."""
        return self.ledger.lease_stages(job_id, stages)

    def run_ready(self, job_id: str, limit: int = 10_000) -> int:
        """Lease and run this job's ready push batches one after another in this thread (tools, tests);
        returns how many calls ran."""
        ran = 0
        spec = self.ledger.spec(job_id)
        while ran < limit:
            lease = self.lease_next(job_id, self.open_stages(spec))
            if lease is None:
                return ran
            self.run_leased(spec, lease)
            ran += 1
        return ran

    # -- one stage attempt -----------------------------------------------------------------

    def run_leased(self, spec: JobSpec, lease: Lease) -> None:
        """Trigger one leased stage attempt and act on the platform's answer."""
        stage_idx, seq, token = lease.stage_index, lease.seq, lease.lease_token
        stage = spec.flow.stages[stage_idx]
        holder = f"{spec.job_id}:{seq}:{stage_idx}:{lease.attempt}:{secrets.token_hex(4)}"
        if STOPPING.is_set():  # this worker is stopping: the batch goes back, no call, no attempt spent
            self._begin(spec, stage, seq, stage_idx, token, mode="release")
            return
        granted = self._take_slot(stage, holder)
        if granted not in ("ok", "probe"):  # the target filled up or began cooling since the lease
            self._begin(spec, stage, seq, stage_idx, token, mode="release", reason="target_busy")
            return
        sample = None  # the call's time and item count, for the target's latency list (a Done only)
        try:
            if not self._begin(spec, stage, seq, stage_idx, token):
                return
            call = self._call_for(spec, stage, lease)
            started = time.monotonic()
            earlier = self._earlier_run(spec, seq, stage_idx) if lease.attempt > 1 else None
            if earlier is not None:
                # an earlier attempt started a platform run whose outcome was never recorded (its
                # lease ran out): ask the platform about that run before triggering the flow again
                self.ledger.note(spec.job_id, "asking_about_earlier_run", seq=seq, stage=stage.name,
                                 attempt=lease.attempt)
                outcome = self._guarded(call, stage,
                                        lambda: self._connector(stage).poll(call, earlier, self.session))
                if isinstance(outcome, PlatformError) and not outcome.outage and (
                        outcome.retry is Retry.RETRYABLE):
                    self._schedule_poll(spec, stage, seq, stage_idx, lease.attempt, token, earlier)
                    return
                if isinstance(outcome, Running):
                    outcome = Running(earlier, outcome.platform_ids)
            else:
                outcome = self._guarded(call, stage,
                                        lambda: self._connector(stage).trigger(call, self.session))
            if isinstance(outcome, Done):
                sample = latency_sample(time.monotonic() - started, call)
        finally:
            self._durably(stage, lambda: self._release_slot(spec, stage, holder, sample))
        self._durably(stage, lambda: self._act(spec, stage, call, seq, stage_idx, token, outcome,
                                               probe=granted == "probe"))

    def _earlier_run(self, spec: JobSpec, seq: int, stage_idx: int) -> dict[str, Any] | None:
        """The poll handle an earlier attempt of this stage stored (handle.lua), if any."""
        handle, handle_stage = self.ledger.r.hmget(self.ledger.keys.job(spec.job_id).batch(seq),
                                                   "handle", "handle_stage")
        if not handle or handle_stage != str(stage_idx):
            return None
        found = loads_or_none(handle)
        return found if isinstance(found, dict) else None

    def _remember_run(self, spec: JobSpec, seq: int, token: str, handle: dict[str, Any]) -> None:
        k = self.ledger.keys.job(spec.job_id)
        self.ledger.scripts.handle(keys=[k.batch(seq), k.job], args=[token, dumps(handle)])

    def run(self, job_id: str, seq: int, stage_idx: int, attempt: int, token: str, wait: int = 0) -> None:
        """A stage attempt enqueued by an older version (RQ ``run_stage``): give its lease back unspent;
        the workers' feeder leases it again and calls it."""
        spec = self.ledger.spec(job_id)
        self._begin(spec, spec.flow.stages[stage_idx], seq, stage_idx, token, mode="release")

    def poll(self, job_id: str, seq: int, stage_idx: int, attempt: int, token: str,
             handle: dict[str, Any], state: PollState | None = None) -> None:
        """Poll a platform run; keep the lease alive while it runs."""
        spec = self.ledger.spec(job_id)
        stage = spec.flow.stages[stage_idx]
        state = state or PollState()
        if self.ledger.r.hget(self.ledger.keys.job(job_id).job, "status") == "held":
            # record-only recovery: no call runs for a held job; ask again later, lease untouched
            self._schedule_poll(spec, stage, seq, stage_idx, attempt, token, handle, state.after(stage))
            return
        try:
            self.ledger.heartbeat(job_id, seq, token)
        except RunTooLong as exc:  # heartbeat.lua failed the attempt past max_run; its retry class decided
            log.warning("run past max_run job_id=%s seq=%s: %s", job_id, seq, exc.detail)
            return
        except (StaleLease, NotFound, JobCancelled):
            return
        call = self._call(spec, stage, seq, stage_idx, attempt, token)
        if call is None:
            return
        outcome = self._guarded(call, stage, lambda: self._connector(stage).poll(call, handle, self.session))
        if isinstance(outcome, PlatformError) and (outcome.outage or outcome.retry is Retry.RETRYABLE):
            # the run goes on where it runs; a poll that could not ask is not the run's failure
            if state.changed("poll_failed"):
                self.ledger.note(job_id, "poll_failed", seq=seq, stage=stage.name, attempt=attempt,
                                 error=outcome.message[:500])
            self._schedule_poll(spec, stage, seq, stage_idx, attempt, token, handle,
                                state.after(stage, "poll_failed"))
            return
        self._durably(stage, lambda: self._act(spec, stage, call, seq, stage_idx, token, outcome,
                                               remember=False, polled=state))

    def _schedule_poll(self, spec: JobSpec, stage: Stage, seq: int, stage_idx: int, attempt: int,
                       token: str, handle: dict[str, Any], state: PollState | None = None) -> None:
        """Poll the run after ``state.wait_ms`` (the first poll: after the stage's ``poll_interval``)."""
        state = state or PollState().after(stage)
        self.queue.enqueue_in(timedelta(milliseconds=state.wait_ms or 0), poll_stage, spec.job_id, seq,
                              stage_idx, attempt, token, handle, state.wait_ms, state.seen,
                              result_ttl=60, failure_ttl=86400)

    def _durably(self, stage: Stage, fn: Any) -> Any:
        """Run ``fn`` (ledger writes after a call), retrying while Redis is unreachable (a restart): a
        platform's answer is kept in this process until Redis takes it, for up to the stage's lease,
        rather than lost and paid for again."""
        give_up = time.monotonic() + max(stage.lease.total_seconds(), 5.0)
        pause = 0.2
        while True:
            try:
                return fn()
            except REDIS_DOWN as exc:
                if time.monotonic() > give_up:
                    raise
                log.warning("redis unavailable (%s); retrying in %.1f s", type(exc).__name__, pause)
                time.sleep(pause)
                pause = min(pause * 2, 2.0)

    def _begin(self, spec: JobSpec, stage: Stage, seq: int, stage_idx: int, token: str,
               mode: str = "", reason: str = "") -> bool:
        """The ledger's word that this call may start now (begin.lua): the lease is current and the
        job running. A cancel voids leases, so no call starts after it; a paused or held job gets the
        batch back in its ready set without spending an attempt."""
        k = self.ledger.keys.job(spec.job_id)
        res = self.ledger.scripts.begin(
            keys=[k.job, k.batch(seq), k.leases, k.ready(stage_idx), k.log],
            args=[token, int(stage.lease.total_seconds() * 1000), self.settings.log_maxlen,
                  mode, reason])
        if res[0] == "ok":
            return True
        log.info("call not started job_id=%s seq=%s: %s", spec.job_id, seq, "/".join(map(str, res)))
        return False

    def _take_slot(self, stage: Stage, holder: str) -> str:
        tid = target_id(stage.target)
        k = self.ledger.keys
        lifetime_ms = int(stage.timeout.total_seconds() * 1000) + 5000
        res = self.ledger.scripts.slot(keys=[k.target_slots(tid), k.target_breaker(tid)],
                                       args=[stage.target.get("max_in_flight", DEFAULT_TARGET_LIMIT),
                                             holder, lifetime_ms])
        return str(res[0])

    def _connector(self, stage: Stage) -> Connector:
        return connectors.get_connector(stage.target["type"])

    def _guarded(self, call: StageCall, stage: Stage, fn) -> Outcome | PlatformError:
        """Run a connector call behind the URL guard; failures come back as values.

        The URLs are checked here for a clear message; ``self.session`` checks again on each connection
        and redirect hop (a refusal there is a FATAL PlatformError from the connector)."""
        with metrics.platform_call(target_id(stage.target)) as seen, tracing.span(
                "platform.call", kind="client", **{"batchgate.target": target_id(stage.target),
                                                   "batchgate.stage": stage.name}) as traced:
            try:
                for url in target_urls(stage.target):
                    check_url(url, self.allow)
                with idle_limit(stage.target.get("keepalive_idle")):  # never reuse a connection gone stale
                    outcome = fn()
            except UnsafeURL as exc:
                outcome = PlatformError(exc.detail, Retry.FATAL)
            except PlatformError as exc:  # the connector classes it, outage included (429, 503, never sent)
                outcome = exc
            seen["outcome"] = _call_outcome(outcome)
            if traced is not None:
                traced.set_attribute("batchgate.outcome", seen["outcome"])
            return outcome

    def _call_for(self, spec: JobSpec, stage: Stage, lease: Lease) -> StageCall:
        """The StageCall for a fresh lease (its items, cursor and input came with the lease)."""
        batch = {"start_cursor": dumps(lease.cursor), "end_cursor": dumps(lease.end_cursor),
                 "gen": str(lease.generation), f"out:{lease.stage_index - 1}": dumps(lease.input),
                 "piece": "" if lease.piece is None else dumps(lease.piece)}  # bisection: already cut
        return self._stage_call(spec, stage, batch, lease.seq, lease.stage_index, lease.attempt,
                                lease.lease_token, items=lease.items, called_s=time.time())

    def _call(self, spec: JobSpec, stage: Stage, seq: int, stage_idx: int, attempt: int,
              token: str) -> StageCall | None:
        """The StageCall for a live lease, or None when the lease is gone (stale attempt)."""
        try:
            batch = self.ledger.batch_record(spec.job_id, seq)
        except NotFound:
            return None
        if batch.get("status") != "leased" or batch.get("lease_token") != token:
            return None
        items = loads_or_none(self.ledger.r.get(self.ledger.keys.job(spec.job_id).items(seq)))
        piece = bisect.selection(batch)  # a piece of the batch (bisection): its items and input only
        items, prev = bisect.cut(piece, items, loads_or_none(batch.get(f"out:{stage_idx - 1}")))
        batch = {**batch, f"out:{stage_idx - 1}": dumps(prev), "piece": "" if piece is None else dumps(piece)}
        called_s = int(batch["called_ms"]) / 1000 if batch.get("called_ms") else time.time()
        return self._stage_call(spec, stage, batch, seq, stage_idx, attempt, token, items=items,
                                called_s=called_s)

    def _stage_call(self, spec: JobSpec, stage: Stage, batch: dict[str, str], seq: int, stage_idx: int,
                    attempt: int, token: str, items: Any, called_s: float) -> StageCall:
        envelope = self._envelope(spec, stage, batch, seq, stage_idx, attempt, token, items)
        names = {k: v for k, v in stage.target.items() if k.endswith("_secret") and isinstance(v, str)}
        # the job's tenant's own secrets, then the shared "*" ones; never another tenant's
        resolved = {k: value for k, v in names.items()
                    if (value := self.settings.secret_for(spec.tenant, v)) is not None}
        return StageCall(envelope=envelope, target=stage.target, secrets=resolved,
                         timeout_s=stage.timeout.total_seconds(),
                         signing_key=self.settings.signing_secret(), idempotent=stage.idempotent,
                         on_progress=lambda: self._alive(spec.job_id, seq, token),
                         run_deadline_s=called_s + stage.max_run.total_seconds())

    def _alive(self, job_id: str, seq: int, token: str) -> None:
        """The platform shows life during a long call (a Dify stream event): heartbeat the lease."""
        try:
            self.ledger.heartbeat(job_id, seq, token)
        except (StaleLease, NotFound, JobCancelled, RunTooLong):
            pass  # the call's answer will meet a stale lease and change nothing

    def _envelope(self, spec: JobSpec, stage: Stage, batch: dict[str, str], seq: int, stage_idx: int,
                  attempt: int, token: str, items: Any) -> dict[str, Any]:
        ttl_s = stage.lease.total_seconds() + self.settings.callback_grace.total_seconds()
        base = self.settings.base_url()
        key = self.settings.signing_secret()
        env: dict[str, Any] = {
            "job_id": spec.job_id, "seq": seq, "stage": stage.name, "attempt": attempt,
            "idempotency_key": spec.stage_key(seq, stage.name, loads_or_none(batch.get("start_cursor")),
                                              loads_or_none(batch.get("end_cursor")),
                                              bisect.key_suffix(loads_or_none(batch.get("piece") or None))),
            "generation": int(batch.get("gen") or 0),
            "cursor": loads_or_none(batch.get("start_cursor")),
            "input": loads_or_none(batch.get(f"out:{stage_idx - 1}")), "params": spec.params,
        }
        if (items is not None and not batch.get("piece")  # a piece's items travel inline (the blob is the batch's)
                and len(dumps(items).encode()) > self.settings.inline_max_bytes):
            blob = sign({"j": spec.job_id, "s": seq}, key, "blob", ttl_s)
            env["items"], env["items_url"] = None, f"{base}/v1/blobs/{blob}"
        else:
            env["items"] = items
        if stage.target.get("mode") == "callback":
            cb = sign({"j": spec.job_id, "s": seq, "st": stage_idx, "a": attempt, "t": token}, key,
                      "callback", ttl_s)
            env["callback_url"] = f"{base}/v1/callbacks/{cb}"
        return env

    def _act(self, spec: JobSpec, stage: Stage, call: StageCall, seq: int, stage_idx: int, token: str,
             outcome: Outcome | PlatformError, probe: bool = False, remember: bool = True,
             polled: PollState | None = None, resumed: bool = False) -> None:
        job_id, attempt = spec.job_id, call.envelope["attempt"]
        where = {"seq": seq, "stage": stage.name, "attempt": attempt}
        tid = target_id(stage.target)
        try:
            if isinstance(outcome, PlatformError) and outcome.outage and (
                    outcome.retry is Retry.RETRYABLE or stage.idempotent):
                self._outage(spec, stage, seq, stage_idx, token, outcome)
                return
            if probe:
                self._target_ok(tid)  # the target answered (whatever it said): its breaker closes
            if (isinstance(outcome, PlatformError) and outcome.retry is Retry.UNKNOWN
                    and not stage.idempotent and outcome.handle):
                # the flow may have run and the platform gave its run id: learn the outcome by polling
                # it rather than run it again (or fail it as outcome_unknown)
                self.ledger.note(job_id, "outcome_unknown_polling", **where, error=outcome.message[:500],
                                 **outcome.platform_ids)
                self._remember_run(spec, seq, token, outcome.handle)
                self._schedule_poll(spec, stage, seq, stage_idx, attempt, token, outcome.handle)
                return
            if isinstance(outcome, WaitingHuman) and outcome.resume is not None and outcome.watch:
                # a person decides it (an approval), or decided it already and the run was never resumed
                after = settle_wait(self, spec, seq, stage_idx, token, outcome, where, resumed)
                if after is not None:
                    self._act(spec, stage, call, seq, stage_idx, token, after, remember=remember,
                              polled=polled, resumed=True)
                return
            if isinstance(outcome, PlatformError) and outcome.code == WAITING_HUMAN:
                # shown as waiting on a person, with the platform's prompt; the batch fails with the type
                self.ledger.note(job_id, "waiting_on_person", **where, prompt=outcome.prompt,
                                 error=outcome.message[:500], **outcome.platform_ids)
            if isinstance(outcome, PlatformError):
                self.ledger.note(job_id, "platform_error", **where, error=outcome.message[:500],
                                 retry=outcome.retry.value, status=outcome.status, code=outcome.code,
                                 **outcome.platform_ids)
                delay = timedelta(seconds=outcome.retry_after_s) if outcome.retry_after_s else None
                error_type = outcome.code
                if outcome.retry is Retry.UNKNOWN and not stage.idempotent:
                    error_type = "outcome_unknown"
                self.ledger.fail(job_id, seq, token, outcome.message,
                                 retryable=outcome.retryable_for(stage.idempotent),
                                 error_type=error_type, actor="dispatcher", min_delay=delay,
                                 usage=outcome.usage)
            elif isinstance(outcome, Done):
                if outcome.platform_ids:
                    self.ledger.note(job_id, "platform_answered", **where, **outcome.platform_ids)
                if polled is not None:  # a polled run's time (a trigger's is kept with its slot)
                    self._note_latency(spec, stage, call)
                commit_answer(self.ledger, spec, stage, seq, token, outcome.answer)
            elif isinstance(outcome, Accepted):
                self.ledger.note(job_id, "awaiting_callback", **where, **outcome.platform_ids)
                if outcome.handle and remember:
                    self._remember_run(spec, seq, token, outcome.handle)
            elif isinstance(outcome, Running):
                polled = polled or PollState()
                if polled.changed(outcome.status):  # the log records state changes, not every poll
                    self.ledger.note(job_id, "platform_running", **where, platform_status=outcome.status,
                                     **outcome.platform_ids)
                if remember:
                    self._remember_run(spec, seq, token, outcome.handle)
                self._schedule_poll(spec, stage, seq, stage_idx, attempt, token, outcome.handle,
                                    polled.after(stage, outcome.status))
        except (StaleLease, NotFound, JobCancelled):
            log.info("answer dropped: lease no longer current job_id=%s seq=%s attempt=%s",
                     job_id, seq, attempt)

    def _release_slot(self, spec: JobSpec, stage: Stage, holder: str, sample: str | None) -> None:
        """Give the call's slot on its target back and, for a call the platform answered, keep its time in
        the tenant's latency list for the target (the newest LATENCY_KEPT; its dry runs estimate durations
        from it; per tenant, so no tenant learns of another's calls): one round trip."""
        tid = target_id(stage.target)
        if sample is None:
            self.ledger.r.zrem(self.ledger.keys.target_slots(tid), holder)
            return
        latency = self.ledger.keys.target_latency(tid, spec.tenant)
        pipe = self.ledger.r.pipeline(transaction=False)
        pipe.zrem(self.ledger.keys.target_slots(tid), holder)
        pipe.lpush(latency, sample)
        pipe.ltrim(latency, 0, LATENCY_KEPT - 1)
        pipe.execute()

    def _note_latency(self, spec: JobSpec, stage: Stage, call: StageCall) -> None:
        """A polled run finished: keep its time, from its platform call to now (see _release_slot)."""
        if call.run_deadline_s is None:
            return
        took_s = time.time() - call.run_deadline_s + stage.max_run.total_seconds()
        key = self.ledger.keys.target_latency(target_id(stage.target), spec.tenant)
        pipe = self.ledger.r.pipeline(transaction=False)
        pipe.lpush(key, latency_sample(took_s, call))
        pipe.ltrim(key, 0, LATENCY_KEPT - 1)
        pipe.execute()

    def _outage(self, spec: JobSpec, stage: Stage, seq: int, stage_idx: int, token: str,
                err: PlatformError) -> None:
        """The target is unavailable: the batch waits for it (no attempt spent), the target cools down,
        the job shows why; a target down past ``outage_pause_after`` pauses the job."""
        k, keys = self.ledger.keys.job(spec.job_id), self.ledger.keys
        tid = target_id(stage.target)
        parts = urlsplit(stage.target.get("url") or stage.target.get("base_url") or "")
        label = f"{parts.scheme}://{parts.netloc}"
        # two scripts, two slots (a Redis Cluster keeps a script in one): the target's breaker cools
        # down first, then the batch is given back until then. A crash between leaves the breaker
        # cooling and the lease to expire: no call is made twice, the batch is retried later.
        until_ms, since_ms = self.ledger.scripts.breaker(
            keys=[keys.target_breaker(tid), keys.target_waiting(tid)],
            args=[err.message[:500], int((err.retry_after_s or 0) * 1000), OUTAGE_FIRST_COOLDOWN_MS,
                  self._longest_cooldown_ms(err), spec.job_id])
        res = self.ledger.scripts.outage(
            keys=[k.job, k.batch(seq), k.leases, k.ready(stage_idx), k.log, k.audit, k.events],
            args=[token, err.message[:500], until_ms, since_ms, 0,
                  int(self.settings.outage_pause_after.total_seconds() * 1000), self.settings.log_maxlen,
                  label])
        if res[0] == "waiting":
            log.warning("target %s unavailable (%s): job_id=%s seq=%s waits until %s, no attempt spent",
                        label, err.message[:200], spec.job_id, seq, res[1])
        else:
            log.info("outage not recorded job_id=%s seq=%s: %s", spec.job_id, seq, "/".join(map(str, res)))

    def _longest_cooldown_ms(self, err: PlatformError) -> int:
        """The breaker's longest cooldown: ``outage_cooldown_max``, but at most BOOTING_COOLDOWN_MAX_MS
        while the platform answers that it is starting (it will take calls in seconds, not minutes)."""
        longest = int(self.settings.outage_cooldown_max.total_seconds() * 1000)
        return min(longest, BOOTING_COOLDOWN_MAX_MS) if err.booting else longest

    def _target_ok(self, tid: str) -> None:
        """A probe got an answer: close the target's breaker and clear the jobs' waiting reason."""
        r, keys = self.ledger.r, self.ledger.keys
        waiting = r.smembers(keys.target_waiting(tid))
        r.delete(keys.target_breaker(tid), keys.target_waiting(tid))
        for job_id in waiting:
            self.ledger.clear_waiting(job_id)
        log.info("target %s answers again; %d jobs no longer waiting", tid, len(waiting))


def latency_sample(took_s: float, call: StageCall) -> str:
    """One entry of a target's latency list: ``<ms> <items>`` (dryrun.latency_samples reads it)."""
    items = call.envelope.get("items")
    return f"{max(int(took_s * 1000), 0)} {len(items) if isinstance(items, list) else 0}"


def commit_answer(ledger: Ledger, spec: JobSpec, stage: Stage, seq: int, token: str,
                  answer: Answer) -> dict[str, Any]:
    """Commit a platform's answer (sync, polled or callback) through the ledger's one commit path; an
    answer that waits for a person opens an approval for the batch instead (its lease is released)."""
    if answer.waiting:
        return ledger.open_platform_approval(spec.job_id, seq, token, answer.prompt)
    if not answer.succeeded:
        return ledger.fail(spec.job_id, seq, token, answer.error_message or "platform reported failure",
                           retryable=answer.error_retryable, actor="platform", usage=answer.usage)
    next_cursor = answer.next_cursor if answer.has_next_cursor else ABSENT
    return ledger.complete(spec.job_id, seq, token, answer.output, next_cursor, usage=answer.usage)


# -- RQ entry points (importable by name; arguments are JSON) -----------------------------------

_LOCAL = threading.local()
_DISPATCHER: Dispatcher | None = None  # a process-wide override (tests run RQ jobs in-process)
_SHARED: dict[str, Any] = {}
_SHARED_LOCK = threading.Lock()


def dispatcher() -> Dispatcher:
    """This thread's Dispatcher, built once per thread from the environment.

    A worker runs several stage calls at once in threads (gateway/push/worker.py); each thread has its own
    HTTP session and RQ queue client. The settings and the Ledger (a thread-safe Redis connection pool
    and the spec cache, locked) are the process's one copy: a cache per thread would hold up to
    its bound in every thread.
    """
    if _DISPATCHER is not None:
        return _DISPATCHER
    d = getattr(_LOCAL, "dispatcher", None)
    if d is None:
        with _SHARED_LOCK:
            if "ledger" not in _SHARED:
                settings = Settings()
                url = settings.redis_url.get_secret_value() if settings.redis_url else None
                if url is None:
                    raise RuntimeError("push mode needs BATCHGATE_REDIS_URL (set by `batchgate up`)")
                _SHARED["settings"], _SHARED["ledger"] = settings, Ledger(client_for(url, settings), settings)
        d = _LOCAL.dispatcher = Dispatcher.build(_SHARED["settings"], _SHARED["ledger"])
    return d


def run_stage(job_id: str, seq: int, stage: int, attempt: int, token: str, wait: int = 0) -> None:
    try:
        dispatcher().run(job_id, seq, stage, attempt, token, wait)
    except BatchgateError as exc:
        log.warning("stage attempt not run job_id=%s seq=%s: %s", job_id, seq, exc.detail)


def poll_stage(job_id: str, seq: int, stage: int, attempt: int, token: str, handle: dict,
               wait_ms: int | None = None, seen: str = "") -> None:
    try:
        dispatcher().poll(job_id, seq, stage, attempt, token, handle, PollState(wait_ms, seen))
    except BatchgateError as exc:
        log.warning("poll not run job_id=%s seq=%s: %s", job_id, seq, exc.detail)


def pump_job(job_id: str) -> None:
    try:
        dispatcher().pump(job_id)
    except BatchgateError as exc:
        log.warning("pump skipped job_id=%s: %s", job_id, exc.detail)


def _call_outcome(outcome: Any) -> str:
    """A platform call's outcome as a bounded label: done, accepted, running, waiting_human, outage,
    retryable, if_idempotent, unknown or fatal."""
    if isinstance(outcome, WaitingHuman):
        return "waiting_human"
    if isinstance(outcome, PlatformError):
        if outcome.outage:
            return "outage"
        return outcome.retry.name.lower()
    if isinstance(outcome, Running):
        return "running"
    return type(outcome).__name__.lower()
