"""Every Redis key batchgate uses is built here, from one prefix, with ``:`` as the only separator.

All keys of one job share the hash tag ``{<job_id>}`` so every Lua script touches one slot.

The parts keys are built from never hold ``:`` (the separator) or ``{}`` (hash tags), so no two keys of
different tenants, flows or jobs can be the same string: tenant names are checked at start
(``settings.TENANT_NAME``), flow ids and versions wherever a key is built from them
(``flows.FlowRegistry._key``), job ids before a job's keys are read (``jobs.is_job_id``; new ones come
from ``jobs.new_job_id``). Idempotency keys are hashed.

Per job (owner: the ledger scripts; expiry: retention, see ``Ledger.apply_retention``):

=============================  ======  =====================================================
``<p>:{<job>}:job``            hash    mutable job state, sealed with a checksum
``<p>:{<job>}:spec``           hash    frozen flow definition + source + params, checksummed
``<p>:{<job>}:src``            list    inline source items (only for ``inline`` sources)
``<p>:{<job>}:batch:<seq>``    hash    one batch: cursors, stage, attempt, lease, outputs
``<p>:{<job>}:items:<seq>``    string  JSON list of the batch's items; deleted once committed
``<p>:{<job>}:ready:<stage>``  zset    batches waiting for ``stage``; score = ready-at (ms)
``<p>:{<job>}:leases``         zset    leased batches; score = lease deadline (ms)
``<p>:{<job>}:done``           hash    seq -> end cursor of completed batches above the watermark
``<p>:{<job>}:failed``         zset    permanently failed batches; score = seq
``<p>:{<job>}:quarantine``     zset    quarantined items ``<seq>.<index>``; score = seq (fail.lua,
                                       qretry.lua; the error is in the batch record: Bisection)
``<p>:{<job>}:log``            stream  execution log, capped (``log_maxlen``)
``<p>:{<job>}:audit``          stream  control events (created, paused, cursor moved, ...), never capped
``<p>:{<job>}:events``         stream  outbox of the job's webhook events (job.succeeded, ...), appended
                                       by the script that changes the status (lib.lua save); never capped
``<p>:{<job>}:approval:<seq>.<stage>.<round>``  hash  one approval (approvals.py), sealed with a checksum
``<p>:{<job>}:approvals``      zset    every approval id of the job; score = created (ms)
``<p>:{<job>}:approvals:due``  zset    pending approval ids; score = deadline (ms): the supervisor's timeouts
``<p>:{<job>}:cost``           hash    the cost ledger: calls, paid calls, redone calls, tokens, price and
                                       call time, in total and per stage index (``<field>:<stage>``);
                                       written by complete.lua/fail.lua (lib.lua record_cost)
``<p>:{<job>}:planlock``       string  who is reading the source to plan the next batch, short TTL
``<p>:{<job>}:recover``        string  supervisor recovery claim, short TTL
``<p>:{<job>}:supclaim``       string  a supervisor looking at the job now (SET NX PX, due.py)
``<p>:{<job>}:sink``           hash    the result sink's delivery cursor: ``seq`` (every batch below it
                                       is delivered and compacted), ``off`` (bytes of the sink file
                                       that hold them), ``batches``, ``items``, ``error``, ``error_ms``;
                                       and the range summaries of the compacted batch records:
                                       ``r:<first seq>`` = JSON ``{first, last, gen, cursor, end_cursor,
                                       batches, items, superseded}``, ``rlast`` (compact.lua,
                                       push/sinks.py); only jobs with a sink
``<p>:{<job>}:past``           string  a job at rest, folded (archive.py, archive.lua): zlib JSON of its
                                       spec and its log, audit and (once every subscriber had them)
                                       events entries; the spec hash and those streams are gone then.
                                       Readers take the spec from it when the hash is absent, and its
                                       entries before the streams' (new ones, after a resume)
``<p>:{<job>}:sinkclaim``      string  the one deliverer of the job's sink now (SET NX PX, push/sinks.py)
``<p>:{<job>}:sinklate``       zset    delivered batches whose quarantined items were retried: the sink
                                       owes them an amendment once they commit again (qretry.lua adds,
                                       amend.lua removes; the sink hash's ``late`` counts them)
=============================  ======  =====================================================

Global (updated outside scripts, idempotently; rebuildable from the job keys):

===================================  ======  ===============================================
``<p>:flow:<tenant>:<id>:<version>``  hash    a registered flow version (definition, hash)
``<p>:flows:<tenant>``                zset    ``<id>:<version>`` by registration time
``<p>:due``, ``<p>:due:{d<n>}``      zset    the supervisor's due index (due.py): job id -> when it must
                                              next be looked at; one set, or BATCHGATE_DUE_SHARDS sets
                                              (a job's by crc32 of its id), each its own hash tag
``<p>:jobs:<tenant>``                 zset    job ids by creation time (ms): the tenant's roster
                                              (create_job; quotas.py; the job index rebuilds from it)
``<p>:jobidx:{<tenant>}:all``         zset    the job index (jobindex.py): members
                                              ``<created ms, 13 digits>:<job id>``, all scored 0
                                              (read by lex range: time window and cursor in one)
``<p>:jobidx:{<tenant>}:s:<status>``  zset    the same, only jobs whose job hash is in ``status``
``<p>:jobidx:{<tenant>}:f:<flow>``    zset    only jobs of flow ``<flow>`` (any version); also
                                              ``...:f:<flow>:v:<version>``, ``...:s:<status>:f:<flow>``
                                              and ``...:s:<status>:f:<flow>:v:<version>``: one key
                                              per filter combination, so every listing is one range
``<p>:jobidx:{<tenant>}:meta``        hash    job id -> where the index filed it (``status flow
                                              version created_ms``); written with the zsets in one
                                              MULTI; no expiry (listing drops retired jobs)
``<p>:jobidx:built``                  string  the index format every tenant's index was built in;
                                              absent or older: the supervisor rebuilds at start
``<p>:approvals:{<tenant>}:<status>``  zset    the tenant's approvals in ``status`` (pending, approved,
                                              rejected): members ``<created ms, 13 digits>:<id>``,
                                              scored 0; written after the scripts, verified on read
``<p>:decide:key``                    string  HMAC key of signed decision links when no signing_key
                                              is configured (generated once, SET NX)
``<p>:active``                        set     job ids the supervisor watches
``<p>:due``                           zset    active job id -> when the supervisor must next look at
                                              it (first lease or approval deadline; now to retire;
                                              +inf: nothing due); due.py, a cache of the job's keys
``<p>:creating``                      zset    cluster mode: job id -> ms its creation began, until
                                              its roster, index, active and due entries are written
                                              (creations.py; the supervisor repairs stale entries)
``<p>:idem:<tenant>:<sha256>``        hash    Idempotency-Key record; TTL ``idempotency_ttl``
``<p>:idemclaim:<tenant>:<sha256>``   string  first claim of that key (request fingerprint)
``<p>:sub:<id>``                      hash    a webhook subscription (tenant, url, events, secret)
``<p>:subs:<tenant>``                 set     the tenant's subscription ids
``<p>:sub:<id>:cursor``               hash    job id -> last outbox entry handled (delivered or
                                              given up); the deliverer's durable progress
``<p>:sub:<id>:retry``                hash    job id -> JSON retry state of the entry in flight
``<p>:sub:<id>:deliveries``           list    newest delivery attempts (JSON), capped
``<p>:events:pending``                set     retired job ids whose outbox may still hold undelivered
                                              events (the deliverer also reads every active job)
``<p>:events:gone``                   zset    retired jobs whose keys retention expires: member
                                              ``<job id> <tenant>``, score = when they are gone (ms);
                                              the deliverer then drops their subscription cursors
``<p>:target:{<id>}:slots``           zset    calls in flight to one platform target; score = expiry
``<p>:target:{<id>}:breaker``         hash    an open circuit breaker: the target is unavailable
                                              (since_ms, until_ms, fails, error, probe_ms); breaker.lua
``<p>:target:{<id>}:latency:<tenant>``  list  the tenant's newest call durations on that target
                                              (``<ms> <items>``), capped (dispatch.py LATENCY_KEPT);
                                              read by the tenant's dry runs; no expiry (bounded)
``<p>:target:{<id>}:waiting``         set     job ids with batches waiting for that target to answer
``<p>:push:jobs``                     set     job ids with push stages the workers feed (kick adds)
``<p>:sink:jobs``                     set     job ids with a result sink that may have batches to
                                              deliver (create_job and persist_job add; the sink
                                              deliverer removes a job at rest with nothing left)
``<p>:push:wake``                     list    job ids whose work may be ready now (kick pushes)
``<p>:quota:active:{<tenant>}``       set     the tenant's job ids that may still be active: added
                                              by quota.lua when a creation is admitted, re-added on
                                              resume; pruned from the jobs' own status (quotas.py);
                                              no expiry
``<p>:quota:creations:{<tenant>}``    string  job-creation rate (GCRA arrival time, ms); quota.lua;
                                              expires when the tenant is idle (at most a minute)
``<p>:quota:leases:{<tenant>}``       string  pull-lease rate (GCRA arrival time, ms); quota.lua;
                                              expires when the tenant is idle (at most a second)
``<p>:quota:prune:{<tenant>}``        string  the last prune of the active set; PX 1 s (one a second)
``<p>:boot``                          hash    the deployment's generation: live processes (deadline
                                              each) and whether start-up recovery is decided; boot.lua
``<p>:console:session:<sha256>``      hash    a web console session (tenant, CSRF token, a digest of
                                              the token it signed in with); keyed by the SHA-256 of
                                              the cookie's session id; TTL 12 h (console/sessions.py)
===================================  ======  ===============================================

The quota keys end with the tenant name as the hash tag: one slot per tenant (quota.lua touches two
of them), and two tenants' keys never collide whatever their names, since the tenant is the whole
rest of the key.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass


@dataclass(frozen=True)
class JobKeys:
    """Key names of one job."""

    prefix: str
    job_id: str

    @property
    def _base(self) -> str:
        return f"{self.prefix}:{{{self.job_id}}}"

    @property
    def job(self) -> str:
        return f"{self._base}:job"

    @property
    def spec(self) -> str:
        return f"{self._base}:spec"

    @property
    def src(self) -> str:
        return f"{self._base}:src"

    @property
    def leases(self) -> str:
        return f"{self._base}:leases"

    @property
    def done(self) -> str:
        return f"{self._base}:done"

    @property
    def failed(self) -> str:
        return f"{self._base}:failed"

    @property
    def log(self) -> str:
        return f"{self._base}:log"

    @property
    def audit(self) -> str:
        return f"{self._base}:audit"

    @property
    def events(self) -> str:
        return f"{self._base}:events"

    def call(self, call_id: str) -> str:
        """The first answer of one script call (scripts.observed_source), kept for JOURNAL_MS."""
        return f"{self._base}:call:{call_id}"

    @property
    def cost(self) -> str:
        return f"{self._base}:cost"

    @property
    def plan_lock(self) -> str:
        return f"{self._base}:planlock"

    @property
    def recover(self) -> str:
        return f"{self._base}:recover"

    @property
    def sup_claim(self) -> str:
        return f"{self._base}:supclaim"

    @property
    def approvals(self) -> str:
        return f"{self._base}:approvals"

    @property
    def approvals_due(self) -> str:
        return f"{self._base}:approvals:due"

    @property
    def quarantine(self) -> str:
        return f"{self._base}:quarantine"

    @property
    def sink(self) -> str:
        return f"{self._base}:sink"

    @property
    def past(self) -> str:
        return f"{self._base}:past"

    @property
    def sink_claim(self) -> str:
        return f"{self._base}:sinkclaim"

    @property
    def sink_late(self) -> str:
        return f"{self._base}:sinklate"

    def approval(self, seq: int, stage: int, round_: int) -> str:
        return f"{self._base}:approval:{seq}.{stage}.{round_}"

    def batch(self, seq: int) -> str:
        return f"{self._base}:batch:{seq}"

    def items(self, seq: int) -> str:
        return f"{self._base}:items:{seq}"

    def ready(self, stage: int) -> str:
        return f"{self._base}:ready:{stage}"


@dataclass(frozen=True)
class Keys:
    """Key builder for one prefix; ``due_shards``: how many sorted sets the due index is cut into."""

    prefix: str
    due_shards: int = 1

    def job(self, job_id: str) -> JobKeys:
        return JobKeys(self.prefix, job_id)

    def flow(self, tenant: str, flow_id: str, version: str) -> str:
        return f"{self.prefix}:flow:{tenant}:{flow_id}:{version}"

    def flows(self, tenant: str) -> str:
        return f"{self.prefix}:flows:{tenant}"

    def jobs(self, tenant: str) -> str:
        return f"{self.prefix}:jobs:{tenant}"

    def job_index(self, tenant: str, status: str | None = None, flow_id: str | None = None,
                  flow_version: str | None = None) -> str:
        """The job index zset for one filter combination (a version only with its flow)."""
        parts = [f"{self.prefix}:jobidx:{{{tenant}}}"]
        if status is not None:
            parts += ["s", status]
        if flow_id is not None:
            parts += ["f", flow_id]
            if flow_version is not None:
                parts += ["v", flow_version]
        return ":".join(parts) if len(parts) > 1 else f"{parts[0]}:all"

    @property
    def jobs_pattern(self) -> str:
        """SCAN pattern of every tenant's roster (``jobs``; the job index rebuild only)."""
        return f"{self.prefix}:jobs:*"

    @property
    def job_index_built(self) -> str:
        """The job index's format version, set once every tenant's index was built (``ensure_built``)."""
        return f"{self.prefix}:jobidx:built"

    def job_index_meta(self, tenant: str) -> str:
        return f"{self.prefix}:jobidx:{{{tenant}}}:meta"

    def job_index_pattern(self, tenant: str) -> str:
        """SCAN pattern of every job index key of ``tenant`` (rebuild only)."""
        return f"{self.prefix}:jobidx:{{{tenant}}}:*"

    def approval_index(self, tenant: str, status: str) -> str:
        return f"{self.prefix}:approvals:{{{tenant}}}:{status}"

    @property
    def decide_key(self) -> str:
        return f"{self.prefix}:decide:key"

    @property
    def active(self) -> str:
        return f"{self.prefix}:active"

    @property
    def due(self) -> str:
        """The due index when it is one sorted set (``due_shards`` 1, the default)."""
        return f"{self.prefix}:due"

    def due_shard(self, shard: int) -> str:
        """Shard ``shard`` of the due index: ``<p>:due`` when there is one, else ``<p>:due:{d<shard>}``
        (each its own hash tag, so a cluster spreads them over its slots and masters)."""
        return self.due if self.due_shards == 1 else f"{self.prefix}:due:{{d{shard}}}"

    def due_for(self, job_id: str) -> str:
        """The due index shard that holds ``job_id``'s entry (crc32 of the id, mod ``due_shards``)."""
        if self.due_shards == 1:
            return self.due
        return self.due_shard(zlib.crc32(job_id.encode()) % self.due_shards)

    def due_keys(self) -> list[str]:
        return [self.due_shard(i) for i in range(self.due_shards)]

    @property
    def creating(self) -> str:
        return f"{self.prefix}:creating"

    def idempotency(self, tenant: str, key: str) -> str:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return f"{self.prefix}:idem:{tenant}:{digest}"

    def target_slots(self, target_id: str) -> str:
        return f"{self.prefix}:target:{{{target_id}}}:slots"

    def target_breaker(self, target_id: str) -> str:
        return f"{self.prefix}:target:{{{target_id}}}:breaker"

    def target_latency(self, target_id: str, tenant: str) -> str:
        return f"{self.prefix}:target:{{{target_id}}}:latency:{tenant}"

    def target_waiting(self, target_id: str) -> str:
        return f"{self.prefix}:target:{{{target_id}}}:waiting"

    @property
    def push_jobs(self) -> str:
        return f"{self.prefix}:push:jobs"

    @property
    def sink_jobs(self) -> str:
        return f"{self.prefix}:sink:jobs"

    @property
    def push_wake(self) -> str:
        return f"{self.prefix}:push:wake"

    def quota_active(self, tenant: str) -> str:
        return f"{self.prefix}:quota:active:{{{tenant}}}"

    def quota_creations(self, tenant: str) -> str:
        return f"{self.prefix}:quota:creations:{{{tenant}}}"

    def quota_leases(self, tenant: str) -> str:
        return f"{self.prefix}:quota:leases:{{{tenant}}}"

    def quota_prune(self, tenant: str) -> str:
        return f"{self.prefix}:quota:prune:{{{tenant}}}"

    def subscription(self, sub_id: str) -> str:
        return f"{self.prefix}:sub:{sub_id}"

    def subscriptions(self, tenant: str) -> str:
        return f"{self.prefix}:subs:{tenant}"

    def sub_cursor(self, sub_id: str) -> str:
        return f"{self.prefix}:sub:{sub_id}:cursor"

    def sub_retry(self, sub_id: str) -> str:
        return f"{self.prefix}:sub:{sub_id}:retry"

    def sub_deliveries(self, sub_id: str) -> str:
        return f"{self.prefix}:sub:{sub_id}:deliveries"

    @property
    def events_pending(self) -> str:
        return f"{self.prefix}:events:pending"

    @property
    def events_gone(self) -> str:
        return f"{self.prefix}:events:gone"

    def alive(self, role: str) -> str:
        """Liveness beats of one role's processes (liveness.py)."""
        return f"{self.prefix}:alive:{role}"

    @property
    def boot(self) -> str:
        return f"{self.prefix}:boot"

    def idempotency_claim(self, tenant: str, key: str) -> str:
        digest = hashlib.sha256(key.encode()).hexdigest()
        return f"{self.prefix}:idemclaim:{tenant}:{digest}"

    def console_session(self, session_id: str) -> str:
        """A console session, by the digest of its id: the key names no usable cookie."""
        digest = hashlib.sha256(session_id.encode()).hexdigest()
        return f"{self.prefix}:console:session:{digest}"
