"""Progress of file jobs by bytes: jsonl/csv cursors carry the byte offset of the next record."""

from __future__ import annotations

from typing import Any

from gateway.ledger.jobspec import FILE_TYPES, JobSpec
from gateway.ledger.records import loads_or_none


def bytes_done(spec: JobSpec, committed_cursor: Any) -> int | None:
    """Bytes of a jsonl/csv source behind the committed cursor; None for other sources, or no byte."""
    if spec.source["type"] not in FILE_TYPES:
        return None
    if committed_cursor is None:  # the final batch is committed: the whole file is done
        return spec.total_bytes
    byte = committed_cursor.get("byte") if isinstance(committed_cursor, dict) else None
    return byte if isinstance(byte, int) and not isinstance(byte, bool) else None


def progress_of(spec: JobSpec, job: dict[str, str]) -> dict[str, Any]:
    """``bytes_done`` and ``bytes_total`` of a job; ``progress`` (0..1) and ``eta_s`` from bytes when
    the item count is unknown but the source's size is (files), to merge over the item-based view."""
    done, total = bytes_done(spec, loads_or_none(job["committed_cursor"])), spec.total_bytes
    frontier = loads_or_none(job.get("frontier") or "null")
    read = (total if job.get("exhausted") == "1" else bytes_done(spec, frontier)) if done is not None else None
    # bytes_read: how far batches were cut (the planner's frontier); with items_planned and items_done it
    # tells progress while the committed cursor waits on one slow batch (the CLI's bar uses it)
    out: dict[str, Any] = {"bytes_done": done, "bytes_total": total, "bytes_read": read}
    if spec.total_hint or not total or done is None:
        return out
    elapsed_s = max((int(job["updated_ms"]) - int(job["created_ms"])) / 1000, 1e-3)
    rate = done / elapsed_s
    out["progress"] = round(min(done / total, 1.0), 4)
    out["eta_s"] = round(max(total - done, 0) / rate, 1) if rate else None
    return out
