"""Prometheus metrics: what each process counts, and how a scrape gathers them.

Two kinds, by where the truth is:

- **Counted where it happens** (this module's counters and histograms, incremented in the process that
  did it): batches committed, failed and retried by stage and error class, lease expiries, recoveries
  and their time, recovered jobs by how they ended (the resume success rate), ledger commit latency,
  platform calls by target and outcome with their latency and the calls in flight, webhook deliveries.
- **Read at scrape time from Redis** (gateway/api/metrics.py): jobs by status, approvals pending and
  the oldest one's age, the push queue, targets cooling down after 429s. They are states, not events:
  counting them in one process would be wrong as soon as there are two.

Several processes: gunicorn's workers, and under ``up`` the supervisor and worker too, write their
samples to ``PROMETHEUS_MULTIPROC_DIR`` (prometheus_client's multiprocess mode, set by ``serve`` and
``up`` before anything imports prometheus_client), and the API's ``/metrics`` adds them up. A supervisor
or worker on a machine of its own serves its own with ``--metrics-port``.

Labels stay bounded: stage names and target ids come from registered flows; error classes are a fixed
set (a worker's own error types fold into ``other``); never a job id, tenant token or URL path.
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
#: error classes a label may carry; any other error type is "other"
ERROR_CLASSES = frozenset({"transient", "fatal", "outcome_unknown", "max_run", "rejected", "waiting_human",
                           "lease_expired", "timeout", "source"})
LATENCY_BUCKETS = (0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
CALL_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)
RECOVERY_BUCKETS = (0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 900)

BATCHES_COMMITTED = Counter("batchgate_batches_committed", "Stage commits (a batch's stage output stored)",
                            ["stage"])
BATCHES_FAILED = Counter("batchgate_batches_failed", "Batches failed for good, by stage and error class",
                         ["stage", "error_class"])
ITEMS_QUARANTINED = Counter("batchgate_items_quarantined", "Items a bisecting stage set aside (poison "
                            "items: the rest of their batch went on), by stage", ["stage"])
BATCHES_RETRIED = Counter("batchgate_batches_retried", "Failed attempts that will be retried",
                          ["stage", "error_class"])
LEASE_EXPIRIES = Counter("batchgate_lease_expiries", "Leases that ran out (a worker or platform went quiet)",
                         ["stage", "outcome"])
RECOVERIES = Counter("batchgate_recoveries", "Jobs recovered after a restart of the deployment")
REDIS_WAIT_SHORT = Counter("batchgate_redis_wait_short", "Commits fewer replicas acknowledged than "
                           "BATCHGATE_REDIS_WAIT_REPLICAS asks within BATCHGATE_REDIS_WAIT_TIMEOUT (they "
                           "stand on the master; a failover before replication would lose them)",
                           ["operation"])
RECOVERY_SECONDS = Histogram("batchgate_recovery_seconds",
                             "From a restart's start to a job's recovery decided (its leases back in play)",
                             buckets=RECOVERY_BUCKETS)
RECOVERED_JOBS = Counter("batchgate_recovered_jobs_finished",
                         "Jobs that went through a recovery, by how they ended (resume success rate: "
                         "succeeded / all)", ["outcome"])
COMMIT_SECONDS = Histogram("batchgate_commit_seconds", "Ledger commit of one stage (the script's round trip)",
                           buckets=LATENCY_BUCKETS)
PLATFORM_CALLS = Counter("batchgate_platform_calls", "Platform calls (triggers and polls) by target and outcome",
                         ["target", "outcome"])
PLATFORM_SECONDS = Histogram("batchgate_platform_call_seconds", "Platform call latency by target", ["target"],
                             buckets=CALL_BUCKETS)
PLATFORM_IN_FLIGHT = Gauge("batchgate_platform_calls_in_flight", "Platform calls under way by target",
                           ["target"], multiprocess_mode="livesum")
CALL_REASONS = frozenset({"first", "retry", "rerun", "bisection"})
STAGE_CALLS = Counter("batchgate_stage_calls", "Platform and pull calls whose answer the ledger took, by "
                      "stage and why they ran (first, retry, rerun: after a lost worker or callback, "
                      "bisection)", ["stage", "reason"])
STAGE_TOKENS = Counter("batchgate_stage_tokens", "Tokens platforms reported for those calls",
                       ["stage", "reason"])
STAGE_PRICE = Counter("batchgate_stage_price", "Price platforms reported for those calls, by currency",
                      ["stage", "reason", "currency"])
BUDGET_PAUSES = Counter("batchgate_budget_pauses", "Jobs paused by their flow's cost budget")
WEBHOOK_DELIVERIES = Counter("batchgate_webhook_deliveries", "Event deliveries to subscribers by outcome",
                             ["outcome"])


def error_class(error_type: str | None, retryable: bool | None = None) -> str:
    if error_type in ERROR_CLASSES:
        return error_type
    if error_type:
        return "other"
    return "transient" if retryable else "fatal"


def count_call(stage: str, reason: str, usage: Any = None, paused: bool = False) -> None:
    """One call the ledger counted (complete.lua/fail.lua record_cost), with what it reported it cost."""
    reason = reason if reason in CALL_REASONS else "other"
    STAGE_CALLS.labels(stage, reason).inc()
    if usage is not None and usage.tokens:
        STAGE_TOKENS.labels(stage, reason).inc(usage.tokens)
    if usage is not None and usage.price:
        code = usage.currency if usage.currency and len(usage.currency) == 3 else "other"
        STAGE_PRICE.labels(stage, reason, code).inc(float(usage.price))
    if paused:
        BUDGET_PAUSES.inc()


@contextmanager
def platform_call(target: str) -> Iterator[dict[str, str]]:
    """Times one platform call; the caller sets ``outcome`` in the yielded dict."""
    seen = {"outcome": "error"}
    PLATFORM_IN_FLIGHT.labels(target).inc()
    started = time.monotonic()
    try:
        yield seen
    finally:
        PLATFORM_IN_FLIGHT.labels(target).dec()
        PLATFORM_SECONDS.labels(target).observe(time.monotonic() - started)
        PLATFORM_CALLS.labels(target, seen["outcome"]).inc()


def multiprocess_dir() -> str | None:
    return os.environ.get(MULTIPROC_ENV) or None


def prepare_multiprocess_dir(path: Path) -> str:
    """An empty folder for this deployment's samples (a restart starts from zero, as a process does)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True, exist_ok=True)
    return str(path)


def process_registry() -> CollectorRegistry:
    """What this process (or, in multiprocess mode, every process writing the folder) has counted."""
    if multiprocess_dir():
        from prometheus_client import multiprocess

        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry)
        return registry
    from prometheus_client import REGISTRY

    return REGISTRY


def mark_dead(pid: int) -> None:
    """gunicorn's child_exit: a dead worker's live gauges stop counting."""
    if multiprocess_dir():
        from prometheus_client import multiprocess

        multiprocess.mark_process_dead(pid)


def serve_port(port: int | None) -> None:
    """A supervisor or worker on its own machine: its metrics on ``port`` (0 or None: not served)."""
    if port:
        from prometheus_client import start_http_server

        start_http_server(port, registry=process_registry())
