"""A job's frozen specification: the flow it runs (by content hash), its source and params."""

from __future__ import annotations

import hashlib
import json
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis
import requests

import chunker
from chunker.localfiles import check_path, open_file
from gateway.errors import InvalidRequest, SourceUnavailable
from gateway.ledger.flows import FlowSpec
from gateway.ledger.records import dumps, loads_or_none
from gateway.net.outbound import session_for
from gateway.settings import Settings

#: Connect and read timeout of each request the creation probe makes; well under a worker's timeout.
PROBE_TIMEOUT_S = 10.0
FILE_TYPES = ("jsonl", "csv")


def idempotency_key(job_id: str, seq: int, stage: str) -> str:
    """The key of jobs recorded before range keys (``key_scheme`` "seq"): the same on every attempt."""
    return f"{job_id}:{seq}:{stage}"


@dataclass(frozen=True)
class JobSpec:
    """What a job runs; written once at creation and checksummed like every record."""

    job_id: str
    tenant: str
    flow: FlowSpec
    flow_hash: str
    source: dict[str, Any]
    params: dict[str, Any]
    total_hint: int | None
    total_bytes: int | None = None  # size of a jsonl/csv source when known at creation
    #: how stage idempotency keys are made: "range" (per item range, stable across re-plans) for jobs
    #: created since issue 15; "seq" (``<job>:<seq>:<stage>``) for jobs recorded before, so a batch in
    #: flight across the upgrade keeps the key its platform already saw
    key_scheme: str = "seq"
    #: how many times the job was moved to another flow version (migrate.lua); the job hash holds the
    #: same number, so a process holding an older spec sees it is old (Ledger.spec)
    spec_gen: int = 0
    prev_flow_hash: str | None = None  # the flow hash before the last migration
    prev_flow_version: str | None = None
    #: where committed outputs go (results.py): the job's own, else the flow's; None = kept in Redis
    sink: dict[str, Any] | None = None

    @property
    def stage_count(self) -> int:
        return len(self.flow.stages)

    @property
    def budget_total(self) -> int:
        """Batches the failure budget is measured against when the item count is known up front."""
        if not self.total_hint:
            return 0
        return math.ceil(self.total_hint / self.flow.batching.max_items)

    @property
    def external(self) -> bool:
        return self.source["type"] == "external"

    def stage_index(self, name: str) -> int | None:
        """Index of the stage called ``name``, or None."""
        for i, stage in enumerate(self.flow.stages):
            if stage.name == name:
                return i
        return None

    def stage_key(self, seq: int, stage: str, cursor: Any, end_cursor: Any, suffix: str = "") -> str:
        """The idempotency key of one batch stage: the same on every attempt and, for the same item
        range (start and end cursor), across re-plans (a rewind), so a store flow that deduplicates by it
        never stores an item range twice. The rewind's ``generation`` travels beside it. ``suffix``
        names a piece of the batch (bisect.key_suffix), so a piece's key is stable per item range too."""
        if self.key_scheme != "range":
            return idempotency_key(self.job_id, seq, stage) + suffix
        digest = hashlib.sha256(dumps([cursor, end_cursor]).encode()).hexdigest()[:24]
        return f"{self.job_id}:{stage}:r{digest}{suffix}"

    def to_fields(self) -> dict[str, str]:
        return {
            "job_id": self.job_id,
            "tenant": self.tenant,
            # defaults left out (a third of the size or less): FlowSpec fills them in again on reading,
            # and a spec written whole (before) reads the same
            "flow": dumps(self.flow.model_dump(mode="json", exclude_defaults=True)),
            "flow_hash": self.flow_hash,
            "source": dumps(self.source),
            "params": dumps(self.params),
            "total_hint": "" if self.total_hint is None else str(self.total_hint),
            "total_bytes": "" if self.total_bytes is None else str(self.total_bytes),
            "key_scheme": self.key_scheme,
        } | ({"spec_gen": str(self.spec_gen), "prev_flow_hash": self.prev_flow_hash or "",
              "prev_flow_version": self.prev_flow_version or ""} if self.spec_gen else {}) \
            | ({"sink": dumps(self.sink)} if self.sink else {})

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> JobSpec:
        hint, size = fields.get("total_hint"), fields.get("total_bytes")
        return cls(
            job_id=fields["job_id"],
            tenant=fields["tenant"],
            flow=FlowSpec.model_validate(json.loads(fields["flow"])),
            flow_hash=fields["flow_hash"],
            source=json.loads(fields["source"]),
            params=json.loads(fields["params"]),
            total_hint=int(hint) if hint else None,
            total_bytes=int(size) if size else None,  # absent in records written before it existed
            key_scheme=fields.get("key_scheme") or "seq",  # likewise
            spec_gen=int(fields.get("spec_gen") or 0),  # set by a migration only
            prev_flow_hash=fields.get("prev_flow_hash") or None,
            prev_flow_version=fields.get("prev_flow_version") or None,
            sink=json.loads(fields["sink"]) if fields.get("sink") else None,  # only jobs with a sink
        )


