"""Per-tenant quotas: active jobs, job creations per minute, pull leases per second.

Every count lives in Redis and is checked and taken in one script (``lua/quota.lua``), so the limits
hold across gunicorn workers, processes and machines sharing the ledger. A refused request writes
nothing and raises ``QuotaExceeded`` (429 with Retry-After; the problem names the quota, its limit
and when to retry).

Rates use the generic cell rate algorithm: one key per tenant and quota holding the next request's
theoretical arrival time, so N per period means a burst of N, then one every period/N.

Active jobs are counted from the jobs' own status, not by a counter every status change would have to
keep right. The tenant's active set holds the ids of jobs that *may* be active: quota.lua adds the id
when it admits a creation (checking the set's size in the same script), and the resume routes add it
again (``track``). Only a pass that reads each member's status removes ids: jobs succeeded, cancelled,
or gone (retention expired them: no record, but in the tenant's job index, which is written with the
record), or without a record past a grace for creations still in progress. So the set never
misses an active job, and whatever ends a job (its last batch, cancel, expiry, deletion) needs no hook.
The pass runs when the set is full, at most once a second per tenant, before a creation is refused
(a creation that finds another process's pass under way waits 100 ms for it and asks again). The
supervisor also drops a job's id when it retires the job succeeded or cancelled, so the set holds about
the tenant's unfinished jobs, not every job of the last five minutes (the soak's 20,000 short jobs
filled it to the default limit of 10,000, and creations racing for one prune pass were refused).
"""

from __future__ import annotations

import functools
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta

import redis

from gateway.errors import QuotaExceeded
from gateway.ledger.keys import Keys
from gateway.ledger.scripts import source
from gateway.settings import Settings

log = logging.getLogger(__name__)

#: Job statuses that no longer count against ``active_jobs`` (``failed`` still counts: it is not
#: final, it may be resumed, and retention never expires it; cancel a failed job to free its place).
FINISHED = frozenset({"succeeded", "cancelled"})
#: A job id in the active set whose job does not exist yet is a creation in progress (its source is
#: being probed) until its id's timestamp is this old; then it is a creation that died, and dropped.
CREATION_GRACE = timedelta(minutes=5)
#: Retry-After for a refusal on active jobs: when one ends cannot be known; this is a polite pace.
ACTIVE_RETRY_AFTER = timedelta(seconds=5)
PRUNE_EVERY = timedelta(seconds=1)
PRUNE_WAIT = timedelta(milliseconds=100)  # a refused creation waits this long for another's prune
MINUTE_MS, SECOND_MS = 60_000, 1_000


@dataclass(frozen=True)
class LeaseQuota:
    """A pull lease request's quota, for lease.lua to count in the lease's own script (one Redis: the
    tenant's rate key and the job's keys are then on one server; Ledger.lease_stages)."""

    key: str  #: the tenant's rate key (quota.lua's KEYS[1])
    limit: int  #: leases per period
    period_ms: int
    refusal: Callable[[int], QuotaExceeded]  #: the 429 for a wait (ms)
    admit: Callable[[], None]  #: count it by quota.lua instead (a request that never reaches lease.lua)


