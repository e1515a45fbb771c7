"""Supervisor: expires leases that ran out, recovers jobs left running by a crash, applies retention,
and delivers event webhooks (gateway/push/webhooks.py, in a thread of its own).

A pass follows due work, not the number of jobs: it reads the due index (``<p>:due``, gateway/ledger/
due.py: job -> when it must next be looked at) for jobs due now, plus one page of a sweep that finds
lost index entries and a few full visits round robin (the safety net the old every-job pass was).

Several supervisors may run at once: each claims a due job (``supclaim``, SET NX PX) before looking at
it, recovery claims a job with SET NX before touching it, and the expire script re-checks every
deadline, so a lease is never expired twice.

Start-up recovery runs once per restart of the deployment, not once per supervisor start: whichever
process contacts Redis first after every earlier one stopped or crashed (a supervisor, a worker, an API
worker) runs ``recover_jobs`` before any of them may run a job (gateway/ledger/generation.py).
"""

from __future__ import annotations

import logging
import os
import socket
import threading
import time
from collections import deque
from typing import Any

from gateway import logs, metrics
from gateway.errors import BatchgateError, Conflict, CorruptRecord, NotFound
from gateway.ledger import archive
from gateway.ledger import due as due_index
from gateway.ledger.embedded import REDIS_DOWN
from gateway.ledger.generation import Generation
from gateway.ledger.ledger import Ledger
from gateway.ledger.liveness import Liveness
from gateway.ledger.multi import multi
from gateway.push.sinks import SinkDeliverer
from gateway.push.webhooks import Deliverer

log = logging.getLogger(__name__)

TERMINAL = ("succeeded", "failed", "cancelled")
RECOVERY_CLAIM_MS = 60_000
DUE_BATCH = 500  # due jobs claimed in one round trip
CLAIM_MS = 15_000  # a supervisor's claim on a job it is looking at (deleted when it is done)
SWEEP_S = 60.0  # a round of the lost-due-entry sweep starts at most this often
SWEEP_PAGE = 1000  # active jobs that sweep checks per pass (one SSCAN and one ZMSCORE)
SWEEP_VISITS = 20  # active jobs looked at in full per pass, round robin, due or not
RETRY_MAX_S = 2.0  # longest wait between two tries at start while Redis is down
REDIS_DOWN_LOG_S = 30.0  # while Redis stays down, one warning this often
GONE_SLACK_MS = 60_000  # a retired job's subscription cursors are dropped this long after its keys expire


def recovery_gate(ledger: Ledger, role: str) -> Generation:
    """This process's membership of the generation; if it must decide, it runs ``recover_jobs``."""
    actor = f"{role}@{socket.gethostname()}:{os.getpid()}"
    return Generation(ledger.r, ledger.keys, role, lambda gen_ms: recover_jobs(ledger, actor, gen_ms))


def recover_jobs(ledger: Ledger, actor: str, crash_ms: int | None = None) -> list[dict[str, Any]]:
    """Recover (auto) or hold (record) every job running now that was created at or before
    ``crash_ms`` (now if None); returns one report entry per job touched."""
    crash_ms = int(time.time() * 1000) if crash_ms is None else crash_ms
    report = []
    for job_id in sorted(ledger.r.smembers(ledger.keys.active)):
        try:
            entry = _recover_job(ledger, actor, job_id, crash_ms)
        except (NotFound, CorruptRecord) as exc:
            log.warning("recovery skipped job_id=%s: %s", job_id, exc.detail)
            continue
        if entry:
            report.append(entry)
    return report


def _recover_job(ledger: Ledger, actor: str, job_id: str, crash_ms: int) -> dict[str, Any] | None:
    k = ledger.keys.job(job_id)
    job = ledger.job_fields(job_id)
    if job["status"] != "running":
        return None
    if int(job.get("created_ms") or 0) > crash_ms:
        log.info("recovery: job_id=%s was created after the restart; nothing to recover", job_id)
        return None
    mode = ledger.settings.recovery
    leased = [int(s) for s in ledger.r.zrange(k.leases, 0, -1)]
    entry = {"job_id": job_id, "committed_cursor": job["committed_cursor"],
             "leased_batches": leased, "mode": mode}
    if mode == "record":
        # Held in the ledger: no expiry, pump, kick or queued call runs for it until released.
        # Only one of several deciders wins the running -> held change.
        try:
            ledger.hold(job_id, f"{actor} (recovery: record)",
                        f"found running at a restart; would resume from cursor "
                        f"{job['committed_cursor']} and return leased batches {leased} "
                        f"to the pool; release it to go on")
        except Conflict:
            return None
        log.warning("recovery (record only) job_id=%s held: would resume from cursor %s; "
                    "leased batches %s would return to the pool when their leases run out; "
                    "`batchgate jobs release %s` lets it go", job_id, job["committed_cursor"],
                    leased, job_id)
        entry["held"] = True
        return entry
    if not ledger.r.set(k.recover, actor, nx=True, px=RECOVERY_CLAIM_MS):
        return None
    expired = ledger.expire_due(job_id, actor=f"{actor} (recovery)")
    entry_fields = {"event": "job_recovered", "actor": actor, "expired": str(len(expired))}
    ledger.r.xadd(k.log, entry_fields, maxlen=ledger.settings.log_maxlen, approximate=True)
    ledger.r.xadd(k.audit, entry_fields)
    entry["expired_now"] = [seq for seq, _ in expired]
    metrics.RECOVERIES.inc()
    metrics.RECOVERY_SECONDS.observe(max(0.0, time.time() - crash_ms / 1000))
    log.info("recovered job_id=%s expired=%s", job_id, entry["expired_now"])
    return entry