def initial_cursor(source: dict[str, Any], inline_count: int | None = None) -> Any:
    """The cursor the first batch starts at, without reading the source."""
    if source["type"] == "external":
        return source.get("start")
    return open_source(source, inline_items=range(inline_count or 0)).initial_cursor()


def total_hint(source: dict[str, Any], inline_count: int | None) -> int | None:
    """Number of items if known without reading (inline, sequence)."""
    if source["type"] == "inline":
        return inline_count
    if source["type"] == "external":
        return None
    return open_source(source, inline_items=None).total_hint


def file_access(settings: Settings | None, tenant: str | None) -> chunker.FileAccess:
    """The local files a tenant's jsonl/csv paths may read: under its own and the shared ("*") roots of
    BATCHGATE_SOURCE_ROOTS, never under the data directory (signing key, tokens, Redis files), never
    /proc, /dev, /sys (chunker.localfiles). Without settings file paths are off."""
    if settings is None:
        return chunker.FileAccess(roots=())
    roots = settings.source_roots
    allowed = (*roots.get(tenant, ()), *roots.get("*", ())) if tenant is not None else ()
    return chunker.FileAccess(roots=tuple(allowed), deny=(str(settings.data_dir),),
                              max_record_bytes=settings.max_record_bytes)


def check_source_access(source: dict[str, Any] | None, settings: Settings | None, tenant: str | None) -> None:
    """422 (naming the rule, never a file's content) for a jsonl/csv source the tenant may not read.

    Checks what needs no file: file sources on, an absolute path resolving inside the tenant's roots and
    outside /proc, /dev, /sys and the data directory, max_record_bytes within the server's cap. Used when
    a flow is registered and when a job is created; every read checks again (open_file).
    """
    if not source or source.get("type") not in FILE_TYPES:
        return
    cap = settings.max_record_bytes if settings is not None else chunker.DEFAULT_MAX_RECORD_BYTES
    wanted = source.get("max_record_bytes")
    if isinstance(wanted, int) and wanted > cap:
        raise InvalidRequest(f"source field 'max_record_bytes' is {wanted}, over the server's cap of {cap} "
                             "bytes (BATCHGATE_MAX_RECORD_BYTES)")
    if "path" not in source:
        return
    access = file_access(settings, tenant)
    if not access.roots:
        if settings is not None and settings.source_roots:
            raise InvalidRequest(f"file sources are off for tenant {tenant}: BATCHGATE_SOURCE_ROOTS lists "
                                 'no directory for it or for "*"')
        raise InvalidRequest("file sources are off: set BATCHGATE_SOURCE_ROOTS to the directories jsonl/csv "
                             "paths may read")
    try:
        check_path(source["path"], access)
    except chunker.FileAccessError as exc:
        raise InvalidRequest(f"source: {exc}") from exc


