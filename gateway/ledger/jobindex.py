"""The job index: a tenant's jobs by status, by flow (and version) and by creation time, for listing.

The truth is the job record (``<p>:{<job>}:job``, field ``status``; the flow in the job's spec). The
index is a copy kept for reading, in the tenant's own keys (keys.py, ``jobidx``): one sorted set per
filter combination (all, status, flow, flow+version, status+flow, status+flow+version), whose members
are ``<created ms, 13 digits>:<job id>``, all scored 0, so one ZRANGEBYLEX serves the time window and
the page cursor at once, newest or oldest first, in O(log N + page) whatever the filter. A hash
``meta`` says where each job is filed; it is written with the sets in one MULTI.

House rule (../shared/CONVENTIONS.md, habit 3): the index spans jobs, so no Lua script writes it. It is
updated by Python, idempotently, right after every ledger script that names a job's record in its KEYS
(``run``: each script answers whether it moved the job's status; a step's scripts then read nothing
more unless it did, the others send the reads of the job's status and its filed place in their own
round trip; the index is written only when the two differ, which is only when the status changed). A write lost between
the script and the index (a crash, Redis going away) heals three ways: a listing checks each job it
returns against its record and files it again when it moved (``JobList``); the supervisor checks each
active job it looks at (``check``: due jobs, and a few per pass round robin); ``rebuild`` regenerates a tenant's index from the roster and the records.
"""

from __future__ import annotations

import json
import logging
import secrets
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis
from redis.commands.core import Script
from redis.exceptions import NoScriptError

from gateway import metrics
from gateway.ledger import archive
from gateway.ledger import due as due_index
from gateway.ledger.keys import Keys
from gateway.ledger.multi import multi
from gateway.ledger.scripts import unwrap

log = logging.getLogger(__name__)

#: Scripts that commit a job's progress or decisions: with BATCHGATE_REDIS_WAIT_REPLICAS each is followed
#: by WAIT. Leases, heartbeats and source failures are left out: losing one on a failover only repeats
#: work (a lease runs out again), never loses a result.
COMMITS = frozenset({"plan", "complete", "complete_lease", "fail", "expire", "reopen", "replan", "set_status", "cancel",
                     "begin", "outage", "unwait", "handle", "decide", "open_approval", "qretry"})

#: The scripts of every step (a lease and its commit or failure): their runs skip the read-back of the
#: job's status unless they moved it (JobIndex.run). None of them can bring a job's due time earlier
#: without a status change except by leasing, and a lease's due time is sent with it (due.hinted).
#: A script call whose connection times out or drops is sent again (same journal key) this many times,
#: RETRY_PAUSE_S more apart each time, before the error reaches the caller.
RETRIES = 3
RETRY_PAUSE_S = 0.2

FAST = frozenset({"lease", "plan", "complete", "complete_lease", "fail", "heartbeat"})

STATUSES = ("running", "paused", "held", "waiting_human", "succeeded", "failed", "cancelled")
INDEX_FORMAT = "1"  # bump when the index's members or keys change: the supervisor then rebuilds it
CHUNK = 500  # jobs per pipeline in a rebuild


@dataclass(frozen=True)
class Filed:
    """Where the index files one job."""

    status: str
    flow_id: str
    flow_version: str
    created_ms: int

    def encode(self) -> str:
        return f"{self.status} {self.flow_id} {self.flow_version} {self.created_ms}"

    @classmethod
    def decode(cls, raw: str | None) -> Filed | None:
        """The filed place, or None for none (or an unreadable one, which is filed again)."""
        parts = raw.split(" ") if raw else []
        if len(parts) != 4 or not parts[3].isdigit():
            return None
        return cls(parts[0], parts[1], parts[2], int(parts[3]))


def member(created_ms: int, job_id: str) -> str:
    """A job's member in every index set: sorts by creation time, then job id."""
    return f"{created_ms:013d}:{job_id}"


def job_of(entry: str) -> str:
    """The job id of an index member."""
    return entry.partition(":")[2]


