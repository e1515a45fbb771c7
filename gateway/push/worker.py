"""``batchgate worker --concurrency N``: one process, up to N push-mode stage calls in flight.

Feeding from the ledger. A feeder thread leases a ready push-stage batch only when one of the N call
threads is free and hands it to that thread, which calls the platform at once: the lease clock starts
when the call starts, and no batch holds a lease while it waits for a worker (nothing waits in a queue
that can outlive a worker). The ledger's ready sets are the queue (their scores are the scheduler: a
retry's backoff, a target's cooldown); lease.lua hands each batch to exactly one caller across every
thread of every worker process on every machine. The flow's ``concurrency`` (lease.lua), each target's
``max_in_flight`` and circuit breaker (slot.lua, breaker.lua) live in Redis and hold across all of them.

Why not one RQ job per batch (the design before): RQ's per-job bookkeeping (enqueue, dequeue, started
and finished registries, results) cost more than the ledger's own work per batch, a batch leased for
dispatch held a lease while it waited in RQ's queue, and a queued job is a second copy of state the
ledger already holds. RQ stays the scheduler for polls (``poll_stage`` via ``enqueue_in``, run by a few
RQ worker threads in this process, whose registries stay correct) and for attempts enqueued by older
versions (``run_stage`` now gives such a lease back unspent; the feeder leases the batch again).

Why threads: a stage call is a blocking ``requests`` call that spends its time waiting on the platform
(I/O bound; the GIL is released while waiting), and the connectors, the outbound guard and redis-py are
synchronous; an event loop would mean rewriting all of them. Each thread has its own Dispatcher (HTTP
session, Redis clients; gateway.push.dispatch.dispatcher()).

Which jobs. Jobs with push stages are in the ``push:jobs`` set (a kick adds them: job created, resumed, a
callback committed); the feeder also looks through the active set every RESCAN_S. A job with nothing to
lease is looked at again after an idle backoff (IDLE_FIRST_S doubling to IDLE_MAX_S) unless kicked.

Restarts of the deployment. Before it starts a poll thread or the feeder, the worker joins the
deployment's generation (gateway/ledger/generation.py): if it is the first process after a restart it
runs start-up recovery itself (in ``record`` mode: holds every job left running), else it waits until
the process that decides has done so. So a worker started before the supervisor calls no platform for a
job left running by the crash before that job's hold is decided. It renews its membership as it feeds,
and leaves on a clean stop.

Redis restarts. The feeder and the poll threads wait and reconnect; a call thread keeps a platform's
answer until Redis takes it (Dispatcher._durably), so an answer is not lost and paid for again.

Stopping. SIGTERM/SIGINT: the feeder leases nothing more; calls in flight get ``worker_grace`` to finish
and commit; the process then exits. A call still running after the grace keeps its lease, which expires
and is retried as any lost call is. A second signal exits at once. SIGKILL loses nothing committed: the
ledger holds every lease, and a killed call's lease expires and is retried (its attempt counts: the
platform may have been paid for it).
"""

from __future__ import annotations

import logging
import random
import signal
import threading
import time
from typing import Any

from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.logutils import setup_loghandlers
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from gateway import logs, tracing
from gateway.errors import BatchgateError, CorruptRecord, NotFound
from gateway.ledger.embedded import REDIS_DOWN
from gateway.ledger.liveness import Liveness
from gateway.push import dispatch
from gateway.push.supervisor import recovery_gate

log = logging.getLogger(__name__)

#: RQ worker TTL for the poll threads (their registration expires this long after the last heartbeat).
THREAD_WORKER_TTL = 60
#: An idle RQ thread wakes this often (seconds) to heartbeat and see a stop request.
IDLE_WAKE_S = 2
#: A job with nothing to lease is looked at again after this long, doubling up to IDLE_MAX_S.
IDLE_FIRST_S = 0.05
IDLE_MAX_S = 1.0
#: The feeder's longest sleep when nothing was leased (kicks from other processes are read after it).
FEED_IDLE_S = 0.1
#: How often the feeder looks through the active set for push jobs no kick registered.
RESCAN_S = 30.0
#: RQ threads that run polls, at most.
POLL_THREADS_MAX = 4
#: Job statuses that never lease again unless resumed (a resume kicks the job back in).
DONE = ("succeeded", "cancelled", "failed")


