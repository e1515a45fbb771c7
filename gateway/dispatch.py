"""Push mode: batchgate triggers each platform stage itself, one RQ job per stage attempt.

pump(job)       leases ready push-stage batches (within concurrency and per-target limits) and enqueues
                ``run_stage`` for each, with the deterministic RQ job id ``bg-<job>-<seq>-<stage>-<attempt>``.
run_stage(...)  takes a slot on the stage's target, builds the envelope, calls the connector, and acts on
                the outcome: commit or fail through the ledger, wait for the callback, or schedule a poll.
poll_stage(...) heartbeats the lease and polls the platform run.

The ledger's lease token fences everything: a late worker, a duplicate RQ job or a callback that beat the
trigger's answer all end as 'stale' or 'duplicate' in the ledger and change nothing.
"""

from __future__ import annotations

import hashlib
import logging
import secrets
import threading
from dataclasses import dataclass
from datetime import timedelta
from typing import Any
from urllib.parse import urlsplit

import redis
import requests
from rq import Queue
from rq.serializers import JSONSerializer

import connectors
from connectors.base import (
    Accepted,
    Answer,
    Connector,
    Done,
    Outcome,
    PlatformError,
    Retry,
    Running,
    StageCall,
)
from gateway.embedded import client_for
from gateway.errors import BatchgateError, JobCancelled, NotFound, StaleLease
from gateway.flows import Stage
from gateway.jobspec import JobSpec
from gateway.ledger import ABSENT, Ledger, idempotency_key
from gateway.outbound import session_for
from gateway.records import loads_or_none
from gateway.security import sign
from gateway.settings import Settings
from gateway.urlguard import Allowlist, UnsafeURL, check_url

log = logging.getLogger(__name__)

QUEUE_NAME = "batchgate"
DEFAULT_TARGET_LIMIT = 8
SLOT_WAIT = timedelta(milliseconds=500)
#: Set when this worker process is stopping (SIGTERM): no new pump, and a stage attempt dequeued now
#: gives its lease back without a call (no attempt spent) instead of calling the platform.
STOPPING = threading.Event()


def target_id(target: dict[str, Any]) -> str:
    """Targets are limited per platform endpoint: the scheme, host and port they call."""
    parts = urlsplit(target.get("url") or target.get("base_url") or "")
    return hashlib.sha1(f"{parts.scheme}://{parts.netloc}".encode()).hexdigest()[:16]