def probe_source(source: dict[str, Any], flow: FlowSpec, settings: Settings | None = None,
                 tenant: str | None = None) -> int | None:
    """Read the first batch of a validated source and drop it, so an unreadable source fails at creation.

    Reads at most one batch (``flow.batching``); inline, sequence and external sources are not read.
    Returns the size in bytes of a jsonl/csv source when known (a path's size, a URL's Content-Length),
    else None. Raises InvalidRequest if the source cannot be read (missing file, bad first rows, HTTP 4xx),
    SourceUnavailable (503, Retry-After) if it could not be reached right now (HTTP 429/5xx, connection
    refused, timeout): a 4xx would be replayed for the Idempotency-Key's lifetime, a 503 releases the key.
    A path must be one the tenant may read (check_source_access, file_access; without settings: none).
    """
    if source["type"] not in (*FILE_TYPES, "http_json"):
        return None
    check_source_access(source, settings, tenant)
    timeout_s = PROBE_TIMEOUT_S
    if settings is not None:
        timeout_s = min(timeout_s, settings.source_read_timeout.total_seconds())
    lengths: list[int] = []

    def record_length(resp: requests.Response, *args: Any, **kwargs: Any) -> None:
        lengths.append(_body_length(resp))

    with session_for(settings) as session:  # the outbound guard, as every later read (open_source)
        if source["type"] in FILE_TYPES:
            session.hooks["response"].append(record_length)
        try:
            reader = open_source(source, session=session, timeout_s=timeout_s, settings=settings,
                                 tenant=tenant)
            reader.read_batch(reader.initial_cursor(), max_items=flow.batching.max_items,
                              max_bytes=flow.batching.max_bytes)
        except chunker.SourceReadError as exc:
            if exc.retryable:
                raise SourceUnavailable(
                    f"the source could not be reached: {exc}; no job was created, try again later",
                    retry_after=timedelta(seconds=exc.retry_after_s or 5)) from exc
            raise InvalidRequest(f"the source cannot be read: {exc}") from exc
        except chunker.SourceSpecError as exc:
            raise InvalidRequest(f"source: {exc}") from exc
    if "path" in source:
        try:  # through the same checks as the read: never the size of a file the tenant may not read
            fd, st = open_file(source["path"], file_access(settings, tenant))
            os.close(fd)
            return st.st_size
        except (chunker.ChunkerError, OSError):
            return None
    return next((n for n in lengths if n >= 0), None) if source["type"] in FILE_TYPES else None


def _body_length(resp: requests.Response) -> int:
    """Content-Length of a whole, unencoded 200 body (byte offsets count its bytes), else -1."""
    length = resp.headers.get("Content-Length", "")
    encoded = resp.headers.get("Content-Encoding", "identity").lower() != "identity"
    if resp.status_code != 200 or encoded or not length.isdigit():
        return -1
    return int(length)


def open_source(source: dict[str, Any], inline_items: Any = None, *, settings: Settings | None = None,
                tenant: str | None = None, **kwargs: Any) -> chunker.Source:
    """Open a chunker source; inline items come from the ledger's list, not the spec.

    jsonl/csv paths read only what ``tenant`` may read under ``settings`` (file_access; without
    settings, no path at all); URL reads time out after ``settings.source_read_timeout`` without a byte.
    URL sources read through a guarded session (gateway.net.outbound): public addresses only unless
    ``settings.outbound_allow`` admits them (without settings: none), every redirect hop checked.
    """
    if source["type"] == "inline":
        return chunker.open_source({"type": "inline", "items": []}, inline_items=inline_items, **kwargs)
    if settings is not None:
        kwargs.setdefault("timeout_s", settings.source_read_timeout.total_seconds())
    if source["type"] in FILE_TYPES:
        kwargs.setdefault("file_access", file_access(settings, tenant))
    if source.get("url") and kwargs.get("session") is None:  # every URL read passes the outbound guard
        kwargs["session"] = session_for(settings)
    return chunker.open_source(source, **kwargs)


class RedisListView:
    """A lazy, sliceable view of a Redis list of JSON values (inline sources)."""

    def __init__(self, client: redis.Redis, key: str) -> None:
        self._r = client
        self._key = key
        self._len: int | None = None

    def __len__(self) -> int:
        if self._len is None:
            self._len = self._r.llen(self._key)
        return self._len

    def __getitem__(self, index: slice) -> list[Any]:
        if not isinstance(index, slice):
            raise TypeError("RedisListView supports slices only")
        start, stop, _ = index.indices(len(self))
        if stop <= start:
            return []
        return self._read(start, stop)

    def _read(self, start: int, stop: int) -> list[Any]:
        """Items ``start`` to ``stop`` (exclusive, within the list), decoded."""
        return [loads_or_none(v) for v in self._r.lrange(self._key, start, stop - 1)]