class ThreadWorker(SimpleWorker):
    """An RQ SimpleWorker that runs polls in a thread of a ``batchgate worker`` process.

    Job timeouts use a timer (SIGALRM only reaches the main thread); signals belong to the process's
    main thread (PushWorker), which asks each thread to stop.
    """

    death_penalty_class = TimerDeathPenalty

    def _install_signal_handlers(self) -> None:
        pass

    def dequeue_job_and_maintain_ttl(self, timeout: int | None, max_idle_time: int | None = None) -> Any:
        """RQ's dequeue, waking every IDLE_WAKE_S to see a stop request (RQ's own waits on forever)."""
        while True:
            if self._stop_requested:
                raise StopRequested()
            result = super().dequeue_job_and_maintain_ttl(timeout, max_idle_time=IDLE_WAKE_S)
            if result is not None or timeout is None:
                return result


class PollWorkers:
    """A few RQ worker threads on the batchgate queue (polls, old attempts) and RQ's scheduler.

    RQ's ``work()`` returns or raises when Redis goes away; each thread starts it again (a new worker
    registration) after Redis is back, until stopped.
    """

    def __init__(self, queue: Any, count: int, logging_level: str = "INFO") -> None:
        self.queue = queue
        self.count = max(1, count)
        self.logging_level = logging_level
        self.stop = threading.Event()
        self.workers: list[ThreadWorker] = []
        self.threads: list[threading.Thread] = []

    def start(self, burst: bool = False) -> None:
        for i in range(self.count):
            t = threading.Thread(target=self._run, args=(i == 0, burst), name=f"bg-poll-{i}", daemon=True)
            t.start()
            self.threads.append(t)
            if i == 0:
                time.sleep(0.1)  # RQ forks its scheduler from the first thread: before the others exist

    def _run(self, with_scheduler: bool, burst: bool) -> None:
        pause = 0.5
        while not self.stop.is_set():
            worker = ThreadWorker([self.queue], connection=self.queue.connection, serializer=JSONSerializer,
                                  worker_ttl=THREAD_WORKER_TTL)
            self.workers.append(worker)
            try:
                dispatch.dispatcher()  # this thread's session and clients, built before its first job
                worker.work(burst=burst, with_scheduler=with_scheduler, logging_level=self.logging_level)
                if burst or worker._stop_requested:
                    return
                pause = 0.5
            except REDIS_DOWN as exc:
                log.warning("poll worker: redis unavailable (%s); reconnecting in %.1f s",
                            type(exc).__name__, pause)
            except BaseException:  # noqa: BLE001 - a thread's death is logged, then it starts again
                log.exception("poll worker thread %s stopped; starting again", worker.name)
            finally:
                self.workers.remove(worker)
            self.stop.wait(pause)
            pause = min(pause * 2, 5.0)

    def request_stop(self) -> None:
        self.stop.set()
        for w in list(self.workers):
            w._stop_requested = True  # RQ's flag: leave the work loop after the current job

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)


