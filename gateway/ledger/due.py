"""The due index: when the supervisor must next look at each active job (docs/design.md, "Supervisor
and recovery").

``<p>:due`` is one sorted set (or ``due_shards`` of them, ``<p>:due:{d<n>}``, a job's by crc32 of its id:
on a Redis Cluster each shard is its own hash tag, so the index's writes, one per lease, spread over
the masters instead of all going to the one holding a single key), job id -> the earliest time (ms)
anything of that job falls due for the supervisor: its first lease deadline (``leases``), its first
approval deadline (``approvals_due``), now for a finished job (to retire it), +inf for a job with
nothing due (an idle running job, a held one).
The supervisor reads ``ZRANGEBYSCORE due -inf now LIMIT``: a pass costs what is due, not what exists.

It is a cache of the job's own keys, never the truth, and it spans jobs, so no ledger script writes it
(a script touches one job's hash tag). Python writes it after every script that names a job's record
(the observer in jobindex.py reads :func:`probe` in the script's own round trip and writes only when
the job's earliest time moved earlier than its entry), and the supervisor settles a job's entry after
visiting it. The rule that keeps it safe: an entry may be early (the supervisor looks, finds nothing,
and settles it later) but must never be late. Writes that lower an entry use ``ZADD LT``; the only write
that raises one is :meth:`DueIndex.settle`, which re-reads the job after writing and lowers the entry
again if a script moved a deadline in between (so a race with a concurrent script is never lost). A
lost entry (a crash between a script and its write, data older than the index) is found by the
supervisor's sweep (ZMSCORE over pages of the active set).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

import redis

from gateway.ledger.keys import Keys

TERMINAL = ("succeeded", "failed", "cancelled")
INF = math.inf
PROBE_LEN = 4  # commands :func:`probe` queues


#: how much earlier than the lease it announces a hint is written: this client's clock against Redis's
HINT_MARGIN_MS = 50

_hint: ContextVar[tuple[str, float] | None] = ContextVar("due_hint", default=None)


def now_ms() -> int:
    return int(time.time() * 1000)


@contextmanager
def hinted(job_id: str, lease_ms: int) -> Iterator[None]:
    """Around a script that may lease a batch of ``job_id`` for at least ``lease_ms``: the observer
    lowers the job's entry to now + ``lease_ms`` (less a margin) in the script's own round trip, so a
    lease never pays a second round trip for its due write (an entry may be early, never late)."""
    token = _hint.set((job_id, float(now_ms() + lease_ms - HINT_MARGIN_MS)))
    try:
        yield
    finally:
        _hint.reset(token)


def hint_for(job_id: str) -> float | None:
    """The due time announced by :func:`hinted` for ``job_id`` in this thread, if any."""
    got = _hint.get()
    return got[1] if got is not None and got[0] == job_id else None


def probe(pipe: Any, keys: Keys, job_id: str, approvals: bool = True) -> None:
    """Queue the reads :func:`due_from` needs: status and waiting count, first lease deadline, first
    approval deadline (only a flow with approval stages has any), and the job's current entry."""
    k = keys.job(job_id)
    pipe.hmget(k.job, "status", "n_waiting", "created_ms")  # created_ms: the job index's read too
    # ZRANGE by name (redis-py's own argument building is a good share of this read's cost): the
    # answer is [member, score] or []
    pipe.execute_command("ZRANGE", k.leases, 0, 0, "WITHSCORES")
    if approvals:
        pipe.execute_command("ZRANGE", k.approvals_due, 0, 0, "WITHSCORES")
    pipe.zscore(keys.due_for(job_id), job_id)


def due_from(got: list, now: int) -> float | None:
    """The job's due time from :func:`probe`'s answers; None if its record is gone (drop the entry)."""
    (status, n_waiting, _), leases, approvals = got[0], got[1], got[2]
    if status is None:
        return None
    waiting = int(n_waiting or 0) > 0 and status != "cancelled"
    if status in TERMINAL and not waiting:
        return float(now)  # retire it
    if status == "held":
        return INF  # nothing runs for it until it is released (a script: the observer files it)
    return min(_first_score(leases), _first_score(approvals))


def _first_score(answer: Any) -> float:
    """The score of ZRANGE key 0 0 WITHSCORES's answer, flat ([m, s]) or paired ([(m, s)]); +inf if
    empty or not read."""
    if not answer:
        return INF
    head = answer[0]
    return float(head[1]) if isinstance(head, (tuple, list)) else float(answer[1])