class Supervisor:
    """One supervisor process (or thread); ``run`` loops until ``stop`` is set."""

    def __init__(self, ledger: Ledger, name: str | None = None, dispatcher: Any = None,
                 deliverer: Deliverer | None = None, sweep_visits: int = SWEEP_VISITS,
                 sweep_page: int = SWEEP_PAGE, sweep_s: float = SWEEP_S) -> None:
        self.ledger = ledger
        self.due = ledger.index.due  # when each active job must next be looked at (due.py)
        self.sweep_visits, self.sweep_page, self.sweep_s = sweep_visits, sweep_page, sweep_s
        self._check_cursor = 0  # the lost-entry sweep's place in the active set
        self._check_next = 0.0  # monotonic time its next round may start
        self._first_round = True
        self._visit_cursor = 0  # the round-robin full visits' place in the active set
        self._visit_buf: deque[str] = deque()
        self.deliverer = deliverer or Deliverer(ledger)  # webhooks: its own thread, started by run
        self.sinks = SinkDeliverer(ledger)  # result sinks: likewise (push/sinks.py)
        self.dispatcher = dispatcher
        self.settings = ledger.settings
        self.name = name or f"supervisor@{socket.gethostname()}:{os.getpid()}"
        self.generation = Generation(ledger.r, ledger.keys, "supervisor",
                                     lambda gen_ms: self.recover(gen_ms))
        self.stop = threading.Event()
        # /readyz and `batchgate health supervisor` read it: beats every pass, and within a long pass
        self.liveness = Liveness(ledger.r, ledger.keys, "supervisor",
                                 every_s=min(1.0, self.settings.supervisor_interval.total_seconds()))
        self._down_since: float | None = None  # monotonic time Redis was first found unavailable
        self._down_logged = 0.0

    def recover(self, crash_ms: int | None = None) -> list[dict[str, Any]]:
        """Find jobs left running by a crash and recover them, or only hold them (record mode).

        Only jobs created at or before ``crash_ms`` (the generation's start: see
        gateway/ledger/generation.py; now if not given) are touched: a job created after the restart
        was never running at the crash.
        """
        return recover_jobs(self.ledger, self.name, crash_ms)

    def tick(self) -> None:
        """One pass: look at the jobs the due index says are due (expire their due leases, time out
        approvals, retire finished jobs), then one step of each sweep (lost due entries; a few jobs
        looked at in full, round robin). Its cost follows due work, not the number of active jobs.
        First, on a cluster, jobs whose creation stopped between its slots are filed (creations.py)."""
        self.liveness.beat(force=True)
        self.ledger.creations.repair(due_index.now_ms())  # cluster: creations cut between slots
        self._sweep_check()
        seen: set[str] = set()
        while not self.stop.is_set():
            fresh = [j for j in self.due.due(due_index.now_ms(), DUE_BATCH) if j not in seen]
            if not fresh:
                break  # nothing more due (or only jobs this pass already looked at: next pass)
            seen.update(fresh)
            self._visit_many(fresh)
        self._sweep_visits()

    def tick_all(self) -> None:
        """Look at every active job in full (the pass before the due index; benchmarks compare)."""
        self.liveness.beat(force=True)
        for job_id in self.ledger.r.smembers(self.ledger.keys.active):
            self.liveness.beat()
            self._visit(job_id)

    def _visit_many(self, job_ids: list[str]) -> None:
        """Claim each job (another supervisor looking at it now keeps it), look at it, and settle its
        due entry; a job no longer active loses its entry."""
        r, keys = self.ledger.r, self.ledger.keys
        pipe = r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.set(keys.job(job_id).sup_claim, self.name, nx=True, px=CLAIM_MS)
            pipe.sismember(keys.active, job_id)
        got = pipe.execute()
        claimed, gone = [], []
        for job_id, won, active in zip(job_ids, got[0::2], got[1::2], strict=True):
            if won:
                (claimed if active else gone).append(job_id)
        settle = []
        try:
            for job_id in claimed:
                self.liveness.beat()  # a pass over many jobs: still alive
                if self._visit(job_id):
                    settle.append(job_id)
            self.due.settle(settle)
        finally:
            pipe = r.pipeline(transaction=False)
            for job_id in gone:
                self.due.drop(pipe, job_id)
            for job_id in claimed + gone:
                pipe.delete(keys.job(job_id).sup_claim)
            pipe.execute()

    def _visit(self, job_id: str) -> bool:
        """Look at one job; False if it left supervision (retired, or its record is gone)."""
        try:
            with logs.bind(job_id=job_id):
                return self._tick_job(job_id)
        except (NotFound, CorruptRecord):
            pipe = self.ledger.r.pipeline(transaction=False)
            pipe.srem(self.ledger.keys.active, job_id)
            self.due.drop(pipe, job_id)
            pipe.execute()
            self.ledger.forget(job_id)
            return False
        except BatchgateError as exc:  # e.g. its source is unreachable: other jobs go on
            log.warning("supervisor: job_id=%s skipped this pass: %s", job_id, exc.detail)
        except REDIS_DOWN:
            raise  # the whole pass waits for Redis (run)
        except Exception:  # noqa: BLE001 - one job's surprise must not stop the others' expiry
            log.exception("supervisor: job_id=%s skipped this pass after an unexpected error", job_id)
        return True

    def _sweep_check(self) -> None:
        """Find active jobs whose due entry was lost and file them: one page of the active set per
        pass (ZMSCORE: no per-job read), a round at most every ``sweep_s``; the first round after
        start runs whole (an upgrade from data written before the index files every job at once)."""
        r, keys = self.ledger.r, self.ledger.keys
        if self._first_round and self._check_cursor == 0:
            moved = self.due.adopt_strays()  # BATCHGATE_DUE_SHARDS changed: entries of old shards
            if moved:
                log.warning("supervisor: moved %d entries of old due index shards to their shards", moved)
        if self._check_cursor == 0:
            if time.monotonic() < self._check_next:
                return
            self._check_next = time.monotonic() + self.sweep_s
        while True:
            self._check_cursor, ids = r.sscan(keys.active, self._check_cursor, count=self.sweep_page)
            lost = self.due.missing(list(dict.fromkeys(ids)))
            if lost:
                log.warning("supervisor: %d active job(s) had no due entry; filing them", len(lost))
                for start in range(0, len(lost), DUE_BATCH):
                    self.due.settle(lost[start:start + DUE_BATCH])
            if self._check_cursor == 0:
                self._first_round = False
                return
            if not self._first_round:
                return
            self.liveness.beat()

    def _sweep_visits(self) -> None:
        """Look at ``sweep_visits`` active jobs in full, round robin over the active set: the slow
        safety net the old every-job pass was (index check, lost approval listings, pump)."""
        if self.sweep_visits <= 0:
            return
        buf = self._visit_buf
        while len(buf) < self.sweep_visits:
            self._visit_cursor, ids = self.ledger.r.sscan(self.ledger.keys.active, self._visit_cursor,
                                                          count=max(100, self.sweep_visits))
            buf.extend(ids)
            if self._visit_cursor == 0:
                break
        batch = list(dict.fromkeys(buf.popleft() for _ in range(min(self.sweep_visits, len(buf)))))
        if batch:
            self._visit_many(batch)

    def _tick_job(self, job_id: str) -> bool:
        job = self.ledger.job_fields(job_id)
        if job.get("corrupt"):
            raise CorruptRecord(f"job {job_id} failed its checksum")
        if self.ledger.index.check(job_id, job):  # a status change whose index update was lost
            log.warning("supervisor: job index repaired job_id=%s status=%s", job_id, job["status"])
        waiting = int(job.get("n_waiting") or 0) > 0 and job["status"] != "cancelled"
        gated = waiting or (bool(self.ledger.spec(job_id).flow.gates()) and job["status"] not in TERMINAL)
        if job["status"] != "held" and gated:
            self._approvals(job_id)
            job = self.ledger.job_fields(job_id)  # a decision may have moved the job on
            waiting = int(job.get("n_waiting") or 0) > 0 and job["status"] != "cancelled"
        if job["status"] in TERMINAL and not waiting:
            self._retire(job_id, job["status"])
            return False
        if job["status"] in ("running", "paused", "waiting_human"):  # a held job is left as it is
            self.ledger.expire_due(job_id, actor=self.name)
            if self.dispatcher is not None and job["status"] == "running":
                self.dispatcher.pump(job_id)
        return True

    def _approvals(self, job_id: str) -> None:
        """Open approvals for batches re-opened at an approval stage, decide those past their deadline
        (on_timeout, actor supervisor:timeout), and file pending ones the listing lost."""
        approvals = self.ledger.approvals
        spec = self.ledger.spec(job_id)
        if spec.flow.gates():
            approvals.open_ready(job_id)
        for approval_id, outcome in approvals.apply_timeouts(job_id):
            log.info("approval timed out approval=%s job_id=%s outcome=%s", approval_id, job_id, outcome)
        if approvals.heal(job_id, spec.tenant):  # usually an opening whose listing write is in flight
            log.info("supervisor: approval listing filed job_id=%s", job_id)

    def _retire(self, job_id: str, status: str) -> None:
        self._count_recovered(job_id, status)
        pipe = multi(self.ledger.r)  # its events stay watched by the deliverer
        if status != "failed":
            spec = self.ledger.spec(job_id)
            self.ledger.expire_job(job_id, spec.flow.retention)
            # a finished job frees its place in the tenant's active-jobs quota now, not at the next
            # prune (which runs only once the set is full, and only one process at a time)
            pipe.srem(self.ledger.keys.quota_active(spec.tenant), job_id)
            # once retention removed it, the webhook deliverer drops its subscriptions' cursors
            gone_ms = int(time.time() * 1000 + spec.flow.retention.total_seconds() * 1000) + GONE_SLACK_MS
            pipe.zadd(self.ledger.keys.events_gone, {f"{job_id} {spec.tenant}": gone_ms})
        pipe.sadd(self.ledger.keys.events_pending, job_id)
        pipe.srem(self.ledger.keys.active, job_id)
        self.due.drop(pipe, job_id)
        pipe.execute()
        self.ledger.forget(job_id)  # this process will not look at it again: no spec kept for it
        log.info("job retired from supervision job_id=%s status=%s", job_id, status)

    def _count_recovered(self, job_id: str, status: str) -> None:
        """A job that went through a recovery ends: count how (the resume success rate's parts)."""
        try:
            entries = archive.entries(self.ledger.r, self.ledger.keys.job(job_id), "audit", count=10_000)
        except REDIS_DOWN:
            return
        if any(fields.get("event") == "job_recovered" for _, fields in entries):
            metrics.RECOVERED_JOBS.labels(status).inc()

    def run(self) -> None:
        """Join the generation (deciding start-up recovery if this is the first process after a
        restart, else waiting for the one that decides), then tick every ``supervisor_interval``.

        A Redis that is down (or restarting, or loading its AOF) is waited for, at start as well as
        between ticks: the process never exits for it, and redis-py reconnects by itself. No tick runs
        before recovery is decided (record mode must hold jobs before anything expires them), nor while
        a later generation's recovery is being decided by another process.
        """
        pause = 0.1
        while not self.stop.is_set():
            try:
                self.ledger.check_digest_agreement()
                if self.generation.ready(wait_s=1.0):
                    self.ledger.index.ensure_built()  # jobs older than the index, once
                    self._redis_back()
                    break
            except REDIS_DOWN as exc:
                self._redis_down(exc, "recovery at start")
                self.stop.wait(pause)
                pause = min(pause * 2, RETRY_MAX_S)
        interval = self.settings.supervisor_interval.total_seconds()
        webhooks = threading.Thread(target=self.deliverer.run, name="webhooks", daemon=True)
        webhooks.start()  # deliveries wait on receivers; lease expiry must not wait on them
        sinks = threading.Thread(target=self.sinks.run, name="sinks", daemon=True)
        sinks.start()
        while not self.stop.is_set():
            try:
                if self.generation.ready():
                    self.tick()
                self._redis_back()
            except REDIS_DOWN as exc:
                self._redis_down(exc, "tick")
            except Exception:  # noqa: BLE001 - leases must keep expiring: log it and tick again
                log.exception("supervisor: a pass failed; ticking again")
            self.stop.wait(interval)
        self.deliverer.stop.set()
        self.sinks.stop.set()
        webhooks.join(timeout=10)
        sinks.join(timeout=10)
        self.generation.leave()
        try:
            self.liveness.gone()
        except REDIS_DOWN:
            pass  # its beat ages out

    def _redis_down(self, exc: Exception, doing: str) -> None:
        """Log that Redis is unavailable: at once, then at most every REDIS_DOWN_LOG_S while it lasts."""
        now = time.monotonic()
        if self._down_since is None:
            self._down_since = self._down_logged = now
            log.warning("supervisor: ledger redis unavailable (%s) during %s; waiting for it",
                        type(exc).__name__, doing)
        elif now - self._down_logged >= REDIS_DOWN_LOG_S:
            self._down_logged = now
            log.warning("supervisor: ledger redis still unavailable after %.0f s (%s); waiting for it",
                        now - self._down_since, type(exc).__name__)

    def _redis_back(self) -> None:
        if self._down_since is not None:
            log.warning("supervisor: ledger redis reachable again after %.1f s",
                        time.monotonic() - self._down_since)
            self._down_since = None