def target_urls(target: dict[str, Any]) -> list[str]:
    """Every URL a target may call (trigger and poll)."""
    return [target[k] for k in ("url", "base_url", "api_url") if target.get(k)]


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
    """Push-mode operations for one process (API, worker or supervisor)."""

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
        ledger = ledger or Ledger(client_for(url), settings)
        qurl = settings.queue_redis_url.get_secret_value() if settings.queue_redis_url else url
        queue = TokenlessQueue(QUEUE_NAME, connection=redis.Redis.from_url(qurl), serializer=JSONSerializer)
        # every trigger and poll goes through the outbound guard: checked addresses, checked redirect hops
        return cls(settings, ledger, queue, session_for(settings), Allowlist.parse(settings.outbound_allow))

    # -- pump ------------------------------------------------------------------------------

    def pump(self, job_id: str) -> int:
        """Lease every push-stage batch that may start now and enqueue its attempt; returns how many.

        The lease runs for ``dispatch_queue_timeout`` while the attempt waits in RQ's queue for a free
        worker slot; begin.lua restarts it with the stage's lease when the call starts. A queue lease
        that runs out (no worker for that long) is released without spending an attempt (expire.lua).
        """
        if STOPPING.is_set():
            return 0
        spec = self.ledger.spec(job_id)
        queue_ms = int(self.settings.dispatch_queue_timeout.total_seconds() * 1000)
        push = [i for i, s in enumerate(spec.flow.stages) if s.target is not None]
        enqueued = 0
        while push and enqueued < spec.flow.concurrency:
            open_stages = [i for i in push if self._target_open(spec.flow.stages[i])]
            lease = self.ledger.lease_stages(job_id, open_stages, lease_ms=queue_ms)
            if lease is None:
                break
            self._enqueue_run(spec, lease.seq, lease.stage_index, lease.attempt, lease.lease_token)
            enqueued += 1
        return enqueued

    def _target_open(self, stage: Stage) -> bool:
        tid = target_id(stage.target)
        r = self.ledger.r
        if r.pttl(self.ledger.keys.target_cooldown(tid)) > 0:
            return False
        limit = stage.target.get("max_in_flight", DEFAULT_TARGET_LIMIT)
        return r.zcount(self.ledger.keys.target_slots(tid), "(" + str(_now_ms(r)), "+inf") < limit

    def _enqueue_run(self, spec: JobSpec, seq: int, stage: int, attempt: int, token: str,
                     wait: int = 0) -> None:
        job_id = f"bg-{spec.job_id}-{seq}-{stage}-{attempt}" + (f"-w{wait}" if wait else "")
        timeout = int(spec.flow.stages[stage].timeout.total_seconds()) + 30
        args = (spec.job_id, seq, stage, attempt, token, wait)
        if wait:
            self.queue.enqueue_in(SLOT_WAIT, run_stage, *args, job_id=job_id, job_timeout=timeout,
                                  result_ttl=60, failure_ttl=86400)
        else:
            self.queue.enqueue(run_stage, *args, job_id=job_id, job_timeout=timeout, result_ttl=60,
                               failure_ttl=86400)

    def kick(self, job_id: str) -> None:
        """Ask a worker to pump ``job_id`` soon (after a job is created or a callback commits)."""
        self.queue.enqueue(pump_job, job_id, result_ttl=0, failure_ttl=3600)

    # -- one stage attempt -----------------------------------------------------------------

    def run(self, job_id: str, seq: int, stage_idx: int, attempt: int, token: str, wait: int) -> None:
        """Trigger one stage attempt and act on the platform's answer."""
        spec = self.ledger.spec(job_id)
        stage = spec.flow.stages[stage_idx]
        holder = f"{job_id}:{seq}:{stage_idx}:{attempt}:{secrets.token_hex(4)}"
        if STOPPING.is_set():  # this worker is stopping: the batch goes back, no call, no attempt spent
            self._begin(spec, stage, seq, stage_idx, token, mode="release")
            return
        if not wait and not self._begin(spec, stage, seq, stage_idx, token, mode="claim"):
            return  # off the queue: the stage's lease clock starts (a worker killed now costs no attempt)
        if not self._take_slot(stage, holder):
            self._wait_for_slot(spec, seq, stage_idx, attempt, token, wait)
            return
        try:
            if not self._begin(spec, stage, seq, stage_idx, token):
                return
            call = self._call(spec, stage, seq, stage_idx, attempt, token)
            if call is None:
                return
            outcome = self._guarded(call, stage, lambda: self._connector(stage).trigger(call, self.session))
        finally:
            self.ledger.r.zrem(self.ledger.keys.target_slots(target_id(stage.target)), holder)
        self._act(spec, stage, call, seq, stage_idx, token, outcome)

    def poll(self, job_id: str, seq: int, stage_idx: int, attempt: int, token: str,
             handle: dict[str, Any]) -> None:
        """Poll a platform run; keep the lease alive while it runs."""
        spec = self.ledger.spec(job_id)
        stage = spec.flow.stages[stage_idx]
        if self.ledger.r.hget(self.ledger.keys.job(job_id).job, "status") == "held":
            # record-only recovery: no call runs for a held job; ask again later, lease untouched
            self.queue.enqueue_in(stage.poll_interval, poll_stage, job_id, seq, stage_idx, attempt,
                                  token, handle, result_ttl=60, failure_ttl=86400)
            return
        try:
            self.ledger.heartbeat(job_id, seq, token)
        except (StaleLease, NotFound, JobCancelled):
            return
        call = self._call(spec, stage, seq, stage_idx, attempt, token)
        if call is None:
            return
        outcome = self._guarded(call, stage, lambda: self._connector(stage).poll(call, handle, self.session))
        self._act(spec, stage, call, seq, stage_idx, token, outcome)

    def _begin(self, spec: JobSpec, stage: Stage, seq: int, stage_idx: int, token: str,
               mode: str = "") -> bool:
        """The ledger's word that this call may start now (begin.lua): the lease is current and the
        job running. A cancel voids leases, so no call starts after it; a paused or held job gets the
        batch back in its ready set without spending an attempt."""
        k = self.ledger.keys.job(spec.job_id)
        res = self.ledger.scripts.begin(
            keys=[k.job, k.batch(seq), k.leases, k.ready(stage_idx), k.log],
            args=[token, int(stage.lease.total_seconds() * 1000), self.settings.log_maxlen,
                  mode])
        if res[0] == "ok":
            return True
        log.info("call not started job_id=%s seq=%s: %s", spec.job_id, seq, "/".join(map(str, res)))
        return False

    def _take_slot(self, stage: Stage, holder: str) -> bool:
        tid = target_id(stage.target)
        k = self.ledger.keys
        lifetime_ms = int(stage.timeout.total_seconds() * 1000) + 5000
        res = self.ledger.scripts.slot(keys=[k.target_slots(tid), k.target_cooldown(tid)],
                                       args=[stage.target.get("max_in_flight", DEFAULT_TARGET_LIMIT),
                                             holder, lifetime_ms])
        return res[0] == "ok"

    def _wait_for_slot(self, spec: JobSpec, seq: int, stage_idx: int, attempt: int, token: str,
                       wait: int) -> None:
        try:
            self.ledger.heartbeat(spec.job_id, seq, token)
        except (StaleLease, NotFound, JobCancelled):
            return
        self._enqueue_run(spec, seq, stage_idx, attempt, token, wait + 1)

    def _connector(self, stage: Stage) -> Connector:
        return connectors.get_connector(stage.target["type"])

    def _guarded(self, call: StageCall, stage: Stage, fn) -> Outcome | PlatformError:
        """Run a connector call behind the URL guard; failures come back as values.

        The URLs are checked here for a clear message; ``self.session`` checks again on each connection
        and redirect hop (a refusal there is a FATAL PlatformError from the connector)."""
        try:
            for url in target_urls(stage.target):
                check_url(url, self.allow)
            return fn()
        except UnsafeURL as exc:
            return PlatformError(exc.detail, Retry.FATAL)
        except PlatformError as exc:
            if exc.retry_after_s or exc.status == 429:
                cooldown_ms = int((exc.retry_after_s or 1.0) * 1000)
                self.ledger.r.set(self.ledger.keys.target_cooldown(target_id(stage.target)), "1",
                                  px=max(cooldown_ms, 1))
            return exc

    def _call(self, spec: JobSpec, stage: Stage, seq: int, stage_idx: int, attempt: int,
              token: str) -> StageCall | None:
        """The StageCall for a live lease, or None when the lease is gone (stale attempt)."""
        try:
            batch = self.ledger.batch_record(spec.job_id, seq)
        except NotFound:
            return None
        if batch.get("status") != "leased" or batch.get("lease_token") != token:
            return None
        envelope = self._envelope(spec, stage, batch, seq, stage_idx, attempt, token)
        names = {k: v for k, v in stage.target.items() if k.endswith("_secret") and isinstance(v, str)}
        # the job's tenant's own secrets, then the shared "*" ones; never another tenant's
        resolved = {k: value for k, v in names.items()
                    if (value := self.settings.secret_for(spec.tenant, v)) is not None}
        return StageCall(envelope=envelope, target=stage.target, secrets=resolved,
                         timeout_s=stage.timeout.total_seconds(),
                         signing_key=self.settings.signing_secret(), idempotent=stage.idempotent)

    def _envelope(self, spec: JobSpec, stage: Stage, batch: dict[str, str], seq: int, stage_idx: int,
                  attempt: int, token: str) -> dict[str, Any]:
        k = self.ledger.keys.job(spec.job_id)
        items_raw = self.ledger.r.get(k.items(seq))
        ttl_s = stage.lease.total_seconds() + self.settings.callback_grace.total_seconds()
        base = self.settings.base_url()
        key = self.settings.signing_secret()
        env: dict[str, Any] = {
            "job_id": spec.job_id, "seq": seq, "stage": stage.name, "attempt": attempt,
            "idempotency_key": idempotency_key(spec.job_id, seq, stage.name),
            "cursor": loads_or_none(batch.get("start_cursor")),
            "input": loads_or_none(batch.get(f"out:{stage_idx - 1}")), "params": spec.params,
        }
        if items_raw and len(items_raw.encode()) > self.settings.inline_max_bytes:
            blob = sign({"j": spec.job_id, "s": seq}, key, "blob", ttl_s)
            env["items"], env["items_url"] = None, f"{base}/v1/blobs/{blob}"
        else:
            env["items"] = loads_or_none(items_raw)
        if stage.target.get("mode") == "callback":
            cb = sign({"j": spec.job_id, "s": seq, "st": stage_idx, "a": attempt, "t": token}, key,
                      "callback", ttl_s)
            env["callback_url"] = f"{base}/v1/callbacks/{cb}"
        return env

    def _act(self, spec: JobSpec, stage: Stage, call: StageCall, seq: int, stage_idx: int, token: str,
             outcome: Outcome | PlatformError) -> None:
        job_id, attempt = spec.job_id, call.envelope["attempt"]
        where = {"seq": seq, "stage": stage.name, "attempt": attempt}
        try:
            if isinstance(outcome, PlatformError):
                self.ledger.note(job_id, "platform_error", **where, error=outcome.message[:500],
                                 retry=outcome.retry.value, status=outcome.status, code=outcome.code,
                                 **outcome.platform_ids)
                delay = timedelta(seconds=outcome.retry_after_s) if outcome.retry_after_s else None
                self.ledger.fail(job_id, seq, token, outcome.message,
                                 retryable=outcome.retryable_for(stage.idempotent),
                                 error_type=outcome.code, actor="dispatcher", min_delay=delay)
            elif isinstance(outcome, Done):
                self.ledger.note(job_id, "platform_answered", **where, **outcome.platform_ids)
                commit_answer(self.ledger, spec, stage, seq, token, outcome.answer)
            elif isinstance(outcome, Accepted):
                self.ledger.note(job_id, "awaiting_callback", **where, **outcome.platform_ids)
            elif isinstance(outcome, Running):
                self.ledger.note(job_id, "platform_running", **where, **outcome.platform_ids)
                self.queue.enqueue_in(stage.poll_interval, poll_stage, job_id, seq, stage_idx, attempt,
                                      token, outcome.handle, result_ttl=60, failure_ttl=86400)
        except (StaleLease, NotFound, JobCancelled):
            log.info("answer dropped: lease no longer current job_id=%s seq=%s attempt=%s",
                     job_id, seq, attempt)
        self.pump(job_id)


