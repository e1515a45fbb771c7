"""A job's frozen specification: the flow it runs (by content hash), its source and params."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import redis
import requests

import chunker
from gateway.errors import InvalidRequest, SourceUnavailable
from gateway.flows import FlowSpec
from gateway.records import dumps, loads_or_none

#: Connect and read timeout of each request the creation probe makes; well under a worker's timeout.
PROBE_TIMEOUT_S = 10.0
FILE_TYPES = ("jsonl", "csv")


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

    def to_fields(self) -> dict[str, str]:
        return {
            "job_id": self.job_id,
            "tenant": self.tenant,
            "flow": dumps(self.flow.model_dump(mode="json")),
            "flow_hash": self.flow_hash,
            "source": dumps(self.source),
            "params": dumps(self.params),
            "total_hint": "" if self.total_hint is None else str(self.total_hint),
            "total_bytes": "" if self.total_bytes is None else str(self.total_bytes),
        }

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


def probe_source(source: dict[str, Any], flow: FlowSpec) -> int | None:
    """Read the first batch of a validated source and drop it, so an unreadable source fails at creation.

    Reads at most one batch (``flow.batching``); inline, sequence and external sources are not read.
    Returns the size in bytes of a jsonl/csv source when known (a path's size, a URL's Content-Length),
    else None. Raises InvalidRequest if the source cannot be read (missing file, bad first rows, HTTP 4xx),
    SourceUnavailable (503, Retry-After) if it could not be reached right now (HTTP 429/5xx, connection
    refused, timeout): a 4xx would be replayed for the Idempotency-Key's lifetime, a 503 releases the key.
    """
    if source["type"] not in (*FILE_TYPES, "http_json"):
        return None
    lengths: list[int] = []

    def record_length(resp: requests.Response, *args: Any, **kwargs: Any) -> None:
        lengths.append(_body_length(resp))

    with requests.Session() as session:
        if source["type"] in FILE_TYPES:
            session.hooks["response"].append(record_length)
        try:
            reader = open_source(source, session=session, timeout_s=PROBE_TIMEOUT_S)
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
        try:
            return os.path.getsize(source["path"])
        except OSError:
            return None
    return next((n for n in lengths if n >= 0), None) if source["type"] in FILE_TYPES else None


def _body_length(resp: requests.Response) -> int:
    """Content-Length of a whole, unencoded 200 body (byte offsets count its bytes), else -1."""
    length = resp.headers.get("Content-Length", "")
    encoded = resp.headers.get("Content-Encoding", "identity").lower() != "identity"
    if resp.status_code != 200 or encoded or not length.isdigit():
        return -1
    return int(length)


def open_source(source: dict[str, Any], inline_items: Any = None, **kwargs: Any) -> chunker.Source:
    """Open a chunker source; inline items come from the ledger's list, not the spec."""
    if source["type"] == "inline":
        return chunker.open_source({"type": "inline", "items": []}, inline_items=inline_items, **kwargs)
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
        return [loads_or_none(v) for v in self._r.lrange(self._key, start, stop - 1)]
