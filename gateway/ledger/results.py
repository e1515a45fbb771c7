"""Committed results leaving Redis: the result sink a flow or job declares, the delivery cursor, and
the range summaries delivered batch records are compacted to (compact.lua).

A sink is ``{"type": "jsonl" | "csv", "path": "/abs/file"}`` (a file under ``BATCHGATE_SINK_ROOTS``),
``{"type": "http", "url": "https://..."}`` (POSTs through the outbound guard), ``{"type": "s3", "bucket":
"results", "prefix": "screening/"}`` (JSONL objects ``<prefix><job_id>/<first seq>.jsonl`` in a bucket
``BATCHGATE_SINK_S3_BUCKETS`` lets the tenant write; the s3 extra, boto3) or ``{"type": "discard"}``
(the stages store their results themselves: nothing is written, records still compact). Delivery itself
is gateway/push/sinks.py; this module is the ledger's side: what is due, recording it, and reading a
job's batches once some of them are summaries. docs/design.md "Result sinks and compaction".
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

import chunker
from chunker.localfiles import check_path
from gateway.errors import InvalidRequest
from gateway.ledger.keys import JobKeys
from gateway.net.urlguard import Allowlist, UnsafeURL, check_url_shape
from gateway.settings import Settings

FILE_SINKS = ("jsonl", "csv")


class SinkSpec(BaseModel):
    """A result sink as a flow or job declares it (public JSON: ``sink``)."""

    model_config = ConfigDict(extra="forbid")

    type: Literal["jsonl", "csv", "http", "s3", "discard"]
    path: str | None = Field(default=None, max_length=4096, description="jsonl/csv: an absolute path")
    url: str | None = Field(default=None, max_length=2048, description="http: where batches are POSTed")
    bucket: str | None = Field(default=None, max_length=63, description="s3: the bucket")
    prefix: str | None = Field(default=None, max_length=512,
                               description="s3: objects are <prefix><job_id>/<seq>.jsonl")


# S3's bucket naming rules (lowercase letters, digits, dots, hyphens; 3-63; no IP-like names): a name
# that passes cannot change the host or path of a virtual-hosted or path-style request.
BUCKET = re.compile(r"^(?!\d+\.\d+\.\d+\.\d+$)(?!xn--)[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


JOB_ID = "{job_id}"  # in a file sink's path: the job's id (every job of a flow writes its own file)


def parse_sink(raw: Any, in_flow: bool = False) -> dict[str, Any] | None:
    """The sink as stored (JSON-ready, fields not given left out), or 422 when it is malformed. A file
    sink a flow declares must name its path with ``{job_id}``: a file has one writer (one job)."""
    if raw is None:
        return None
    try:
        sink = SinkSpec.model_validate(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        raise InvalidRequest(f"sink{'.' + where if where else ''}: {first['msg']}") from None
    if sink.type in FILE_SINKS and not sink.path:
        raise InvalidRequest(f"sink: a {sink.type} sink needs a path")
    if sink.type == "http" and not (sink.url or "").startswith(("http://", "https://")):
        raise InvalidRequest("sink: an http sink needs an http(s) url")
    if sink.type not in FILE_SINKS and sink.path or sink.type != "http" and sink.url:
        raise InvalidRequest(f"sink: a {sink.type} sink takes no {'path' if sink.path else 'url'}")
    if sink.type != "s3" and (sink.bucket is not None or sink.prefix is not None):
        raise InvalidRequest(f"sink: a {sink.type} sink takes no {'bucket' if sink.bucket else 'prefix'}")
    if sink.type == "s3":
        if not sink.bucket or not BUCKET.match(sink.bucket) or ".." in sink.bucket:
            raise InvalidRequest("sink.bucket: an s3 sink needs a bucket name (3-63 lowercase letters, "
                                 "digits, dots and hyphens)")
        if sink.prefix is not None and (sink.prefix.startswith("/") or any(
                ord(c) < 32 or c == "\x7f" for c in sink.prefix) or "../" in sink.prefix + "/"):
            raise InvalidRequest("sink.prefix: an object key prefix may not start with '/', hold '..' "
                                 "segments or control characters")
    if in_flow and sink.type in FILE_SINKS and JOB_ID not in (sink.path or ""):
        raise InvalidRequest(f"sink.path: a flow's {sink.type} sink is written by each of its jobs, so its "
                             f"path must hold {JOB_ID} (each job writes its own file)")
    return sink.model_dump(exclude_none=True)


def job_sink(sink: dict[str, Any] | None, job_id: str) -> dict[str, Any] | None:
    """The sink a job records: ``{job_id}`` in a file sink's path replaced by the job's id."""
    if sink is None or "path" not in sink:
        return sink
    return {**sink, "path": sink["path"].replace(JOB_ID, job_id)}


def create_sink_file(sink: dict[str, Any] | None, settings: Settings | None, tenant: str) -> None:
    """Create a job's sink file (empty, 0640) at job creation, refusing one that exists: a file sink is
    written by one job only, since each delivery cuts the file back to what its job recorded. 422 for a
    path the tenant may not write (check_sink) or that exists."""
    path = check_sink(sink, settings, tenant)
    if path is None:
        return
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640))
    except FileExistsError:
        raise InvalidRequest(f"sink.path {sink['path']!r} exists: a file sink is written by one job only; "
                             f"name a new file (a path with {JOB_ID} names one per job)") from None
    except OSError as exc:
        raise InvalidRequest(f"sink.path {sink['path']!r} cannot be created: {exc.strerror}") from None


def sink_access(settings: Settings | None, tenant: str) -> chunker.FileAccess:
    """Where a tenant's file sinks may write: its own and the shared ("*") BATCHGATE_SINK_ROOTS, never the
    data directory (signing key, tokens, Redis files) nor /proc, /dev, /sys."""
    roots = settings.sink_roots if settings is not None else {}
    allowed = (*roots.get(tenant, ()), *roots.get("*", ()))
    deny = (str(settings.data_dir),) if settings is not None else ()
    return chunker.FileAccess(roots=tuple(allowed), deny=deny)


def check_sink(sink: dict[str, Any] | None, settings: Settings | None, tenant: str) -> str | None:
    """422 for a file sink the tenant may not write (the rule and the path as given, never the resolved
    path); returns the resolved path of a file sink. Checked at creation and again at every delivery."""
    if sink is None or sink["type"] not in FILE_SINKS:
        return None
    access = sink_access(settings, tenant)
    if not access.roots:
        raise InvalidRequest("file sinks are off: set BATCHGATE_SINK_ROOTS to the directories jsonl/csv "
                             f"sinks may write (none for tenant {tenant})")
    try:
        return check_path(sink["path"], access)
    except chunker.FileAccessError as exc:
        raise InvalidRequest(f"sink: {str(exc).replace('source roots', 'sink roots')}") from exc


def s3_object_key(sink: dict[str, Any], job_id: str, name: str) -> str:
    """The object an s3 sink's delivery writes: one per chunk, named by the seq it starts at (12 digits),
    so a delivery that runs again from the same cursor (the last one died before it was recorded)
    replaces the object rather than adding another; an amendment's is ``<seq>.r<retry>``."""
    return f"{sink.get('prefix', '')}{job_id}/{name}.jsonl"


