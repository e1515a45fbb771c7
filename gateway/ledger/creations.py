"""The creation journal: closes the crash window between a new job's keys and its global entries on a
Redis Cluster (docs/design.md, "Cluster").

On a plain Redis a job is created in one MULTI. On a cluster that MULTI runs one per slot (multi.py):
the job's own keys first (spec, state, log, audit), then the tenant roster ``jobs:<tenant>``, the
tenant's job index, ``active`` and ``due``. A process killed between the groups leaves a job that
answers ``GET /v1/jobs/{id}`` but is neither listed nor supervised (a push job never runs; a pull job's
expired leases never come back). So in cluster mode a creation first writes ``creating`` (one key,
job id -> ms the creation began), then its MULTI, then removes its entry. The supervisor reads the
entries older than ``GRACE_MS`` each pass (one ZRANGEBYSCORE: a pass costs what is stale, nothing
when there is none) and repairs each: a job whose record exists is filed where its creation would have
filed it (roster ZADD NX at its ``created_ms``, the index from its record, SADD ``active``, its due
entry from its keys), all idempotent, so a repair racing a slow creation writes what it would; an entry
whose record does not exist (the creation died before its keys) is dropped after ``ABANDON_MS``.
"""

from __future__ import annotations

import logging
from typing import Any

from gateway.ledger.multi import is_cluster_client

log = logging.getLogger(__name__)

GRACE_MS = 10_000  # a creation older than this is taken as dead (one takes milliseconds)
ABANDON_MS = 600_000  # an entry whose job never got its keys is dropped after this
REPAIR_BATCH = 100  # stale entries repaired per pass


class CreationJournal:
    """``begin``/``end`` around a creation's MULTI (cluster only); ``repair`` for the supervisor."""

    def __init__(self, index: Any) -> None:
        self.index = index  # jobindex.JobIndex: the client, the keys, specs and the due index
        self.r, self.keys = index.r, index.keys
        self.enabled = is_cluster_client(self.r)

    def begin(self, job_id: str, now_ms: int) -> None:
        if self.enabled:
            self.r.zadd(self.keys.creating, {job_id: now_ms})

    def end(self, job_id: str) -> None:
        if self.enabled:
            self.r.zrem(self.keys.creating, job_id)

    def repair(self, now_ms: int, grace_ms: int | None = None) -> list[str]:
        """File the jobs whose creation began more than ``grace_ms`` (``GRACE_MS``) ago and never
        ended; returns the ids repaired (those whose record exists)."""
        if not self.enabled:
            return []
        grace_ms = GRACE_MS if grace_ms is None else grace_ms
        stale = self.r.zrangebyscore(self.keys.creating, "-inf", now_ms - grace_ms, start=0,
                                     num=REPAIR_BATCH, withscores=True)
        repaired = []
        for job_id, began in stale:
            created = self.r.hget(self.keys.job(job_id).job, "created_ms")
            if created is None:
                if now_ms - began > ABANDON_MS:
                    self.r.zrem(self.keys.creating, job_id)
                continue
            self._file(job_id, int(created))
            self.r.zrem(self.keys.creating, job_id)
            repaired.append(job_id)
        if repaired:
            log.warning("creation journal: filed %d job(s) whose creation stopped half-way: %s",
                        len(repaired), ", ".join(repaired))
        return repaired

    def _file(self, job_id: str, created_ms: int) -> None:
        spec = self.index.spec_of(job_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.keys.jobs(spec.tenant), {job_id: created_ms}, nx=True)
        pipe.sadd(self.keys.active, job_id)
        pipe.execute()
        self.index.check(job_id)
        self.index.due.settle([job_id])