class PushWorker:
    """One ``batchgate worker`` process: a feeder, ``concurrency`` call threads, a few poll threads."""

    def __init__(self, queue: Any, concurrency: int, grace_s: float, logging_level: str = "INFO",
                 poll_threads: int | None = None) -> None:
        self.queue = queue
        self.concurrency = max(1, int(concurrency))
        self.grace_s = grace_s
        self.logging_level = logging_level
        self.stop = threading.Event()
        self.freed = threading.Event()
        self.lock = threading.Lock()
        self.busy = 0
        self.backoff: dict[str, tuple[float, float]] = {}  # job id -> (look again at, current step)
        self.polls = PollWorkers(queue, poll_threads or min(self.concurrency, POLL_THREADS_MAX),
                                 logging_level)
        self.work_items: list[tuple[str, Any]] = []
        self.have_work = threading.Condition(self.lock)
        self.generation: Any = None  # run(): this process's membership of the generation

    # -- call threads ----------------------------------------------------------------------------

    def _call_loop(self) -> None:
        try:  # this thread's session and clients, built before its first call (not mid-run)
            dispatch.dispatcher()
        except Exception:  # noqa: BLE001 - built again at the first call
            log.exception("worker: could not prepare a call thread")
        while True:
            with self.have_work:
                while not self.work_items:
                    if self.stop.is_set():
                        return
                    self.have_work.wait(0.5)
                job_id, lease = self.work_items.pop()
            try:
                d = dispatch.dispatcher()
                spec = d.ledger.spec(job_id)
                with logs.bind(job_id=job_id, seq=lease.seq, stage=lease.stage, attempt=lease.attempt,
                               tenant=spec.tenant), tracing.span(
                        f"stage {lease.stage}", **{"batchgate.job_id": job_id, "batchgate.seq": lease.seq,
                                                   "batchgate.stage": lease.stage,
                                                   "batchgate.attempt": lease.attempt}):
                    d.run_leased(spec, lease)
            except BaseException:  # noqa: BLE001 - one call's failure must not stop the thread
                log.exception("stage call failed in the worker job_id=%s seq=%s", job_id, lease.seq)
            finally:
                with self.lock:
                    self.busy -= 1
                    self.backoff.pop(job_id, None)  # its next stage may be ready now
                self.freed.set()

    def _hand(self, job_id: str, lease: Any) -> None:
        with self.have_work:
            self.busy += 1
            self.work_items.append((job_id, lease))
            self.have_work.notify()

    # -- feeding -----------------------------------------------------------------------------

    def feed_pass(self, d: dispatch.Dispatcher, rescan: bool = False) -> int:
        """Lease ready batches of the fed jobs while call threads are free; returns how many started."""
        now = time.monotonic()
        jobs = d.fed_jobs(rescan=rescan)
        with self.lock:
            for job_id in set(self.backoff).difference(jobs):  # finished jobs: forget them
                del self.backoff[job_id]
            for job_id in d.woken():
                self.backoff.pop(job_id, None)
        eligible = [j for j in jobs if self.backoff.get(j, (0.0, 0.0))[0] <= now]
        random.shuffle(eligible)  # fairness between jobs and between worker processes
        started = 0
        while eligible and self.busy < self.concurrency and not self.stop.is_set():
            for job_id in list(eligible):
                if self.busy >= self.concurrency or self.stop.is_set():
                    break
                lease = self._lease(d, job_id)
                if lease is None:
                    eligible.remove(job_id)
                    step = min(max(self.backoff.get(job_id, (0.0, 0.0))[1] * 2, IDLE_FIRST_S), IDLE_MAX_S)
                    with self.lock:
                        self.backoff[job_id] = (time.monotonic() + step, step)
                    continue
                self._hand(job_id, lease)
                started += 1
        return started

    def _lease(self, d: dispatch.Dispatcher, job_id: str) -> Any:
        """A lease on the job's next ready push batch (2 round trips: target states, lease.lua), or None;
        a job that has ended leaves the fed set."""
        try:
            spec = d.ledger.spec(job_id)
            if not dispatch.push_stages(spec):  # registered by an older version: nothing to call
                d.drop_fed(job_id)
                return None
            stages = d.open_stages(spec)
            lease = d.lease_next(job_id, stages) if stages else None
            if lease is None and d.ledger.r.hget(d.ledger.keys.job(job_id).job, "status") in (*DONE, None):
                d.drop_fed(job_id)
            return lease
        except (NotFound, CorruptRecord) as exc:
            log.warning("worker: job_id=%s dropped from feeding: %s", job_id, exc.detail)
            d.drop_fed(job_id)
            return None
        except BatchgateError as exc:  # e.g. its source is unavailable for now: other jobs go on
            log.info("worker: job_id=%s not leased now: %s", job_id, exc.detail)
            return None

    def feed(self, burst: bool = False) -> None:
        d = dispatch.dispatcher()
        # /readyz does not need workers; `batchgate health worker` (a container healthcheck) reads this:
        # the feeder beats, so a feeder stuck on a dead connection stops beating
        liveness = Liveness(d.ledger.r, d.ledger.keys, "worker")
        pause = 0.5
        next_rescan = 0.0
        while not self.stop.is_set():
            try:
                liveness.beat()
                if self.generation is not None and not self.generation.ready():
                    self.stop.wait(FEED_IDLE_S)  # another process is deciding a restart's recovery
                    continue
                rescan = time.monotonic() >= next_rescan
                started = self.feed_pass(d, rescan=rescan)
                if rescan:
                    next_rescan = time.monotonic() + RESCAN_S
                pause = 0.5
            except REDIS_DOWN as exc:
                log.warning("worker: redis unavailable (%s); reconnecting in %.1f s",
                            type(exc).__name__, pause)
                self.stop.wait(pause)
                pause = min(pause * 2, 5.0)
                continue
            except Exception:  # noqa: BLE001 - the feeder must not end while the process lives on
                log.exception("worker: a feeding pass failed; feeding again in %.1f s", pause)
                self.stop.wait(pause)
                pause = min(pause * 2, 5.0)
                continue
            if burst and not started and self.busy == 0 and not self.backoff_pending():
                return
            if started:
                continue
            self.freed.clear()
            self.freed.wait(FEED_IDLE_S)

    def backoff_pending(self) -> bool:
        """Whether some job might have work once its idle backoff ends (burst mode waits for it)."""
        with self.lock:
            return any(step < IDLE_MAX_S for _, step in self.backoff.values())

    # -- the process -------------------------------------------------------------------------------

    def request_stop(self, *_: Any) -> None:
        if self.stop.is_set():
            log.warning("second stop signal: exiting now; calls in flight keep their leases")
            raise SystemExit(1)
        log.info("worker stopping: %d calls in flight finish (grace %.0f s)", self.busy, self.grace_s)
        dispatch.STOPPING.set()
        self.stop.set()
        self.polls.request_stop()
        with self.have_work:
            self.have_work.notify_all()

    def wait_for_recovery(self) -> bool:
        """Join the generation; block until start-up recovery is decided (by this process if it is the
        first after a restart). False if stopped first. Waits for a Redis that is down."""
        self.generation = recovery_gate(dispatch.dispatcher().ledger, "worker")
        pause = 0.1
        while not self.stop.is_set():
            try:
                if self.generation.ready(wait_s=1.0):
                    return True
            except REDIS_DOWN as exc:
                log.warning("worker: redis unavailable at start (%s); waiting for it", type(exc).__name__)
                self.stop.wait(pause)
                pause = min(pause * 2, 5.0)
        return False

    def run(self, burst: bool = False, install_signals: bool = True) -> int:
        setup_loghandlers(self.logging_level, name="rq.worker")  # once, before threads race to do it
        setup_loghandlers(self.logging_level, name="rq.job")
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.request_stop)
        if not self.wait_for_recovery():
            return 0
        for i in range(self.concurrency):
            t = threading.Thread(target=self._call_loop, name=f"bg-call-{i}", daemon=True)
            t.start()
        self.polls.start(burst=burst)
        feeder = threading.Thread(target=self.feed, args=(burst,), name="bg-feeder", daemon=True)
        feeder.start()
        while feeder.is_alive() and not self.stop.is_set():
            feeder.join(0.2)
        crashed = not burst and not self.stop.is_set()  # the feeder ended on its own: never expected
        if crashed:
            log.error("worker: the feeder thread ended unexpectedly; stopping (exit code 1) so that the "
                      "process manager starts the worker again")
            self.request_stop()
        if burst and not self.stop.is_set():
            while self.polls.alive() and not self.stop.is_set():
                time.sleep(0.1)
            self.stop.set()
        deadline = time.monotonic() + self.grace_s
        while self.busy and time.monotonic() < deadline:
            self.freed.wait(0.1)
            self.freed.clear()
        if self.busy:
            log.warning("%d calls still in flight after the %.0f s grace: they keep their leases",
                        self.busy, self.grace_s)
        self.polls.request_stop()
        self.generation.leave()
        return 1 if crashed else 0
