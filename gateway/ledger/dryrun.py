"""Plan before running: what a job would take, answered without creating it (``"dry_run": true``).

Where the source tells its size (inline items and sequences, batched by ``max_items`` only) the batches
are counted; otherwise the source is read as the job would read it (planner.cut_batches, batch by batch,
nothing kept), so the count is the real run's. Reading stops after PLAN_READ_S or PLAN_MAX_BATCHES (the
request's thread waits that long at most): the count is then a lower bound. Each batch runs each stage
once in a run without faults, so calls per stage = batches (approval stages make no call). Durations
come from each target's recent call times (dispatch.py keeps the newest per target), else from this
flow's cost ledger (its recent jobs' call time per stage); costs from this flow's cost ledger (cost.py).
Every figure says how sure it is: ``exact``, ``lower_bound``, or by the samples behind it ``unknown``,
``low``, ``medium``, ``high``. No platform call is made, no job, quota slot or idempotency record written.
"""

from __future__ import annotations

import math
import statistics
import time
from typing import Any

from gateway.ledger.flows import Stage
from gateway.ledger.jobspec import JobSpec, initial_cursor
from gateway.ledger.keys import Keys
from gateway.ledger.planner import cut_batches
from gateway.ledger.records import loads_or_none

PLAN_READ_S = 10.0  # longest a dry run reads its source
PLAN_MAX_BATCHES = 100_000
FLOW_JOBS_READ = 20  # recent jobs of the flow whose cost ledgers a dry run reads
DEFAULT_MAX_IN_FLIGHT = 8  # dispatch.DEFAULT_TARGET_LIMIT (the ledger does not import the push layer)
#: Sources whose item count is known without reading (JobSpec.total_hint): batches are counted, not cut.
COUNTED = ("inline", "sequence")


def count_batches(spec: JobSpec, inline: list | None, settings: Any) -> dict[str, Any]:
    """How many batches (and items) the job would cut, and how sure that is."""
    if spec.external:
        return {"batches": None, "items": None, "confidence": "unknown",
                "why": "an external source is fetched by the flow's first stage while the job runs"}
    batching = spec.flow.batching
    if spec.source["type"] in COUNTED and spec.total_hint is not None and batching.max_bytes is None:
        # the source tells its size: max_items per batch, and one (empty) batch for no items at all
        return {"batches": max(1, math.ceil(spec.total_hint / batching.max_items)), "items": spec.total_hint,
                "confidence": "exact", "why": "from the source's item count"}
    cursor = initial_cursor(spec.source, len(inline or ()))
    batches = items = 0
    stop = time.monotonic() + PLAN_READ_S
    while True:
        cut = cut_batches(spec, cursor, 1000, inline, settings)
        for end, last, _items, n in cut:
            batches += 1
            items += n
            if last == "1":
                return {"batches": batches, "items": items, "confidence": "exact"}
            cursor = loads_or_none(end)
        if not cut or batches >= PLAN_MAX_BATCHES or time.monotonic() > stop:
            break
    return {"batches": batches, "items": items, "confidence": "lower_bound",
            "why": f"the source was read for {PLAN_READ_S:g} s or {PLAN_MAX_BATCHES} batches; it has more"}


def latency_samples(r: Any, keys: Keys, target_id: str, tenant: str) -> list[float]:
    """The tenant's newest call times on the target, in seconds (dispatch.py _release_slot, _note_latency)."""
    out = []
    for entry in r.lrange(keys.target_latency(target_id, tenant), 0, -1):
        try:
            out.append(int(str(entry).split()[0]) / 1000)
        except (ValueError, IndexError):
            continue
    return out


def flow_costs(r: Any, keys: Keys, tenant: str, flow_id: str) -> dict[str, dict[str, float]]:
    """Per stage index: calls, call ms, tokens and price summed over the flow's recent jobs' cost ledgers."""
    entries = r.zrevrangebylex(keys.job_index(tenant, flow_id=flow_id), "+", "-", start=0, num=FLOW_JOBS_READ)
    pipe = r.pipeline(transaction=False)
    for entry in entries:
        pipe.hgetall(keys.job(entry.rpartition(":")[2]).cost)
    totals: dict[str, dict[str, float]] = {}
    for fields in pipe.execute() if entries else []:
        for name, value in fields.items():
            field, _, stage = name.partition(":")
            if stage and field in ("calls", "ms", "tokens", "price", "paid"):
                scope = totals.setdefault(stage, {})
                scope[field] = scope.get(field, 0.0) + float(value)
    return totals


