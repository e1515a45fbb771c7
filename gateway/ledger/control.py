"""Job control: pause, hold, release, cancel, resume, retry-failed and resume by cursor.

Each action is one Lua script that reads everything it decides on (the job's status, its counters,
the batches' own statuses) inside the script. Where a script needs batch keys that Python had to read
first (the seqs of the uncommitted window, the leased or failed seqs), the script checks that what it
was given still covers the job and answers 'raced' otherwise; the caller then reads again. Counters are
adjusted per batch transition in the same script, or recounted (replan), never reset blindly.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from gateway.errors import Conflict, CorruptRecord, JobCancelled, NotFound, RetryableError
from gateway.ledger.records import dumps

log = logging.getLogger(__name__)

RACE_RETRIES = 50
REPLAN_SLACK = 64  # seqs passed beyond next_seq, so batches planned meanwhile are still covered


class ControlOps:
    """Mixed into Ledger: the operator's actions on a job.

    Uses the Ledger's ``r``, ``keys``, ``scripts``, ``settings``, ``spec()``, ``job_fields()``,
    ``persist_job()`` and ``_ready_keys()``; it does not import the Ledger (an import circle: the
    Ledger is made of this mixin).
    """

    def _control_result(self, res: list, job_id: str, action: str) -> None:
        if res[0] == "missing":
            raise NotFound(f"job {job_id} not found")
        if res[0] == "corrupt":
            raise CorruptRecord(f"job {job_id} failed its checksum; it will not run")
        if res[0] == "refused":
            status = res[1]
            if status == "cancelled":
                raise JobCancelled(f"job {job_id} is cancelled; a cancelled job cannot {action}",
                                   job_status=status)
            raise Conflict(f"job {job_id} is {status}; cannot {action}", job_status=status)

    def _retrying(self, job_id: str, attempt_fn) -> list:
        """Run a control script, reading again while it answers 'raced'."""
        for _ in range(RACE_RETRIES):
            res = attempt_fn()
            if res[0] != "raced":
                return res
            time.sleep(0.002)
        raise RetryableError(f"job {job_id} changed too fast to act on; try again")

    def set_status(self, job_id: str, status: str, allowed: tuple[str, ...], actor: str,
                   reason: str = "") -> str:
        """Move the job to ``status`` if it is in one of ``allowed``; returns the old status."""
        k = self.keys.job(job_id)
        spec = self.spec(job_id)
        res = self.scripts.set_status(
            keys=[k.job, k.log, k.audit, k.events],
            args=[status, ",".join(allowed), self.settings.log_maxlen, actor, reason[:2000],
                  spec.budget_total, spec.flow.tolerated_failure_percentage])
        verb = {"paused": "pause", "held": "hold", "running": "release", "failed": "fail"}.get(status, status)
        self._control_result(res, job_id, f"{verb} it")
        log.info("job status job_id=%s %s -> %s actor=%s", job_id, res[1], status, actor)
        return res[1]

    def pause(self, job_id: str, actor: str) -> str:
        """No new leases; batches in flight may still heartbeat, complete and fail."""
        return self.set_status(job_id, "paused", ("running", "waiting_human"), actor)

    def hold(self, job_id: str, actor: str, reason: str) -> str:
        """Record-only recovery: nothing expires, pumps or starts a call until released."""
        return self.set_status(job_id, "held", ("running",), actor, reason)

    def release(self, job_id: str, actor: str) -> str:
        """Let a held job run again (its dead leases expire as usual)."""
        return self.set_status(job_id, "running", ("held",), actor)

    def cancel(self, job_id: str, actor: str, reason: str = "") -> dict[str, Any]:
        """Cancel for good and void every outstanding lease; cancelling again is a no-op."""
        k = self.keys.job(job_id)
        # the script finds the leased batches itself (cancel.lua): no read first, so no race to lose
        res = self.scripts.cancel(keys=[k.job, k.leases, k.log, k.audit, k.events],
                                  args=[self.settings.log_maxlen, actor, reason[:2000]])
        if res[0] == "already":
            return {"cancelled": True, "already": True, "voided_leases": 0}
        self._control_result(res, job_id, "be cancelled")
        self.r.sadd(self.keys.events_pending, job_id)  # a retired (failed) job: its job.cancelled too
        log.info("job cancelled job_id=%s from=%s voided=%s actor=%s", job_id, res[1], res[2], actor)
        return {"cancelled": True, "already": False, "voided_leases": int(res[2])}

    def reopen(self, job_id: str, actor: str, only_failed: bool = False) -> int:
        """Resume (re-open uncommitted batches) or retry-failed; returns how many were re-opened."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)

        def attempt() -> list:
            if only_failed:
                seqs = [int(s) for s in self.r.zrange(k.failed, 0, -1)]
            else:
                job = self.job_fields(job_id)
                seqs = list(range(int(job["wm"]), int(job["next_seq"])))
            return self.scripts.reopen(
                keys=[k.job, k.leases, k.failed, k.log, k.audit, *self._ready_keys(spec),
                      *[k.batch(s) for s in seqs], k.events],
                args=[spec.stage_count, self.settings.log_maxlen, actor,
                      "retry_failed" if only_failed else "resume", spec.budget_total,
                      spec.flow.tolerated_failure_percentage, len(seqs), *seqs])

        res = self._retrying(job_id, attempt)
        if res[0] == "refused" and res[1] == "succeeded":
            raise Conflict(f"job {job_id} has succeeded; name a cursor to run part of it again",
                           job_status="succeeded")
        self._control_result(res, job_id, "retry failed batches" if only_failed else "be resumed")
        if res[2] == "succeeded" and int(res[1]) == 0:
            return 0  # a succeeded job with nothing failed: unchanged, its retention stands
        self.persist_job(job_id)
        return int(res[1])

    def replan(self, job_id: str, cursor: Any, actor: str, reason: str) -> dict[str, Any]:
        """Supersede every uncommitted batch and plan again from ``cursor``."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)

        def attempt() -> list:
            job = self.job_fields(job_id)
            bound = int(job["next_seq"]) + REPLAN_SLACK
            # batches below the watermark that are open again run a retry of quarantined items
            # (bisection): the old plan's, so they are superseded with it
            pipe = self.r.pipeline(transaction=False)
            for key in (k.leases, *self._ready_keys(spec)):
                pipe.zrange(key, 0, -1)
            retrying = {int(s) for found in pipe.execute() for s in found if int(s) < int(job["wm"])}
            seqs = sorted(retrying) + list(range(int(job["wm"]), bound))
            return self.scripts.replan(
                keys=[k.job, k.leases, k.failed, k.done, k.log, k.audit, *self._ready_keys(spec),
                      *[key for s in seqs for key in (k.batch(s), k.items(s))]],
                args=[spec.stage_count, dumps(cursor), self.settings.log_maxlen, actor, reason, bound,
                      *seqs])

        res = self._retrying(job_id, attempt)
        self._control_result(res, job_id, "be resumed")
        self.persist_job(job_id)
        log.info("cursor moved job_id=%s actor=%s superseded=%s", job_id, actor, res[1])
        return {"superseded": int(res[1]), "first_new_seq": int(res[2])}