def commit_answer(ledger: Ledger, spec: JobSpec, stage: Stage, seq: int, token: str,
                  answer: Answer) -> dict[str, Any]:
    """Commit a platform's answer (sync, polled or callback) through the ledger's one commit path."""
    if not answer.succeeded:
        return ledger.fail(spec.job_id, seq, token, answer.error_message or "platform reported failure",
                           retryable=answer.error_retryable, actor="platform")
    next_cursor = answer.next_cursor if answer.has_next_cursor else ABSENT
    return ledger.complete(spec.job_id, seq, token, answer.output, next_cursor)


def _now_ms(r: redis.Redis) -> int:
    sec, usec = r.time()
    return sec * 1000 + usec // 1000


# -- RQ entry points (importable by name; arguments are JSON) -----------------------------------

_LOCAL = threading.local()
_DISPATCHER: Dispatcher | None = None  # a process-wide override (tests run RQ jobs in-process)


def dispatcher() -> Dispatcher:
    """This thread's Dispatcher, built once per thread from the environment.

    A worker runs several stage calls at once in threads (gateway/worker.py); each thread has its own
    HTTP session and Redis clients, so nothing in a Dispatcher is shared between concurrent calls.
    """
    if _DISPATCHER is not None:
        return _DISPATCHER
    d = getattr(_LOCAL, "dispatcher", None)
    if d is None:
        d = _LOCAL.dispatcher = Dispatcher.build(Settings())
    return d


def run_stage(job_id: str, seq: int, stage: int, attempt: int, token: str, wait: int = 0) -> None:
    try:
        dispatcher().run(job_id, seq, stage, attempt, token, wait)
    except BatchgateError as exc:
        log.warning("stage attempt not run job_id=%s seq=%s: %s", job_id, seq, exc.detail)


def poll_stage(job_id: str, seq: int, stage: int, attempt: int, token: str, handle: dict) -> None:
    try:
        dispatcher().poll(job_id, seq, stage, attempt, token, handle)
    except BatchgateError as exc:
        log.warning("poll not run job_id=%s seq=%s: %s", job_id, seq, exc.detail)


def pump_job(job_id: str) -> None:
    try:
        dispatcher().pump(job_id)
    except BatchgateError as exc:
        log.warning("pump skipped job_id=%s: %s", job_id, exc.detail)