def _sureness(n: int) -> str:
    return "unknown" if n == 0 else "low" if n < 10 else "medium" if n < 100 else "high"


def stage_plan(stage: Stage, batches: int | None, samples: list[float], past: dict[str, float],
               concurrency: int) -> dict[str, Any]:
    """One stage's calls, parallelism (the flow's ``concurrency`` and the target's ``max_in_flight``;
    the workers' threads are assumed enough), call time and cost, with how sure each is."""
    calls = 0 if stage.approval is not None else batches
    target = stage.target
    limit = target.get("max_in_flight", DEFAULT_MAX_IN_FLIGHT) if target else concurrency
    parallel = max(1, min(limit, concurrency))
    past_calls = int(past.get("calls", 0))
    if samples:
        call_s, seen, source = statistics.mean(samples), len(samples), "target_latency"
    elif past_calls:
        call_s, seen, source = past["ms"] / 1000 / past_calls, past_calls, "flow_cost_ledger"
    else:
        call_s, seen, source = None, 0, None
    plan: dict[str, Any] = {
        "stage": stage.name, "calls": calls, "parallel": parallel,
        "call_seconds": None if call_s is None else round(call_s, 3),
        "call_seconds_from": source, "call_seconds_samples": seen, "call_seconds_confidence": _sureness(seen),
        "seconds": (None if call_s is None or calls is None
                    else round(math.ceil(calls / parallel) * call_s, 3)),
    }
    if stage.approval is not None:
        plan.update(seconds=None, call_seconds_confidence="unknown", call_seconds_from="a person decides")
    per_call_tokens = past.get("tokens", 0) / past_calls if past_calls else None
    per_call_price = past.get("price", 0) / past_calls if past_calls and "price" in past else None
    plan["cost"] = {
        "tokens": None if per_call_tokens is None or calls is None else round(per_call_tokens * calls),
        "price": None if per_call_price is None or calls is None else round(per_call_price * calls, 6),
        "from_calls": past_calls, "confidence": _sureness(past_calls),
    }
    return plan


def plan(spec: JobSpec, inline: list | None, r: Any, keys: Keys, settings: Any,
         target_id: Any) -> dict[str, Any]:
    """The dry run's answer for ``spec`` (not recorded). ``target_id``: dispatch.target_id."""
    counted = count_batches(spec, inline, settings)
    batches = counted["batches"]
    past = flow_costs(r, keys, spec.tenant, spec.flow.id)
    stages = []
    for i, stage in enumerate(spec.flow.stages):
        samples = latency_samples(r, keys, target_id(stage.target), spec.tenant) if stage.target else []
        stages.append(stage_plan(stage, batches, samples, past.get(str(i), {}), spec.flow.concurrency))
    called = [s for i, s in enumerate(stages) if spec.flow.stages[i].approval is None]
    timed = [s for s in called if s["seconds"] is not None]
    # batches flow through the stages: the slowest stage sets the pace, the others add one call each
    # (a person's time at an approval stage is not counted)
    slowest = max(timed, key=lambda s: s["seconds"], default=None)
    seconds = None
    if slowest is not None and len(timed) == len(called):
        seconds = slowest["seconds"] + sum(s["call_seconds"] for s in timed if s is not slowest)
    sure = [s["call_seconds_confidence"] for s in called]
    tokens = [s["cost"]["tokens"] for s in stages if s["calls"]]
    prices = [s["cost"]["price"] for s in stages if s["calls"]]
    return {
        "dry_run": True,
        "flow": {"id": spec.flow.id, "version": spec.flow.version},
        "batches": batches, "items": counted["items"], "batches_confidence": counted["confidence"],
        **({"batches_why": counted["why"]} if "why" in counted else {}),
        "calls": {s["stage"]: s["calls"] for s in stages},
        "stages": stages,
        "duration_s": None if seconds is None else round(seconds, 1),
        "duration_confidence": "unknown" if seconds is None else min(sure, key=_RANK.index),
        "cost": {"tokens": sum(tokens) if tokens and None not in tokens else None,
                 "price": round(sum(prices), 6) if prices and None not in prices else None,
                 "confidence": min((s["cost"]["confidence"] for s in stages if s["calls"]),
                                   key=_RANK.index, default="unknown")},
    }


_RANK = ["unknown", "low", "medium", "high"]
