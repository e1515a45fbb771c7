"""Shared set-up for the benchmarks: a private redis-server (or BATCHGATE_REDIS_URL) and a ledger."""

from __future__ import annotations

import os
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.ledger.embedded import EmbeddedRedis, client_for  # noqa: E402
from gateway.ledger.flows import FlowRegistry, parse_flow  # noqa: E402
from gateway.ledger.jobs import JobRequest, JobService  # noqa: E402
from gateway.ledger.ledger import Ledger  # noqa: E402
from gateway.settings import Settings  # noqa: E402


def pin(server_pid: int) -> None:
    """On 2+ cores, keep redis-server and this client on different cores: steadier numbers."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) >= 2:
        os.sched_setaffinity(server_pid, {cpus[-1]})
        os.sched_setaffinity(0, {cpus[0]})


@contextmanager
def ledger_on_private_redis() -> Iterator[tuple[Ledger, JobService]]:
    """A ledger on a fresh embedded redis-server, stopped afterwards."""
    url = os.environ.get("BATCHGATE_REDIS_URL")
    server = None
    if url is None:
        server = EmbeddedRedis(Path(tempfile.mkdtemp(prefix="bg-bench-")))
        url = server.start()
        pin(server.proc.pid)
    client = client_for(url)
    settings = Settings(redis_url=url, key_prefix="bench")
    ledger = Ledger(client, settings)
    try:
        yield ledger, JobService(ledger, FlowRegistry(client, ledger.keys))
    finally:
        if server:
            server.stop()


def loopback_push(ledger: Ledger) -> dict[str, str]:
    """Let ``ledger`` (and the worker processes started with the answered environment) call platform
    stand-ins on 127.0.0.1 and sign their callbacks; workers log warnings only."""
    settings = ledger.settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"],
                                                  "signing_key": "bench-signing-key"})
    ledger.settings = settings
    return {**os.environ, "BATCHGATE_REDIS_URL": settings.redis_url.get_secret_value(),
            "BATCHGATE_KEY_PREFIX": settings.key_prefix, "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]',
            "BATCHGATE_SIGNING_KEY": "bench-signing-key", "BATCHGATE_LOG_LEVEL": "WARNING"}


def start_job(service: JobService, flow_id: str, count: int, max_items: int = 10,
              stages: tuple[str, ...] = ("process",), concurrency: int = 1000) -> str:
    """Register a flow over a sequence source and start a job on it."""
    flow = parse_flow({"id": flow_id, "version": "1", "concurrency": concurrency,
                       "batching": {"max_items": max_items},
                       "stages": [{"name": s, "lease": 3600} for s in stages],
                       "source": {"type": "sequence", "count": count}})
    service.flows.register("bench", flow)
    return service.create("bench", JobRequest(flow_id=flow_id))["job_id"]