def check_sink_s3(sink: dict[str, Any] | None, settings: Settings | None, tenant: str) -> None:
    """422 for an s3 sink the tenant may not write: BATCHGATE_SINK_S3_BUCKETS names, by tenant ("*": every
    tenant), the buckets ("results") or bucket prefixes ("results/acme/") its sinks may write; or for
    an s3 sink where boto3 (the s3 extra) is not installed. Checked at creation and at every delivery."""
    if sink is None or sink["type"] != "s3":
        return
    try:
        import boto3  # noqa: F401 - only whether it is there
    except ImportError:
        raise InvalidRequest("s3 sinks need the s3 extra: pip install 'batchgate[s3]' (boto3)") from None
    grants = settings.sink_s3_buckets if settings is not None else {}
    allowed = (*grants.get(tenant, ()), *grants.get("*", ()))
    if not allowed:
        raise InvalidRequest(f"s3 sinks are off: set BATCHGATE_SINK_S3_BUCKETS to the buckets s3 sinks may "
                             f"write (none for tenant {tenant})")
    for grant in allowed:
        bucket, _, prefix = grant.partition("/")
        if bucket == sink["bucket"] and sink.get("prefix", "").startswith(prefix):
            return
    raise InvalidRequest(f"sink: bucket {sink['bucket']!r} with prefix {sink.get('prefix', '')!r} is not one "
                         f"tenant {tenant} may write (BATCHGATE_SINK_S3_BUCKETS)")


