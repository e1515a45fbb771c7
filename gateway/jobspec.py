"""A job's frozen specification: the flow it runs (by content hash), its source and params."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any

import redis

import chunker
from gateway.flows import FlowSpec
from gateway.records import dumps, loads_or_none


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
        }

    @classmethod
    def from_fields(cls, fields: dict[str, str]) -> JobSpec:
        hint = fields.get("total_hint")
        return cls(
            job_id=fields["job_id"],
            tenant=fields["tenant"],
            flow=FlowSpec.model_validate(json.loads(fields["flow"])),
            flow_hash=fields["flow_hash"],
            source=json.loads(fields["source"]),
            params=json.loads(fields["params"]),
            total_hint=int(hint) if hint else None,
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
