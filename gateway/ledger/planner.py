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
from gateway.errors import InvalidRequest
from gateway.ledger.jobspec import FILE_TYPES, JobSpec, open_source
from gateway.ledger.records import dumps
from gateway.settings import Settings

#: Source types whose records are bounded by max_record_bytes (and so whose batches are bounded).
RECORD_TYPES = FILE_TYPES


def batch_bound(batching: Any, source: dict[str, Any] | None, settings: Settings) -> int | None:
    """Most bytes of items one batch of ``source`` can hold: the flow's ``max_bytes`` (plus the one
    record that may cross it) when set, else ``max_items`` records of the source's longest record (jsonl,
    csv). None where no bound is computed: inline items (bounded by the request body), sequences (small
    integers), external sources (read by the flow) and http_json pages (each capped by the reader)."""
    if not source or source.get("type") not in RECORD_TYPES:
        return None
    record = min(source.get("max_record_bytes", chunker.DEFAULT_MAX_RECORD_BYTES), settings.max_record_bytes)
    if batching.max_bytes is not None:
        return batching.max_bytes + record
    return batching.max_items * record


def check_batch_bound(batching: Any, source: dict[str, Any] | None, settings: Settings) -> None:
    """InvalidRequest (422, naming the fix) when one batch could hold more than ``max_batch_bytes``.

    Every batch a plan cuts, and the one the creation probe reads, is held in memory whole: 100,000 items
    of up to 1 MiB each would be 100 GiB in one gateway process.
    """
    limit = settings.max_batch_bytes
    if batching.max_bytes is not None:
        if batching.max_bytes > limit:
            raise InvalidRequest(
                f"batching.max_bytes is {batching.max_bytes}, over the server's limit of {limit} bytes per "
                "batch (BATCHGATE_MAX_BATCH_BYTES); set a smaller batching.max_bytes",
                field="batching.max_bytes", limit=limit)
        return
    bound = batch_bound(batching, source, settings)
    if bound is None or bound <= limit:
        return
    record = bound // batching.max_items
    raise InvalidRequest(
        f"one batch of this {source['type']} source could hold {batching.max_items} records of up to "
        f"{record} bytes ({bound} bytes), over the server's limit of {limit} bytes per batch "
        f"(BATCHGATE_MAX_BATCH_BYTES): set batching.max_bytes (at most {limit}), or lower "
        "batching.max_items or the source's max_record_bytes",
        field="batching.max_bytes", limit=limit, bound=bound)


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
    with ``covers(cursor, max_items)`` (a window of them) stops the read where it ends. Reading ahead
    stops once the batches cut hold ``settings.max_batch_bytes`` of items (a plan holds them all until
    plan.lua stores them).
    """
    max_items, max_bytes = spec.flow.batching.max_items, spec.flow.batching.max_bytes
    covers = getattr(inline, "covers", None)
    source = open_source(spec.source, inline_items=inline, settings=settings, tenant=spec.tenant)
    out: list[PlannedBatch] = []
    held = 0
    while len(out) < ahead:
        if out and covers is not None and not covers(cursor, max_items):
            break
        if held >= settings.max_batch_bytes:
            break
        try:
            batch = source.read_batch(cursor, max_items=max_items, max_bytes=max_bytes)
        except (chunker.SourceReadError, chunker.SourceSpecError):
            if not out:
                raise
            break
        if out and not batch.items:
            break
        items = dumps(batch.items)
        held += len(items)
        out.append((dumps(batch.end_cursor), "1" if batch.end_cursor is None else "0", items,
                    len(batch.items)))
        if batch.end_cursor is None:
            break
        cursor = batch.end_cursor
    return out