class DueIndex:
    """Writes and reads of ``<p>:due``."""

    def __init__(self, client: redis.Redis, keys: Keys) -> None:
        self.r = client
        self.keys = keys

    def after_script(self, job_id: str, got: list, gated: bool = False) -> None:
        """After a script (``got``: :func:`probe`'s answers, with approvals read only if ``gated``):
        lower the job's entry if its earliest due time moved earlier (or the entry is missing). A job
        with approval stages (``gated``) is due now, whatever its deadlines: a batch may have been
        re-opened at one (``Approvals.open_ready``)."""
        if any(isinstance(g, Exception) for g in got):
            return  # a read failed: the sweep finds a missing entry; a late one heals at settle
        now = now_ms()
        due = due_from(got if gated else [got[0], got[1], None], now)
        if due is None:
            return
        if gated:
            due = min(due, float(now))
        entry = got[-1]
        if entry is None or due < float(entry):
            self.r.zadd(self.keys.due_for(job_id), {job_id: due}, lt=entry is not None)

    def settle(self, job_ids: Iterable[str]) -> dict[str, float | None]:
        """Set each job's entry to its due time now (the supervisor, after looking at it), safe against
        a script moving a deadline meanwhile: write, read again in the same round trip, and lower the
        entry if the second read says earlier. Three round trips for any number of jobs."""
        ids = list(job_ids)
        if not ids:
            return {}
        pipe = self.r.pipeline(transaction=False)
        for job_id in ids:
            probe(pipe, self.keys, job_id)
        got = pipe.execute()
        now = now_ms()
        first = {job_id: due_from(got[i * PROBE_LEN:(i + 1) * PROBE_LEN], now)
                 for i, job_id in enumerate(ids)}
        pipe = self.r.pipeline(transaction=False)
        for job_id, due in first.items():
            if due is None:
                pipe.zrem(self.keys.due_for(job_id), job_id)
            else:
                pipe.zadd(self.keys.due_for(job_id), {job_id: due})
            probe(pipe, self.keys, job_id)
        got = pipe.execute()
        step = PROBE_LEN + 1
        lower = {}
        for i, job_id in enumerate(ids):
            again = due_from(got[i * step + 1:(i + 1) * step], now_ms())
            was = first[job_id]
            if again is not None and (was is None or again < was):
                lower[job_id] = again
        if lower:
            pipe = self.r.pipeline(transaction=False)
            for key, group in self._by_shard(lower).items():
                pipe.zadd(key, {job_id: lower[job_id] for job_id in group}, lt=True)
            pipe.execute()
        return {**first, **lower}

    def due(self, now: int, count: int) -> list[str]:
        """Up to ``count`` job ids due at ``now``, earliest first (over every shard: one round trip). An
        entry found in a shard that no longer holds its job (``due_shards`` changed) is moved: dropped
        there and answered, so the supervisor's visit settles it in its own shard."""
        keys = self.keys.due_keys()
        pipe = self.r.pipeline(transaction=False)
        for key in keys:
            pipe.zrangebyscore(key, "-inf", now, start=0, num=count, withscores=True)
        found = [(score, job_id, key) for key, got in zip(keys, pipe.execute(), strict=True)
                 for job_id, score in got]
        found.sort()
        moved = [(key, job_id) for _, job_id, key in found[:count] if self.keys.due_for(job_id) != key]
        if moved:
            pipe = self.r.pipeline(transaction=False)
            for key, job_id in moved:
                pipe.zrem(key, job_id)
            pipe.execute()
        return [job_id for _, job_id, _ in found[:count]]

    def missing(self, job_ids: list[str]) -> list[str]:
        """Those of ``job_ids`` without an entry (lost: the sweep settles them)."""
        if not job_ids:
            return []
        groups = self._by_shard(job_ids)
        pipe = self.r.pipeline(transaction=False)
        for key, group in groups.items():
            pipe.zmscore(key, group)
        scores = dict(zip((j for group in groups.values() for j in group),
                          (s for got in pipe.execute() for s in got), strict=True))
        return [j for j in job_ids if scores[j] is None]

    def drop(self, pipe: Any, job_id: str) -> None:
        pipe.zrem(self.keys.due_for(job_id), job_id)

    def adopt_strays(self) -> int:
        """Move the entries of due sets that are not shards of this index any more (``due_shards`` was
        changed) into their jobs' shards, and delete those sets; returns the entries moved. Run once
        at a supervisor's start (SCAN over the prefix's ``due`` keys: every node of a cluster)."""
        ours = set(self.keys.due_keys())
        moved = 0
        for key in self.r.scan_iter(match=f"{self.keys.prefix}:due*", count=1000, _type="zset"):
            if key in ours:
                continue
            for job_id, score in self.r.zscan_iter(key):
                self.r.zadd(self.keys.due_for(job_id), {job_id: score}, lt=True)  # adds, or lowers
                moved += 1
            self.r.delete(key)
        return moved

    def _by_shard(self, job_ids: Iterable[str]) -> dict[str, list[str]]:
        groups: dict[str, list[str]] = {}
        for job_id in job_ids:
            groups.setdefault(self.keys.due_for(job_id), []).append(job_id)
        return groups
