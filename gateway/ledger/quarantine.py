"""Quarantined items: the listing and the retry (docs/design.md "Bisection").

Bisection (fail.lua) quarantines each item that fails on its own; the batch record keeps the item's
error and the batch's items stay stored while any is quarantined. A retry re-opens the committed batch
for those items only (qretry.lua, one script per batch).
"""

from __future__ import annotations

import json
import logging
from collections import defaultdict
from typing import Any

from gateway.errors import Conflict, CorruptRecord, InvalidRequest, NotFound
from gateway.ledger import bisect
from gateway.ledger.records import loads_or_none

log = logging.getLogger(__name__)

MAX_LISTED = 10_000  # quarantined items one listing returns (a job that quarantines more fails its budget)


def parse_ids(ids: list[str]) -> dict[int, list[int]]:
    """Item ids ``<seq>.<index>`` grouped by seq; InvalidRequest naming the first that is not one."""
    out: dict[int, list[int]] = defaultdict(list)
    for item_id in ids:
        seq, _, index = str(item_id).partition(".")
        if not (seq.isdigit() and index.isdigit()) or len(item_id) > 40:
            raise InvalidRequest(f"item id {str(item_id)[:40]!r} is not <seq>.<index>")
        out[int(seq)].append(int(index))
    return out


class QuarantineOps:
    """Mixed into Ledger: uses its ``r``, ``keys``, ``scripts``, ``settings``, ``spec()``,
    ``persist_job()`` and ``_ready_keys()`` (no import of the Ledger: it is made of this mixin)."""

    def quarantined(self, job_id: str, limit: int = MAX_LISTED) -> list[dict[str, Any]]:
        """The job's quarantined items, by batch and index: id, seq, index, item, stage, error."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        base = int(self.job_fields(job_id)["base_seq"])  # a resume by cursor leaves the old plan's behind
        members = self.r.zrangebyscore(k.quarantine, base, "+inf", start=0, num=limit)
        seqs = sorted({int(m.split(".")[0]) for m in members})
        pipe = self.r.pipeline(transaction=False)
        for seq in seqs:
            pipe.hgetall(k.batch(seq))
            pipe.get(k.items(seq))
        got = pipe.execute()
        names = [s.name for s in spec.flow.stages]
        out: list[dict[str, Any]] = []
        for n, seq in enumerate(seqs):
            batch, items = got[2 * n], loads_or_none(got[2 * n + 1])
            out.extend(bisect.entries(seq, batch, items if isinstance(items, list) else None, names))
        return out[:limit]

    def retry_quarantined(self, job_id: str, ids: list[str] | None, actor: str) -> dict[str, Any]:
        """Run quarantined items again (``ids`` as ``<seq>.<index>``; None = every one). Items of a batch
        still running are left (``busy``: retry them once it commits); ids not quarantined are ignored."""
        spec = self.spec(job_id)
        k = self.keys.job(job_id)
        if ids is None:
            base = int(self.job_fields(job_id)["base_seq"])
            wanted: dict[int, list[int] | None] = {int(m.split(".")[0]): None
                                                   for m in self.r.zrangebyscore(k.quarantine, base, "+inf")}
        else:
            wanted = dict(parse_ids(ids))
        retried, busy, status = 0, [], None
        for seq, indices in sorted(wanted.items()):
            res = self.scripts.qretry(
                keys=[k.job, k.batch(seq), k.quarantine, k.log, k.audit, *self._ready_keys(spec), k.sink,
                      k.sink_late, k.events],
                args=["" if indices is None else json.dumps(sorted(set(indices))), self.settings.log_maxlen,
                      actor, spec.stage_count])
            if res[0] == "ok":
                retried += int(res[1])
                status = res[3]
            elif res[0] == "busy":
                busy.append(seq)
            elif res[0] == "refused":
                raise Conflict(f"job {job_id} is {res[1]}; its quarantined items cannot run again",
                               job_status=res[1])
            elif res[0] == "corrupt":
                raise CorruptRecord(f"job {job_id} batch {seq} failed its checksum; it will not run")
            elif res[0] == "missing" and not self.r.exists(k.job):
                raise NotFound(f"job {job_id} not found")
        if retried:
            self.persist_job(job_id)  # a job that had ended runs again: no retention expiry, watched
            log.info("quarantined items retried job_id=%s items=%s actor=%s", job_id, retried, actor)
        return {"retried": retried, "busy_batches": busy, "job_status": status}
