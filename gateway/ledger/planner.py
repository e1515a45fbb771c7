"""Planning: read a job's source from a cursor and cut the next batches. Never touches Redis.

The ledger asks at one seam, when lease.lua says batches must be planned (Ledger._plan): how many batches
one plan cuts (:func:`batches_per_plan`) and the batches themselves (:func:`cut_batches`). It hands over
the job's spec, the frontier cursor and, for inline items, a sequence view of them (the ledger reads that
from Redis); the planner reads through chunker (files, URLs through the outbound guard, paged APIs) and
answers plan.lua's quadruples. Recording the batches, leasing the first and failing the job when its
source cannot be read are the ledger's (plan.lua, source_fail.lua). pyproject.toml's import contracts
keep this module free of redis.
"""

from __future__ import annotations

from typing import Any

import chunker
from gateway.ledger.jobspec import FILE_TYPES, JobSpec, open_source
from gateway.ledger.records import dumps
from gateway.settings import Settings

PlannedBatch = tuple[str, str, str, int]
"""What plan.lua records per batch: (end cursor JSON, "1" when the source ends there else "0", items JSON,
item count)."""


def batches_per_plan(spec: JobSpec, plan_ahead: int) -> int:
    """How many batches one plan cuts: ``plan_ahead`` where reading ahead is cheap (inline items, a
    sequence, a local file), one where every read is a request (URLs, paged APIs) or where the first
    stage fetches the items itself."""
    src = spec.source
    if src["type"] in ("inline", "sequence") or (src["type"] in FILE_TYPES and not src.get("url")):
        return max(1, plan_ahead)
    return 1


def cut_batches(spec: JobSpec, cursor: Any, ahead: int, inline: Any,
                settings: Settings) -> list[PlannedBatch]:
    """Up to ``ahead`` consecutive batches from ``cursor``.

    Raises chunker.SourceReadError or SourceSpecError when the first read fails. A failure after the
    first batch only ends the read: the batches before it are planned, and the failure is met (and
    counted) by the plan that starts there. ``inline``: the job's inline items as a sequence view; one
    with ``covers(cursor, max_items)`` (a window of them) stops the read where it ends.
    """
    max_items, max_bytes = spec.flow.batching.max_items, spec.flow.batching.max_bytes
    covers = getattr(inline, "covers", None)
    source = open_source(spec.source, inline_items=inline, settings=settings, tenant=spec.tenant)
    out: list[PlannedBatch] = []
    while len(out) < ahead:
        if out and covers is not None and not covers(cursor, max_items):
            break
        try:
            batch = source.read_batch(cursor, max_items=max_items, max_bytes=max_bytes)
        except (chunker.SourceReadError, chunker.SourceSpecError):
            if not out:
                raise
            break
        if out and not batch.items:
            break
        out.append((dumps(batch.end_cursor), "1" if batch.end_cursor is None else "0",
                    dumps(batch.items), len(batch.items)))
        if batch.end_cursor is None:
            break
        cursor = batch.end_cursor
    return out
