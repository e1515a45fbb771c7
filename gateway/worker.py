"""``batchgate worker --concurrency N``: one process, up to N push-mode stage calls in flight.

Why threads: a stage call is a blocking ``requests`` call that spends its time waiting on the platform
(I/O bound, the GIL is released while waiting), and the connectors, the outbound guard and redis-py are
synchronous; an event loop would mean rewriting all of them. Each thread runs its own RQ
``SimpleWorker`` (no fork per job) on the shared batchgate queue, so RQ stays the queue and scheduler
and its registries stay correct: every thread is a registered RQ worker with its own started-job
registry entries, heartbeats and results. Each thread has its own Dispatcher (HTTP session, Redis
clients; gateway.dispatch.dispatcher()). Limits are not this process's business: the flow's
concurrency (lease.lua), each target's max_in_flight and 429 cooldown (slot.lua) live in Redis and hold
across every thread of every worker process on every machine.

With --concurrency 1 the process is RQ's forking Worker as before (run_forking): one call at a time,
each in a work horse, so the parent's memory stays flat over long runs (tests/test_soak.py holds it to
10 %); a thread worker runs jobs in its own process, and its long-run memory is not soak-tested yet.

Stopping. SIGTERM/SIGINT: no thread dequeues another job once its current one ends; a stage attempt
dequeued after the signal gives its lease back without a call (no attempt spent); calls in flight get
``worker_grace`` to finish and commit; then the stage attempts still waiting in the queue are taken out
and their leases given back the same way, and the process exits. A call still running after the grace
keeps its lease, which expires and is retried as any lost call is. A second signal exits at once.
SIGKILL loses nothing committed: the ledger holds every lease; a queued attempt's lease expires after
``dispatch_queue_timeout`` without spending an attempt, a started call's after its stage lease.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from typing import Any

from rq import SimpleWorker
from rq.exceptions import StopRequested
from rq.job import Job
from rq.logutils import setup_loghandlers
from rq.serializers import JSONSerializer
from rq.timeouts import TimerDeathPenalty

from gateway import dispatch

log = logging.getLogger(__name__)

#: RQ worker TTL for the threads (their registration expires this long after the last heartbeat).
THREAD_WORKER_TTL = 60
#: An idle thread wakes this often (seconds) to heartbeat and see a stop request.
IDLE_WAKE_S = 2


class ThreadWorker(SimpleWorker):
    """An RQ SimpleWorker that runs in a thread of a ``batchgate worker`` process.

    Job timeouts use a timer (SIGALRM only reaches the main thread); signals belong to the process's
    main thread (ConcurrentWorker), which asks each thread to stop.
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


class ConcurrentWorker:
    """Up to ``concurrency`` RQ worker threads on ``queue`` in this process, and RQ's scheduler."""

    def __init__(self, queue: Any, concurrency: int, grace_s: float, logging_level: str = "INFO") -> None:
        self.queue = queue
        self.concurrency = max(1, int(concurrency))
        self.grace_s = grace_s
        self.logging_level = logging_level
        self.stop = threading.Event()
        self.workers = [ThreadWorker([queue], connection=queue.connection, serializer=JSONSerializer,
                                     worker_ttl=THREAD_WORKER_TTL) for _ in range(self.concurrency)]
        self.threads: list[threading.Thread] = []

    def _run_thread(self, worker: ThreadWorker, burst: bool, with_scheduler: bool) -> None:
        try:
            dispatch.dispatcher()  # this thread's session and clients, built before its first job
            worker.work(burst=burst, with_scheduler=with_scheduler, logging_level=self.logging_level)
        except BaseException:  # noqa: BLE001 - a thread's death is logged, the others go on
            log.exception("worker thread %s stopped", worker.name)

    def request_stop(self, *_: Any) -> None:
        if self.stop.is_set():
            log.warning("second stop signal: exiting now; calls in flight keep their leases")
            raise SystemExit(1)
        log.info("worker stopping: %d threads finish their calls (grace %.0f s)",
                 len(self.threads), self.grace_s)
        dispatch.STOPPING.set()
        for w in self.workers:
            w._stop_requested = True  # RQ's flag: leave the work loop after the current job
        self.stop.set()

    def run(self, burst: bool = False, install_signals: bool = True) -> int:
        setup_loghandlers(self.logging_level, name="rq.worker")  # once, before threads race to do it
        setup_loghandlers(self.logging_level, name="rq.job")
        if install_signals:
            for sig in (signal.SIGINT, signal.SIGTERM):
                signal.signal(sig, self.request_stop)
        for i, w in enumerate(self.workers):
            t = threading.Thread(target=self._run_thread, args=(w, burst, i == 0),
                                 name=f"bg-worker-{i}", daemon=True)
            t.start()
            self.threads.append(t)
            if i == 0:
                # RQ forks its scheduler process from the first thread's work(); let it do so before
                # the other threads exist
                started = time.monotonic()
                while w.scheduler is None and t.is_alive() and time.monotonic() - started < 2:
                    time.sleep(0.01)
                time.sleep(0.05)
        while not self.stop.is_set() and any(t.is_alive() for t in self.threads):
            self.stop.wait(0.2)
        deadline = time.monotonic() + self.grace_s
        redis_up = True
        while any(t.is_alive() for t in self.threads) and time.monotonic() < deadline:
            for t in self.threads:
                t.join(0.05)
            redis_up = self._redis_up()
            if not redis_up:  # nothing can commit without it (e.g. `up` died with its Redis): go now
                log.warning("worker stopping: Redis unreachable, exiting without waiting")
                break
        left = sum(t.is_alive() for t in self.threads)
        if left and redis_up:
            log.warning("%d threads still busy after the %.0f s grace: their calls keep their leases",
                        left, self.grace_s)
        if self.stop.is_set() and redis_up:
            release_queued(self.queue)
        return 0

    def _redis_up(self) -> bool:
        try:
            return bool(self.queue.connection.ping())
        except Exception:  # noqa: BLE001 - any failure means unreachable
            return False


def run_forking(queue: Any, burst: bool, logging_level: str) -> int:
    """--concurrency 1: RQ's own forking Worker, one call at a time, each in a work horse (the parent's
    memory stays flat over long runs); after a stop signal, the queued stage attempts are given back."""
    from rq import Worker

    worker = Worker([queue], connection=queue.connection, serializer=JSONSerializer)
    worker.work(with_scheduler=True, burst=burst, logging_level=logging_level)
    if worker._shutdown_requested_date is not None:  # SIGTERM/SIGINT, not burst's end
        release_queued(queue)
    return 0


def release_queued(queue: Any) -> int:
    """Take the stage attempts still waiting in ``queue`` out and give their leases back (no call, no
    attempt spent); returns how many. Pumps and polls stay queued for other workers."""
    dispatch.STOPPING.set()
    released = 0
    try:
        job_ids = queue.get_job_ids()
    except Exception:  # noqa: BLE001 - Redis gone: the leases expire without spending an attempt
        log.exception("could not read the queue to release its stage attempts")
        return 0
    for job_id in job_ids:
        try:
            job = Job.fetch(job_id, connection=queue.connection, serializer=JSONSerializer)
            if not (job.func_name or "").endswith(".run_stage"):
                continue
            if not queue.remove(job_id):  # another worker dequeued it first
                continue
            dispatch.run_stage(*job.args)  # STOPPING: begin.lua gives the lease back
            job.delete()
            released += 1
        except Exception:  # noqa: BLE001 - its lease expires without spending an attempt
            log.exception("could not release queued attempt %s", job_id)
    if released:
        log.info("released %d queued stage attempts", released)
    return released
