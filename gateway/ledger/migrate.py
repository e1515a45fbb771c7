"""Flow migration: move a paused or failed job to another version of its flow (migrate.lua).

A job's spec freezes its flow; a migration replaces it, once, under the rules migrate.lua keeps: the job
is paused or failed, nothing is leased, and the new version keeps the names (at the same positions) of
every stage a batch is in or has committed. Stages may be appended; retry, lease, target and the like may
change. Batches, cursors and counters stay as they are, and idempotency keys are made from the stage
name and the item range (JobSpec.stage_key), so a committed stage is never run again and a re-opened one
keeps the key its platform may have seen.

The job's ``spec_gen`` rises with the spec, which is how every process learns that its cached spec is
old: Ledger.spec trusts a cached spec for SPEC_RECHECK_S after it last saw it current, and a migrated job
resumes only SPEC_SETTLE_S after its migration (``settle``), so nothing runs on the old version again.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Any

from gateway.errors import Conflict, CorruptRecord, JobCancelled, NotFound, RetryableError
from gateway.ledger import archive
from gateway.ledger.flows import FlowSpec, Stage
from gateway.ledger.jobspec import JobSpec
from gateway.ledger.ledger import SPEC_RECHECK_S, Ledger
from gateway.ledger.records import seal
from gateway.ledger.scripts import source

log = logging.getLogger(__name__)

RACE_RETRIES = 50
#: how long after a migration the job may run again: every process's cached spec is checked by then
SPEC_SETTLE_S = SPEC_RECHECK_S + 0.5


def _same(before: Stage, after: Stage) -> bool:
    """A stage is kept when its name is, and it stays an approval stage (or stays not one): a batch
    waiting on a person there must not find a platform stage, nor a leased batch an approval."""
    return before.name == after.name and (before.approval is None) == (after.approval is None)


def kept_prefix(old: FlowSpec, new: FlowSpec) -> int:
    """How many leading stages ``new`` keeps from ``old``: same name at the same position (_same)."""
    kept = 0
    for before, after in zip(old.stages, new.stages):
        if not _same(before, after):
            break
        kept += 1
    return kept


def incompatible_stages(old: FlowSpec, new: FlowSpec, used: int) -> list[str]:
    """The stages in use (the first ``used`` of ``old``) that ``new`` drops, renames, moves, or turns into
    an approval stage or out of one."""
    return [s.name for i, s in enumerate(old.stages[:used])
            if i >= len(new.stages) or not _same(s, new.stages[i])]


def migrate(ledger: Ledger, spec: JobSpec, flow: FlowSpec, flow_hash: str, actor: str,
            reason: str) -> dict[str, Any]:
    """Replace ``spec``'s flow by ``flow`` (hash ``flow_hash``) in one script; returns what changed.

    Conflict (409) when the job is not paused or failed, when batches are leased, or when the new
    version drops a stage in use (the error's ``incompatible`` names them).
    """
    script = ledger.r.register_script(source("migrate"))
    k = ledger.keys.job(spec.job_id)
    archive.restore_spec(ledger.r, k)  # a job at rest folded its spec into its past: migrate.lua checks it
    for _ in range(RACE_RETRIES):
        spec = ledger.spec(spec.job_id)
        new = dataclasses.replace(spec, flow=flow, flow_hash=flow_hash, spec_gen=spec.spec_gen + 1,
                                  prev_flow_hash=spec.flow_hash,
                                  prev_flow_version=spec.flow.version)
        job = ledger.job_fields(spec.job_id)
        wm, next_seq = int(job["wm"]), int(job["next_seq"])
        pairs = [part for item in seal(new.to_fields()).items() for part in item]
        res = script(keys=[k.job, k.spec, k.leases, k.log, k.audit,
                           *[k.batch(s) for s in range(wm, next_seq)]],
                     args=[spec.spec_gen, spec.stage_count, kept_prefix(spec.flow, flow), wm, next_seq,
                           ledger.settings.log_maxlen, actor, reason[:2000],
                           f"{spec.flow.id}@{spec.flow.version}", f"{flow.id}@{flow.version}",
                           spec.flow_hash, flow_hash, *pairs])
        if res[0] != "raced":
            break
        time.sleep(0.002)
    else:
        raise RetryableError(f"job {spec.job_id} changed too fast to migrate; try again")
    _raise_for(res, spec, flow)
    ledger.forget(spec.job_id)
    try:  # the job index files it under its new flow version (jobindex.py)
        ledger.index.check(spec.job_id)
        # the supervisor looks at it next pass (new approval stages, say): due.py
        ledger.r.zadd(ledger.keys.due_for(spec.job_id), {spec.job_id: int(time.time() * 1000)}, lt=True)
    except Exception:  # noqa: BLE001 - migrated already; the supervisor's pass files it
        log.warning("job index: refiling after a migration failed job_id=%s", spec.job_id, exc_info=True)
    log.info("flow migrated job_id=%s %s@%s -> %s@%s actor=%s", spec.job_id, spec.flow.id,
             spec.flow.version, flow.id, flow.version, actor)
    return {"from": {"version": spec.flow.version, "hash": spec.flow_hash},
            "to": {"version": flow.version, "hash": flow_hash}, "spec_gen": int(res[1])}


def _raise_for(res: list, spec: JobSpec, flow: FlowSpec) -> None:
    job_id = spec.job_id
    if res[0] == "missing":
        raise NotFound(f"job {job_id} not found")
    if res[0] == "corrupt":
        raise CorruptRecord(f"job {job_id} failed its checksum ({res[1]}); it will not run")
    if res[0] == "refused":
        status = res[1]
        if status == "cancelled":
            raise JobCancelled(f"job {job_id} is cancelled; a cancelled job cannot be migrated",
                               job_status=status)
        raise Conflict(f"job {job_id} is {status}; only a paused or failed job can be migrated "
                       "(pause it first)", job_status=status)
    if res[0] == "in_flight":
        raise Conflict(f"job {job_id} has {res[1]} batch(es) leased; migrate once they are answered "
                       "or their leases expire", leased=int(res[1]))
    if res[0] == "incompatible":
        names = incompatible_stages(spec.flow, flow, int(res[1]))
        raise Conflict(f"flow {flow.id} version {flow.version} does not keep the stages batches of job "
                       f"{job_id} are in or have committed: {', '.join(names)} (stage names must stay, "
                       "in order; new stages may only be appended)", incompatible=names)


def settle(ledger: Ledger, job: dict[str, str]) -> None:
    """Wait until SPEC_SETTLE_S have passed since the job's last migration (Redis's clock), so every
    process has seen the new spec before a resume or retry-failed lets batches run again."""
    migrated_ms = int(job.get("migrated_ms") or 0)
    if not migrated_ms:
        return
    seconds, micros = ledger.r.time()
    left_s = migrated_ms / 1000 + SPEC_SETTLE_S - (seconds + micros / 1e6)
    if left_s > 0:
        time.sleep(left_s)