def check_sink_url(url: str, settings: Settings | None) -> None:
    """422 for an http sink the URL itself shows to be refused (the guarded session checks each call)."""
    allow = Allowlist.parse(settings.outbound_allow) if settings is not None else Allowlist()
    try:
        check_url_shape(url, allow)
    except UnsafeURL as exc:
        raise InvalidRequest(f"sink.url: {exc}") from None


@dataclass(frozen=True)
class SinkState:
    """Where a job's delivery stands: every seq below ``seq`` is delivered, in ``offset`` file bytes."""

    seq: int
    offset: int
    batches: int
    items: int
    error: str | None
    error_ms: int | None
    late: int = 0  # delivered batches whose retried items are owed an amendment (amend.lua)
    amended: int = 0  # amendments delivered

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> SinkState:
        return cls(seq=int(fields.get("seq") or 0), offset=int(fields.get("off") or 0),
                   batches=int(fields.get("batches") or 0), items=int(fields.get("items") or 0),
                   error=fields.get("error") or None, error_ms=int(fields.get("error_ms") or 0) or None,
                   late=int(fields.get("late") or 0), amended=int(fields.get("amended") or 0))

    def view(self, sink: dict[str, Any], wm: int) -> dict[str, Any]:
        """The job view's ``sink`` block (never the URL's query or a path outside what was given)."""
        return {"type": sink["type"], "delivered_below_seq": self.seq, "batches_delivered": self.batches,
                "items_delivered": self.items, "behind": max(wm - self.seq, 0),
                "amendments_owed": self.late, "amendments_delivered": self.amended, "error": self.error,
                "error_ms": self.error_ms}


def compact_keys(k: JobKeys, first: int, stop: int) -> list[str]:
    """KEYS of compact.lua for delivering seqs ``first`` .. ``stop``-1."""
    seqs = range(first, stop)
    return [k.job, k.sink, *[k.batch(s) for s in seqs], *[k.items(s) for s in seqs]]


def summary_rows(sink: dict[str, str]) -> list[dict[str, Any]]:
    """The range summaries in a job's sink hash (compact.lua's ``r:<first>`` fields), in seq order."""
    return sorted((json.loads(v) for f, v in sink.items() if f.startswith("r:")), key=lambda r: r["first"])


def range_view(summary: dict[str, Any]) -> dict[str, Any]:
    """A compacted range as the batch listing shows it: one row standing for seqs first..last, under
    ``seq`` = last, so a client paging with ``after`` = the last row's seq goes on past it."""
    status = "completed" if summary["batches"] else "superseded"
    return {"seq": summary["last"], "first_seq": summary["first"], "last_seq": summary["last"],
            "status": status, "compacted": True, "generation": int(summary["gen"]), "stage": None,
            "attempt": 0, "attempts_spent": 0, "error": None, "error_type": None,
            "cursor": summary["cursor"], "end_cursor": summary["end_cursor"], "items": summary["items"],
            "batches_completed": summary["batches"], "batches_superseded": summary["superseded"]}


def compacted_batch_view(summary: dict[str, Any], seq: int) -> dict[str, Any]:
    """One batch of a compacted range: its outputs went to the sink; the range stands for it (its own
    cursors and outputs are no longer in Redis: the sink's record ``<job_id>.<seq>`` holds them)."""
    status = ("completed" if not summary["superseded"] else "superseded" if not summary["batches"]
              else "compacted")  # a range that holds both: which this seq was is not kept
    return {"seq": seq, "status": status, "compacted": True, "range": range_view(summary),
            "stage": None, "attempt": 0, "attempts_spent": 0, "cursor": None, "end_cursor": None,
            "items": None, "error": None, "error_type": None, "stages": {}, "progress": None,
            "lease_deadline_ms": None}
