"""The creation journal: closes the crash window between a new job's keys and its global entries on a
Redis Cluster (docs/design.md, "Cluster").

On a plain Redis a job is created in one MULTI. On a cluster that MULTI runs one per slot (multi.py):
the job's own keys first (spec, state, log, audit), then the tenant roster ``jobs:<tenant>``, the
tenant's job index, ``active`` and, last, ``due``. A creation cut between the groups (its process
killed, or Redis failing under it) leaves a job that answers ``GET /v1/jobs/{id}`` but is neither listed
nor supervised, and whose creator was never told it exists: the API answered an error or nothing, so
the client creates the job again (an Idempotency-Key claim is abandoned on the error, or runs out).

So in cluster mode a creation first writes ``creating`` (one key, job id -> ms the creation began),
then its MULTI, then removes its entry; the creation answers success only once the entry is removed, so
an entry that stays always belongs to a creation whose caller got an error or no answer. The supervisor
reads the entries older than ``GRACE_MS`` each pass (one ZRANGEBYSCORE: a pass costs what is stale,
nothing when there is none) and settles each:

- the job's record is missing: the creation died before its keys; the entry is dropped after
  ``ABANDON_MS`` (a creation stalled that long before its MULTI is not waited for).
- the job is still ``running``: the creation was cut (anywhere from its first group to the removal).
  The job is cancelled (its reason says so: it must not run, since its creator was told it failed and
  creates it again, and running both would do the work twice), then filed where its creation would
  have filed it (roster at its ``created_ms``, the index from its record, ``active``, its due entry), so
  the tenant sees it listed as cancelled and the supervisor retires it like any cancelled job. Each
  step is idempotent: a repair racing a slow creation, or two supervisors on one entry, write the same.
  A creation cut after its last group may have had a few batches dispatched in the grace time; the
  cancellation stops it there.
- any other status: someone already acted on it; the entry is dropped.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from gateway.errors import BatchgateError
from gateway.ledger.multi import is_cluster_client

log = logging.getLogger(__name__)

GRACE_MS = 10_000  # a creation older than this is taken as dead (one takes milliseconds)
ABANDON_MS = 600_000  # an entry whose job never got its keys is dropped after this
REPAIR_BATCH = 100  # stale entries settled per pass
ACTOR = "batchgate:creation-journal"
REASON = "its creation was cut off before the job was listed; the API answered an error, so it never ran"


class CreationJournal:
    """``begin``/``end`` around a creation's MULTI (cluster only); ``repair`` for the supervisor."""

    def __init__(self, index: Any, cancel: Callable[[str, str, str], Any]) -> None:
        self.index = index  # jobindex.JobIndex: the client, the keys, specs and the due index
        self.cancel = cancel  # Ledger.cancel
        self.r, self.keys = index.r, index.keys
        self.enabled = is_cluster_client(self.r)

    def begin(self, job_id: str, now_ms: int) -> None:
        if self.enabled:
            self.r.zadd(self.keys.creating, {job_id: now_ms})

    def end(self, job_id: str) -> None:
        """The creation's MULTI ran whole: drop its entry. If this raises, the creation answers an
        error, and ``repair`` cancels the job."""
        if self.enabled:
            self.r.zrem(self.keys.creating, job_id)

    def repair(self, now_ms: int, grace_ms: int | None = None) -> list[str]:
        """Settle the creations that began more than ``grace_ms`` (``GRACE_MS``) ago and never ended;
        returns the ids of the jobs cancelled as cut."""
        if not self.enabled:
            return []
        grace_ms = GRACE_MS if grace_ms is None else grace_ms
        stale = self.r.zrangebyscore(self.keys.creating, "-inf", now_ms - grace_ms, start=0,
                                     num=REPAIR_BATCH, withscores=True)
        cut = []
        for job_id, began in stale:
            status, created = self.r.hmget(self.keys.job(job_id).job, "status", "created_ms")
            if status is None and now_ms - began <= ABANDON_MS:
                continue
            if status == "running":
                try:
                    self._cancel_and_file(job_id, int(created or began))
                    cut.append(job_id)
                except BatchgateError as exc:  # e.g. a corrupt record: nothing to file; the pass goes on
                    log.warning("creation journal: job_id=%s cut off in its creation, not settled: %s",
                                job_id, exc.detail)
            self.r.zrem(self.keys.creating, job_id)
        return cut

    def _cancel_and_file(self, job_id: str, created_ms: int) -> None:
        self.cancel(job_id, ACTOR, REASON)  # first: it is never listed or supervised as running
        spec = self.index.spec_of(job_id)
        pipe = self.r.pipeline(transaction=False)
        pipe.zadd(self.keys.jobs(spec.tenant), {job_id: created_ms}, nx=True)
        pipe.sadd(self.keys.active, job_id)
        pipe.execute()
        self.index.check(job_id)
        self.index.due.settle([job_id])
        log.warning("creation journal: job_id=%s was cut off in its creation; cancelled and listed", job_id)