class Quotas:
    """Checks and takes one tenant's quotas; one instance per Redis client."""

    def __init__(self, client: redis.Redis, keys: Keys, settings: Settings) -> None:
        self.r = client
        self.keys = keys
        self.settings = settings
        self._script = client.register_script(source("quota"))

    def admit_job(self, tenant: str, job_id: str) -> None:
        """Count a job creation and the new job as active, or raise QuotaExceeded (nothing written)."""
        quota = self.settings.quota_for(tenant)
        keys = [self.keys.quota_creations(tenant)]
        args = [quota.job_creations_per_minute, MINUTE_MS]
        if quota.active_jobs > 0:  # no limit: not tracked (a limit set later counts jobs made after it)
            keys.append(self.keys.quota_active(tenant))
            args += [quota.active_jobs, job_id]
        elif quota.job_creations_per_minute <= 0:
            return
        res = self._script(keys=keys, args=args)
        if res[0] == "active":
            # prune, or (another process holds this second's prune) give its prune a moment; either
            # way ask again: a set full of finished jobs must not refuse a creation
            if not self.prune(tenant):
                time.sleep(PRUNE_WAIT.total_seconds())
            res = self._script(keys=keys, args=args)
        if res[0] == "rate":
            raise self._rate_refusal(tenant, "job_creations_per_minute", quota.job_creations_per_minute,
                                     "job creations a minute", int(res[1]))
        if res[0] == "active":
            raise QuotaExceeded(
                f"tenant {tenant} has {int(res[1])} jobs not finished, its limit of "
                f"{quota.active_jobs} active jobs (quota active_jobs); retry in "
                f"{ACTIVE_RETRY_AFTER.total_seconds():g} s or once one of them has succeeded or been "
                "cancelled (a failed job counts until it is cancelled)",
                retry_after=ACTIVE_RETRY_AFTER, quota="active_jobs", limit=quota.active_jobs,
                retry_after_s=ACTIVE_RETRY_AFTER.total_seconds())

    def release_job(self, tenant: str, job_id: str) -> None:
        """A creation admitted by ``admit_job`` failed: forget its id, unless the job was written
        (it failed after that, e.g. reading its view back) and so is active."""
        if not self.r.exists(self.keys.job(job_id).job):
            self.r.srem(self.keys.quota_active(tenant), job_id)

    def track(self, tenant: str, job_id: str) -> None:
        """Count ``job_id`` as active again (a resume or retry may take a finished job back to running).

        Called after the status change, so a prune that read the old status and removes the id after
        this still puts it back: its second read sees the new status."""
        self.r.sadd(self.keys.quota_active(tenant), job_id)

    def admit_lease(self, tenant: str) -> None:
        """Count one pull-mode lease request, or raise QuotaExceeded."""
        limit = self.settings.quota_for(tenant).leases_per_second
        if limit <= 0:
            return
        res = self._script(keys=[self.keys.quota_leases(tenant)], args=[limit, SECOND_MS])
        if res[0] == "rate":
            raise self._rate_refusal(tenant, "leases_per_second", limit, "leases a second", int(res[1]))

    def lease_quota(self, tenant: str, in_script: bool) -> LeaseQuota | None:
        """A pull lease request's quota: for lease.lua to count (``in_script``: one Redis), else counted
        here now (quota.lua, a round trip of its own; raises QuotaExceeded); None when off or counted."""
        limit = self.settings.quota_for(tenant).leases_per_second
        if limit <= 0:
            return None
        if not in_script:
            self.admit_lease(tenant)
            return None
        return LeaseQuota(self.keys.quota_leases(tenant), limit, SECOND_MS,
                          functools.partial(self._rate_refusal, tenant, "leases_per_second", limit,
                                            "leases a second"),
                          functools.partial(self.admit_lease, tenant))

    def prune(self, tenant: str) -> int:
        """Drop the ids of finished or vanished jobs from the tenant's active set (at most one pass a
        second per tenant); returns how many were dropped."""
        every_ms = int(PRUNE_EVERY.total_seconds() * 1000)
        if not self.r.set(self.keys.quota_prune(tenant), "1", nx=True, px=every_ms):
            return 0
        key = self.keys.quota_active(tenant)
        members = list(self.r.smembers(key))
        # the roster is read BEFORE the records: a job the roster named then and whose record is absent
        # now was written (job and roster are one MULTI) and has expired since: gone at once, however
        # young. Read the other way round, a creation committing between the two reads looked expired
        # (no record yet, then in the roster) and freed a place it holds: 6 of a quota of 5 were created
        # once, 20 creations racing over 2 gunicorn workers. One never written is a creation in
        # progress until CREATION_GRACE has passed (or one that died).
        indexed = self._indexed(tenant, members)
        statuses = self._statuses(members)
        gone = [job_id for job_id, status in statuses.items()
                if status in FINISHED or (status is None and (
                    job_id in indexed or _older_than(job_id, CREATION_GRACE)))]
        if not gone:
            return 0
        self.r.srem(key, *gone)
        # a resume that changed a status after the read above has re-added its id already or will
        # (track); one that changed it before the removal is seen here
        back = [job_id for job_id, status in self._statuses(gone).items()
                if status is not None and status not in FINISHED]
        if back:
            self.r.sadd(key, *back)
        log.info("quota: tenant=%s active set pruned dropped=%d", tenant, len(gone) - len(back))
        return len(gone) - len(back)

    def active_count(self, tenant: str) -> int:
        """How many ids the tenant's active set holds now (an upper bound on its active jobs)."""
        return self.r.scard(self.keys.quota_active(tenant))

    def _statuses(self, job_ids: list[str]) -> dict[str, str | None]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.hget(self.keys.job(job_id).job, "status")
        return dict(zip(job_ids, pipe.execute(), strict=True))

    def _indexed(self, tenant: str, job_ids: list[str]) -> set[str]:
        pipe = self.r.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.zscore(self.keys.jobs(tenant), job_id)
        return {job_id for job_id, score in zip(job_ids, pipe.execute(), strict=True) if score is not None}

    @staticmethod
    def _rate_refusal(tenant: str, quota: str, limit: int, unit: str, wait_ms: int) -> QuotaExceeded:
        wait_s = wait_ms / 1000
        return QuotaExceeded(
            f"tenant {tenant} may make at most {limit} {unit} (quota {quota}); retry in {wait_s:g} s",
            retry_after=timedelta(seconds=max(1, math.ceil(wait_s))), quota=quota, limit=limit,
            retry_after_s=wait_s)


def _older_than(job_id: str, age: timedelta) -> bool:
    """Whether a job id (``job_<ms in 11 hex digits><random>``) was made more than ``age`` ago; an id
    that does not parse counts as old (it is no creation in progress)."""
    try:
        created_ms = int(job_id[4:15], 16)
    except ValueError:
        return True
    return time.time() * 1000 - created_ms > age.total_seconds() * 1000