class JobIndex:
    """Writes, checks and rebuilds the job index; ``spec_of`` is Ledger.spec (cached)."""

    def __init__(self, client: redis.Redis, keys: Keys, spec_of: Callable[[str], Any]) -> None:
        self.r = client
        self.keys = keys
        self.spec_of = spec_of
        self.due = due_index.DueIndex(client, keys)  # the supervisor's due index follows scripts too
        #: (replicas, timeout ms): WAIT after each commit script (BATCHGATE_REDIS_WAIT_REPLICAS); None: no
        self.wait: tuple[int, int] | None = None

    # -- writing ---------------------------------------------------------------------------

    def keys_of(self, tenant: str, f: Filed) -> list[str]:
        """The six sets a job filed at ``f`` belongs to."""
        k = self.keys
        return [k.job_index(tenant), k.job_index(tenant, f.status),
                k.job_index(tenant, None, f.flow_id), k.job_index(tenant, None, f.flow_id, f.flow_version),
                k.job_index(tenant, f.status, f.flow_id),
                k.job_index(tenant, f.status, f.flow_id, f.flow_version)]

    def file(self, pipe: Any, tenant: str, job_id: str, f: Filed, old: Filed | None = None) -> None:
        """Queue on ``pipe`` the commands that file the job at ``f`` and nowhere else it could be:
        out of ``old``'s sets and of every other status's sets of its flow (idempotent)."""
        entry = member(f.created_ms, job_id)
        keep = self.keys_of(tenant, f)
        if old is not None and old != f:
            for key in self.keys_of(tenant, old):
                if key not in keep or old.created_ms != f.created_ms:
                    pipe.zrem(key, member(old.created_ms, job_id))
        k = self.keys
        for status in STATUSES:
            if status != f.status:
                for key in (k.job_index(tenant, status), k.job_index(tenant, status, f.flow_id),
                            k.job_index(tenant, status, f.flow_id, f.flow_version)):
                    pipe.zrem(key, entry)
        for key in keep:
            pipe.zadd(key, {entry: 0})
        pipe.hset(self.keys.job_index_meta(tenant), job_id, f.encode())

    def refile(self, tenant: str, job_id: str, f: Filed, old: Filed | None = None,
               stray: str | None = None) -> None:
        """File one job at ``f`` now (one MULTI); ``stray`` is a set it was found in and must leave."""
        pipe = multi(self.r)
        if stray is not None and stray not in self.keys_of(tenant, f):
            pipe.zrem(stray, member(f.created_ms, job_id))
        self.file(pipe, tenant, job_id, f, old)
        pipe.execute()
        log.info("job index: filed job_id=%s as %s (was %s)", job_id, f.status,
                 old.status if old else "unfiled")

    def unfile(self, pipe: Any, tenant: str, job_id: str, old: Filed | None, created_ms: int) -> None:
        """Queue the commands that drop a job whose record is gone (retention) from the index."""
        entry = member(created_ms, job_id)
        for key in self.keys_of(tenant, old) if old else [self.keys.job_index(tenant)]:
            pipe.zrem(key, entry)
        pipe.hdel(self.keys.job_index_meta(tenant), job_id)

    # -- the hook every job script runs through (scripts.Observed) -------------------------------

    def job_in(self, keys: Iterable[str]) -> str | None:
        """The job whose record (``<p>:{<job>}:job``) a script names, if it names one."""
        head, tail = f"{self.keys.prefix}:{{", "}:job"
        for key in keys:
            if key.startswith(head) and key.endswith(tail):
                return key[len(head):-len(tail)]
        return None

    def run(self, script: Any, job_id: str, keys: list, args: list, call_id: str | None = None) -> Any:
        """Run a job's script and keep the job index and the due index following it.

        A script answers whether it moved the job's status (scripts.observed_source). The per-step
        scripts (FAST: lease, plan, complete, fail, heartbeat) of a job without approval stages go alone,
        with the due hint of a lease (due.py) in the same round trip: nothing else can have changed for
        the indexes unless the status moved, and then a second round trip reads the status and where the
        index filed it and files it again (one per status change, a few per job). Every other script
        (control actions, push-mode and approval scripts: rarer, and some move what the indexes read
        without a status change) sends those reads in its own round trip, as before. The script's answer
        is returned (or raised) as is.

        Each call has a journal key (``call_id``, random unless given; scripts.observed_source): a call
        whose connection times out or drops is sent again with the same key, up to RETRIES times, and a
        script that had taken effect answers with its first answer instead of running twice."""
        try:
            spec = self.spec_of(job_id)
            tenant, gated = spec.tenant, bool(spec.flow.gates())
        except Exception:  # noqa: BLE001 - no readable spec: the script itself answers missing/corrupt
            return script(keys=keys, args=args)
        k = self.keys.job(job_id)
        operation = getattr(script, "name", "").removeprefix("ledger.")
        wait = self.wait if self.wait is not None and operation in COMMITS else None
        # the due entry, lowered without a second round trip where the caller knows how (due.py): a
        # lease's deadline; a job with approval stages is due now after any script
        hint = due_index.now_ms() if gated else due_index.hint_for(job_id)
        fast = operation in FAST and not gated
        argv = [k.call(call_id or secrets.token_urlsafe(12)), *args]
        loaded, tries = False, 0
        while True:
            pipe = self.r.pipeline(transaction=False)
            pipe.execute_command("EVALSHA", script.sha, len(keys), *keys, *argv)  # a cluster pipeline
            if wait is not None:  # blocks .evalsha; WAIT follows the script on its connection
                pipe.execute_command("WAIT", *wait, **self._node_of(k.job))
            if hint is not None:
                pipe.zadd(self.keys.due_for(job_id), {job_id: hint}, lt=True)
            if not fast:
                self._probe(pipe, tenant, job_id, gated)
            try:
                answer, *replies = pipe.execute(raise_on_error=False)
            except (redis.exceptions.TimeoutError, redis.exceptions.ConnectionError) as exc:
                tries += 1
                if tries > RETRIES:
                    raise
                # the script may have run: the same journal key makes the repeat answer its first answer
                log.warning("ledger script %s: %s; sending it again (%s of %s) job_id=%s", operation,
                            type(exc).__name__, tries, RETRIES, job_id)
                time.sleep(RETRY_PAUSE_S * tries)
                continue
            if isinstance(answer, NoScriptError) and not loaded:  # a restarted Redis: nothing ran
                self.r.script_load(_text(script))
                loaded = True
                continue
            break
        acked = replies.pop(0) if wait is not None else None
        if hint is not None:
            replies.pop(0)
        if isinstance(answer, Exception):
            raise answer
        res, moved = unwrap(answer)
        if wait is not None and (not isinstance(acked, int) or acked < wait[0]):
            metrics.REDIS_WAIT_SHORT.labels(operation).inc()
            log.warning("commit acknowledged by %s of %s replicas within %s ms (it stands on the master; "
                        "a failover now would lose it) operation=%s job_id=%s",
                        acked if isinstance(acked, int) else "?", wait[0], wait[1], operation, job_id)
        if fast and not moved:
            return res  # the usual step: the status stayed, so did the index; due only came later
        if fast:  # the status moved: read what the indexes need, in a round trip of its own
            pipe = self.r.pipeline(transaction=False)
            self._probe(pipe, tenant, job_id, gated)
            replies = pipe.execute(raise_on_error=False)
        self._follow(tenant, job_id, gated, replies)
        return res

    def _probe(self, pipe: Any, tenant: str, job_id: str, gated: bool) -> None:
        """Queue the reads `_follow` needs: where the index filed the job, and due.py's probe."""
        pipe.hget(self.keys.job_index_meta(tenant), job_id)
        # status and created_ms (the index), and when the supervisor must look at it next (due.py)
        due_index.probe(pipe, self.keys, job_id, approvals=gated)

    def _follow(self, tenant: str, job_id: str, gated: bool, replies: list) -> None:
        """File the job again and lower its due entry as `_probe`'s answers say (after a script)."""
        filed, *probed = replies
        truth = probed[0] if isinstance(probed[0], Exception) else (probed[0][0], probed[0][2])
        try:
            self._after(tenant, job_id, truth, filed)
        except Exception:  # noqa: BLE001 - the script committed; the supervisor and listings heal it
            log.warning("job index: update after a script failed job_id=%s", job_id, exc_info=True)
        try:  # a job with approval stages is looked at after any script: a batch may wait at one
            self.due.after_script(job_id, probed, gated=gated)
        except Exception:  # noqa: BLE001 - the script committed; the supervisor's sweep heals it
            log.warning("due index: update after a script failed job_id=%s", job_id, exc_info=True)

    def _node_of(self, key: str) -> dict[str, Any]:
        """On a cluster, the master serving ``key`` (a keyless WAIT goes where the script went)."""
        node_of = getattr(self.r, "get_node_from_key", None)
        return {"target_nodes": node_of(key)} if node_of is not None else {}

    def _after(self, tenant: str, job_id: str, truth: Any, filed: Any) -> None:
        if isinstance(truth, Exception) or isinstance(filed, Exception) or not truth[0]:
            return  # no record (or a read error): nothing to file
        old = Filed.decode(filed)
        status, created = truth[0], int(truth[1] or 0)
        if old is not None and old.status == status:
            return  # the usual case: the status did not change
        if old is not None:  # only the status changes here; the flow only by migrate (check)
            new = Filed(status, old.flow_id, old.flow_version, old.created_ms)
        else:
            spec = self.spec_of(job_id)
            new = Filed(status, spec.flow.id, spec.flow.version, created)
        self.refile(tenant, job_id, new, old)

    # -- checking (supervisor, migrate) ------------------------------------------------------

    def check(self, job_id: str, job: dict[str, str] | None = None) -> bool:
        """File the job again if its record and the index disagree (status, flow, or an entry missing
        from one of its sets); ``job`` is its record if the caller has read it. True if it was."""
        spec = self.spec_of(job_id)
        if job is None:
            status, created = self.r.hmget(self.keys.job(job_id).job, "status", "created_ms")
            if status is None:
                return False
        else:
            status, created = job["status"], job.get("created_ms")
        truth = Filed(status, spec.flow.id, spec.flow.version, int(created or 0))
        expected = self.keys_of(spec.tenant, truth)
        pipe = self.r.pipeline(transaction=False)
        pipe.hget(self.keys.job_index_meta(spec.tenant), job_id)
        for key in expected:
            pipe.zscore(key, member(truth.created_ms, job_id))
        filed, *scores = pipe.execute()
        if filed == truth.encode() and all(s is not None for s in scores):
            return False
        self.refile(spec.tenant, job_id, truth, Filed.decode(filed))
        return True

    # -- reading ---------------------------------------------------------------------------

    def range(self, key: str, lo: str, hi: str, newest_first: bool, count: int) -> list[str]:
        """Up to ``count`` members of ``key`` between lex bounds ``lo`` and ``hi``."""
        if newest_first:
            return self.r.zrevrangebylex(key, hi, lo, start=0, num=count)
        return self.r.zrangebylex(key, lo, hi, start=0, num=count)

    # -- rebuilding ------------------------------------------------------------------------

    def ensure_built(self) -> bool:
        """Build every tenant's index once per deployment (jobs made before the index existed, or by a
        version whose index format differs); True when it built. The supervisor calls it at start;
        two that race both rebuild, which is safe (rebuild is idempotent)."""
        if self.r.get(self.keys.job_index_built) == INDEX_FORMAT:
            return False
        report = self.rebuild_all()
        self.r.set(self.keys.job_index_built, INDEX_FORMAT)
        log.info("job index built for %d tenants", len(report))
        return True

    def tenants(self) -> list[str]:
        """Every tenant with a roster (that ever had a job), sorted."""
        head = self.keys.jobs_pattern[:-1]
        return sorted({key[len(head):] for key in self.r.scan_iter(self.keys.jobs_pattern, count=1000)})

    def rebuild_all(self) -> dict[str, dict[str, int]]:
        """Rebuild every tenant's index (every tenant with a roster)."""
        return {tenant: self.rebuild(tenant) for tenant in self.tenants()}

    def rebuild(self, tenant: str) -> dict[str, int]:
        """Regenerate ``tenant``'s index from its roster and the job records: every job with a record
        is filed where it belongs, every other entry goes; jobs whose record expired leave the roster
        and the quota's active set too. Safe while jobs run (a status that changes meanwhile is
        corrected by the next listing, check or script)."""
        roster = self.keys.jobs(tenant)
        truth: dict[str, Filed] = {}
        gone: list[str] = []
        for start in range(0, self.r.zcard(roster), CHUNK):
            ids = self.r.zrange(roster, start, start + CHUNK - 1)
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                pipe.hmget(self.keys.job(job_id).job, "status", "created_ms")
                pipe.hget(self.keys.job(job_id).spec, "flow")
            replies = pipe.execute()
            for job_id, (status, created), flow in zip(ids, replies[::2], replies[1::2]):
                if flow is None and status is not None:  # a job at rest keeps its spec in its past
                    flow = archive.spec_fields(self.r, self.keys.job(job_id)).get("flow")
                f = _filed(status, created, flow)
                if f is None:
                    gone.append(job_id)
                else:
                    truth[job_id] = f
        removed = self._sweep(tenant, truth)
        for start in range(0, len(truth), CHUNK):
            pipe = multi(self.r)
            for job_id in list(truth)[start:start + CHUNK]:
                self.file(pipe, tenant, job_id, truth[job_id])
            pipe.execute()
        for start in range(0, len(gone), CHUNK):
            chunk = gone[start:start + CHUNK]
            self.r.zrem(roster, *chunk)
            self.r.srem(self.keys.quota_active(tenant), *chunk)
        log.info("job index rebuilt tenant=%s filed=%s gone=%s stray=%s", tenant, len(truth), len(gone),
                 removed)
        return {"filed": len(truth), "gone": len(gone), "stray_removed": removed}

    def _sweep(self, tenant: str, truth: dict[str, Filed]) -> int:
        """Remove every index entry (and meta field) that ``truth`` does not file where it is."""
        meta = self.keys.job_index_meta(tenant)
        removed = 0
        for key in self.r.scan_iter(self.keys.job_index_pattern(tenant), count=1000):
            if key == meta:
                stray = [job_id for job_id, _ in self.r.hscan_iter(meta, count=1000) if job_id not in truth]
                for start in range(0, len(stray), CHUNK):
                    removed += self.r.hdel(meta, *stray[start:start + CHUNK])
                continue
            stray = [m for m in self.r.zrange(key, 0, -1) if not self._belongs(tenant, key, m, truth)]
            for start in range(0, len(stray), CHUNK):
                removed += self.r.zrem(key, *stray[start:start + CHUNK])
        return removed

    def _belongs(self, tenant: str, key: str, entry: str, truth: dict[str, Filed]) -> bool:
        f = truth.get(job_of(entry))
        return f is not None and entry == member(f.created_ms, job_of(entry)) and key in self.keys_of(tenant, f)


def _filed(status: str | None, created: str | None, flow: str | None) -> Filed | None:
    """Where a job belongs, from its record's status and created_ms and its spec's flow (JSON)."""
    if not status or not flow:
        return None
    try:
        spec_flow = json.loads(flow)
        return Filed(status, spec_flow["id"], spec_flow["version"], int(created or 0))
    except (ValueError, KeyError, TypeError):
        return None


def _text(script: Any) -> str:
    """The Lua text of a registered script (redis-py's Script, maybe inside scripts.Traced)."""
    while not isinstance(script, Script):
        script = script.script
    return script.script
