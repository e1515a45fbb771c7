"""``GET /metrics``: Prometheus text, every process's counters plus the ledger's state read from Redis.

What processes count (gateway/metrics.py) comes from this process, or from every process writing
``PROMETHEUS_MULTIPROC_DIR`` (gunicorn's workers; under ``up`` the supervisor and worker too). What is a
state of the ledger is read from Redis at each scrape, once for the whole deployment, whichever API
process answers: jobs by status (the job index's sets: one ZCARD per tenant and status), approvals
pending and the oldest one's age, the push queue, targets cooling down. Tenants are summed: a scrape
shows no tenant's name or numbers on their own, so it leaks nothing between tenants; set
``BATCHGATE_METRICS_TOKEN`` to require ``Authorization: Bearer <it>`` where the network is not private.
"""

from __future__ import annotations

import hmac
import time

import redis
from flask import Blueprint, Response, request
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from prometheus_client.core import CollectorRegistry, GaugeMetricFamily

from gateway import metrics
from gateway.api.common import request_services
from gateway.errors import Unauthorized
from gateway.ledger.jobindex import STATUSES

bp = Blueprint("metrics", __name__)
SCAN_COUNT = 1000


@bp.get("/metrics")
def scrape():
    services = request_services()
    wanted = services.settings.metrics_token
    if wanted is not None:
        given = request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if not hmac.compare_digest(given.encode(), wanted.get_secret_value().encode()):
            raise Unauthorized("GET /metrics needs Authorization: Bearer <BATCHGATE_METRICS_TOKEN>")
    body = generate_latest(metrics.process_registry())
    ledger = CollectorRegistry()
    ledger.register(LedgerCollector(services))
    body += generate_latest(ledger)
    return Response(body, mimetype=CONTENT_TYPE_LATEST)


class LedgerCollector:
    """Gauges read from Redis at scrape time."""

    def __init__(self, services) -> None:
        self.services = services

    def collect(self):
        r, keys = self.services.redis, self.services.ledger.keys
        up = GaugeMetricFamily("batchgate_ledger_up", "1 when the ledger's Redis answered this scrape")
        try:
            families = self._families(r, keys)
        except redis.RedisError:
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from families

    def _families(self, r, keys) -> list:
        tenants = self.services.ledger.index.tenants()
        pipe = r.pipeline(transaction=False)
        for tenant in tenants:
            for status in STATUSES:
                pipe.zcard(keys.job_index(tenant, status))
            pipe.zcard(keys.approval_index(tenant, "pending"))
            pipe.zrange(keys.approval_index(tenant, "pending"), 0, 0)
        replies = pipe.execute()
        by_status = dict.fromkeys(STATUSES, 0)
        pending, oldest_ms = 0, None
        per = len(STATUSES) + 2
        for i in range(len(tenants)):
            chunk = replies[i * per:(i + 1) * per]
            for status, n in zip(STATUSES, chunk, strict=False):
                by_status[status] += int(n)
            pending += int(chunk[-2])
            if chunk[-1]:
                created = int(chunk[-1][0][:13])
                oldest_ms = created if oldest_ms is None else min(oldest_ms, created)
        jobs = GaugeMetricFamily("batchgate_jobs", "Jobs by status (every tenant)", labels=["status"])
        for status, n in by_status.items():
            jobs.add_metric([status], n)
        approvals = GaugeMetricFamily("batchgate_approvals_pending", "Approvals waiting for a person")
        approvals.add_metric([], pending)
        age = GaugeMetricFamily("batchgate_approvals_oldest_pending_age_seconds",
                                "Age of the oldest pending approval (0 when none)")
        age.add_metric([], 0 if oldest_ms is None else max(0.0, time.time() - oldest_ms / 1000))
        return [jobs, approvals, age, *self._push(r, keys)]

    def _push(self, r, keys) -> list:
        queue = GaugeMetricFamily("batchgate_push_jobs", "Jobs with push stages the workers feed from")
        queue.add_metric([], r.scard(keys.push_jobs))
        rq_depth = GaugeMetricFamily("batchgate_rq_queue_depth", "RQ jobs queued (polls of long platform runs)")
        dispatcher = self.services.dispatcher
        rq_depth.add_metric([], dispatcher.queue.count if dispatcher is not None else 0)
        cooling = GaugeMetricFamily("batchgate_target_cooling",
                                    "1 while a target cools down after 429/503 or refused connections",
                                    labels=["target"])
        now_ms = time.time() * 1000
        pattern = f"{keys.prefix}:target:*:breaker"
        found = list(r.scan_iter(pattern, count=SCAN_COUNT))
        if found:
            pipe = r.pipeline(transaction=False)
            for key in found:
                pipe.hget(key, "until_ms")
            for key, until in zip(found, pipe.execute(), strict=True):
                target = key[len(f"{keys.prefix}:target:"):-len(":breaker")]
                cooling.add_metric([target], 1 if until and float(until) > now_ms else 0)
        return [queue, rq_depth, cooling]
