"""Result sinks: committed outputs leave Redis for the sink a flow or job declares, then compact.

A supervisor thread (``SinkDeliverer.run``) follows the jobs in ``sink:jobs``. For each, it delivers the
batches below the job's watermark from the sink cursor on, in seq order, a chunk at a time, and records
each chunk with compact.lua, which moves the cursor (compare-and-set) and folds the delivered batch
records into range summaries in the same step. docs/design.md "Result sinks and compaction".

Exactly once in a file. A jsonl/csv sink is written under an exclusive ``flock`` on the file, and the
cursor is read again under it: the file is first truncated to the offset recorded with the cursor,
then the chunk's lines are appended and fsynced, then compact.lua records the new offset. A process
killed anywhere in between leaves lines past the recorded offset, which the next delivery cuts off
before it writes them again; a Redis that restarts and forgets the last record has forgotten the
offset too. So the final file holds every delivered batch once. The claim (``sinkclaim``, SET NX PX)
keeps one deliverer per job in the normal case; correctness rests on the lock and the compare-and-set.

Exactly once in an S3 bucket. A chunk is one JSONL object named by the seq it starts at
(``<prefix><job_id>/<first seq>.jsonl``); the cursor moves only after the PUT succeeded. A delivery that
runs again from the same cursor (the last one died between its PUT and its record) writes the same
object again, with the chunk as it is now, and deletes it when the chunk holds no completed batch; so
the objects hold every delivered batch once. The claim keeps two deliverers from writing one job's
chunk at the same time as long as a PUT takes less than the claim (30 s; the client's timeouts are
``sink_timeout`` and it does not retry on its own); records carry stable ids for the rare rest.

At least once over HTTP. A chunk is POSTed as ``{"job_id", "records": [...]}``; each record's ``id``
(``<job_id>.<seq>``) is stable across retries, so a receiver deduplicates by it. The cursor moves only
after a 2xx; a refusal, a timeout or a dead process sends the same chunk again later (backing off).
"""

from __future__ import annotations

import contextlib
import csv
import fcntl
import io
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import requests

from gateway.errors import BatchgateError, NotFound
from gateway.ledger import archive, bisect
from gateway.ledger.embedded import REDIS_DOWN
from gateway.ledger.jobspec import JobSpec
from gateway.ledger.ledger import Ledger
from gateway.ledger.records import dumps, loads_or_none
from gateway.ledger.results import (
    FILE_SINKS,
    SinkState,
    check_sink,
    check_sink_s3,
    compact_keys,
    s3_object_key,
)
from gateway.net.outbound import session_for

log = logging.getLogger(__name__)

CLAIM_MS = 30_000  # one deliverer per job; a dead one's claim expires
AMEND_PAGE = 100  # amendments looked at per job and pass
BACKOFF_S = (1.0, 60.0)  # a failing sink is tried again after 1 s, doubling up to 60 s
AT_REST = ("succeeded", "failed", "cancelled")


class SinkFailed(BatchgateError):
    """A sink refused or could not take a chunk; it is sent again later."""


class SinkDeliverer:
    """Delivers committed outputs to each job's sink and compacts what was delivered."""

    def __init__(self, ledger: Ledger, name: str | None = None,
                 session: requests.Session | None = None) -> None:
        self.ledger = ledger
        self.r = ledger.r
        self.settings = ledger.settings
        self.name = name or f"sinks@{socket.gethostname()}:{os.getpid()}"
        self.session = session or session_for(self.settings)
        self.stop = threading.Event()
        self._s3: Any = None  # the boto3 client, made on the first s3 delivery
        self._retry_at: dict[str, tuple[float, float]] = {}  # job id -> (monotonic time, last delay)

    def run(self) -> None:
        """Deliver every ``supervisor_interval`` until ``stop`` is set; Redis being down is waited out."""
        interval = self.settings.supervisor_interval.total_seconds()
        while not self.stop.is_set():
            try:
                self.run_once()
            except REDIS_DOWN:
                log.warning("sinks: Redis unavailable; delivering again later")
            except Exception:  # noqa: BLE001 - one bad job must not stop every job's delivery
                log.exception("sinks: a pass failed; trying again")
            self.stop.wait(interval)

    def run_once(self) -> int:
        """One pass over the jobs with a sink; returns the batches delivered."""
        delivered = 0
        for job_id in self._due(sorted(self.r.smembers(self.ledger.keys.sink_jobs))):
            if self.stop.is_set():
                break
            retry = self._retry_at.get(job_id)
            if retry and time.monotonic() < retry[0]:
                continue
            delivered += self.deliver_job(job_id)
        return delivered

    def _due(self, job_ids: list[str], page: int = 500) -> Iterator[str]:
        """The jobs with something to do: batches below the watermark not delivered yet, or at rest (to
        retire). Read in pipelines of ``page`` jobs, so a pass over idle jobs costs a round trip per
        page rather than several per job."""
        for start in range(0, len(job_ids), page):
            ids = job_ids[start:start + page]
            pipe = self.r.pipeline(transaction=False)
            for job_id in ids:
                k = self.ledger.keys.job(job_id)
                pipe.hmget(k.sink, "seq", "late")
                pipe.hmget(k.job, "wm", "status")
            got = pipe.execute()
            for i, job_id in enumerate(ids):
                (seq, late), (wm, status) = got[2 * i], got[2 * i + 1]
                if wm is None or int(wm) > int(seq or 0) or int(late or 0) > 0 or status in AT_REST:
                    yield job_id

    def deliver_job(self, job_id: str) -> int:
        """Deliver what is due for one job (if this process may claim it); returns batches delivered."""
        try:
            spec = self.ledger.spec(job_id)
        except NotFound:  # expired by retention
            self.r.srem(self.ledger.keys.sink_jobs, job_id)
            return 0
        if not spec.sink:
            self.r.srem(self.ledger.keys.sink_jobs, job_id)
            return 0
        k = self.ledger.keys.job(job_id)
        if not self.r.set(k.sink_claim, self.name, nx=True, px=CLAIM_MS) \
                and self.r.get(k.sink_claim) != self.name:
            return 0
        total = 0
        try:
            # amendments first: a job at rest retires in the chunk loop once it owes none
            total += self._deliver_amendments(spec)
            while not self.stop.is_set():
                n = self._deliver_chunk(spec)
                if n is None:
                    break
                total += n
                self.r.pexpire(k.sink_claim, CLAIM_MS)
            self._retry_at.pop(job_id, None)
        except (SinkFailed, OSError, requests.RequestException, BatchgateError) as exc:
            self._failed(spec, exc)
        finally:
            if self.r.get(k.sink_claim) == self.name:
                self.r.delete(k.sink_claim)
        return total

    def _deliver_chunk(self, spec: JobSpec) -> int | None:
        """Deliver and record one chunk; the batches delivered, or None when nothing is due."""
        k = self.ledger.keys.job(spec.job_id)
        with self._exclusive(spec) as fd:
            state = SinkState.from_fields(self.r.hgetall(k.sink))  # read under the file's lock
            job = self.r.hmget(k.job, "wm", "status")
            wm, status = int(job[0] or 0), job[1]
            stop = min(wm, state.seq + self.settings.sink_chunk)
            if stop <= state.seq:
                self._maybe_retire(spec, status, state.seq, wm)
                return None
            fields = self._batches(spec, state.seq, stop)
            stop = state.seq + self._settled(fields)
            if stop <= state.seq:
                return None  # committed too recently: its repeated answers are still answered
            records = self._records(spec, state.seq, fields[:stop - state.seq])
            offset = self._write(spec, fd, state, records)
            res = self.ledger.scripts.compact(keys=compact_keys(k, state.seq, stop),
                                              args=[state.seq, state.offset, stop, offset,
                                                    int(time.time() * 1000)])
        if res[0] not in ("ok", "duplicate"):
            raise SinkFailed(f"compacting seqs {state.seq}..{stop - 1} answered {res}")
        if res[0] == "ok":
            self.r.hdel(k.sink, "error", "error_ms")
            log.info("sink delivered job_id=%s seqs=%s..%s batches=%s sink=%s", spec.job_id, state.seq,
                     stop - 1, len(records), spec.sink["type"])
        return len(records)

    def _batches(self, spec: JobSpec, first: int, stop: int) -> list[dict[str, str]]:
        """The batch hashes of seqs first..stop-1 (all below the watermark: they change no more)."""
        k = self.ledger.keys.job(spec.job_id)
        pipe = self.r.pipeline(transaction=False)
        for seq in range(first, stop):
            pipe.hgetall(k.batch(seq))
        found = pipe.execute()
        for seq, fields in zip(range(first, stop), found, strict=True):
            if not fields:
                raise SinkFailed(f"batch {seq} of job {spec.job_id} has no record")
        return found

    def _settled(self, batches: list[dict[str, str]]) -> int:
        """How many of ``batches`` (in seq order) committed at least ``sink_grace`` ago (Redis's clock):
        until then a repeated answer for the batch still finds its record and gets its first answer
        (complete.lua), rather than the stale answer a compacted batch gets. A batch below the watermark
        that runs again (its quarantined items retried before it was delivered) stops the chunk too: it
        is delivered once it commits, with their outputs."""
        grace_ms = int(self.settings.sink_grace.total_seconds() * 1000)
        before = None
        if grace_ms:
            secs, micros = self.r.time()
            before = secs * 1000 + micros // 1000 - grace_ms
        for i, fields in enumerate(batches):
            status = fields.get("status")
            if status not in ("completed", "superseded"):
                return i
            if before is not None and status == "completed" and int(fields.get("completed_ms") or 0) > before:
                return i
        return len(batches)

    def _records(self, spec: JobSpec, first: int, batches: list[dict[str, str]]) -> list[dict[str, Any]]:
        """The delivery records of the completed ones among ``batches`` (seqs from ``first``; superseded
        ones have nothing to deliver)."""
        names = [s.name for s in spec.flow.stages]
        out = []
        for seq, fields in enumerate(batches, start=first):
            if fields.get("status") != "completed":
                continue
            out.append({"id": f"{spec.job_id}.{seq}", "job_id": spec.job_id, "seq": seq,
                        "generation": int(fields.get("gen") or 0),
                        "cursor": loads_or_none(fields.get("start_cursor")),
                        "end_cursor": loads_or_none(fields.get("end_cursor")),
                        "items": int(fields.get("n_items") or 0),
                        "outputs": {n: loads_or_none(fields.get(f"out:{i}")) for i, n in enumerate(names)}})
        return out

    # -- amendments: retried quarantined items of delivered batches ------------------------------

    def _deliver_amendments(self, spec: JobSpec) -> int:
        """Deliver the amendments the sink owes (qretry.lua files them in ``sinklate``): for each batch
        that committed again, the new outputs of the items retried since it was delivered, as one more
        record (``<job_id>.<seq>.r<retry>``, ``amends`` naming the first). Written under the file's
        lock and recorded by amend.lua with the same compare-and-set on the offset as a chunk, so a
        file holds each once; an object is named by it; an HTTP receiver deduplicates by its id.
        Returns the amendments delivered."""
        k = self.ledger.keys.job(spec.job_id)
        delivered = 0
        for seq in (int(s) for s in self.r.zrange(k.sink_late, 0, AMEND_PAGE - 1)):
            if self.stop.is_set():
                break
            with self._exclusive(spec) as fd:
                state = SinkState.from_fields(self.r.hgetall(k.sink))
                fields = self.r.hgetall(k.batch(seq))
                status = fields.get("status")
                if status not in (None, "completed", "superseded") or (
                        status == "completed" and not self._settled([fields])):
                    continue  # running again, or committed too recently: next pass
                record = self._amendment(spec, seq, fields) if status == "completed" else None
                offset = (self._write(spec, fd, state, [record], name=f"{seq:012d}.r{record['retry']}")
                          if record else state.offset)
                res = self.ledger.scripts.amend(
                    keys=[k.job, k.sink, k.sink_late, k.batch(seq), k.items(seq)],
                    args=[seq, state.offset, offset, fields.get("qr") or "0", int(time.time() * 1000),
                          record["items"] if record else 0])
            if res[0] == "ok" and record:
                delivered += 1
                log.info("sink amended job_id=%s seq=%s retry=%s items=%s sink=%s", spec.job_id, seq,
                         record["retry"], record["items"], spec.sink["type"] if spec.sink else None)
            elif res[0] in ("raced", "corrupt"):
                raise SinkFailed(f"recording the amendment of batch {seq} answered {res}")
        return delivered

    def _amendment(self, spec: JobSpec, seq: int, fields: dict[str, str]) -> dict[str, Any] | None:
        """The amendment record of a delivered batch that committed again: the retried items that passed
        now and, per stage from the one they ran again from, the parts holding only retried items (a
        bisected stage's output is ``{"parts": [{"items", "output"}]}``); None when every retried item
        was quarantined again (nothing new to deliver)."""
        retried = set(bisect.indices(fields.get("qri")))
        passed = sorted(retried - set(bisect.indices(fields.get("bq"))))
        if not passed:
            return None
        first = int(fields.get("qrs") or 0)
        outputs: dict[str, Any] = {}
        for i, stage in enumerate(spec.flow.stages):
            out = loads_or_none(fields.get(f"out:{i}")) if i >= first else None
            if isinstance(out, dict) and isinstance(out.get("parts"), list):
                parts = [p for p in out["parts"] if set(p.get("items") or []) <= retried]
                out = {"parts": parts} if parts else None
            elif i >= first and out is not None:
                out = None  # not a part of this retry: the original record has it
            outputs[stage.name] = out
        retry = int(fields.get("qr") or 0)
        return {"id": f"{spec.job_id}.{seq}.r{retry}", "job_id": spec.job_id, "seq": seq,
                "amends": f"{spec.job_id}.{seq}", "retry": retry,
                "generation": int(fields.get("gen") or 0),
                "cursor": loads_or_none(fields.get("start_cursor")),
                "end_cursor": loads_or_none(fields.get("end_cursor")),
                "items": len(passed), "item_indices": passed, "outputs": outputs}

    # -- writing -----------------------------------------------------------------------------

    @contextlib.contextmanager
    def _exclusive(self, spec: JobSpec) -> Iterator[int | None]:
        """A file sink open and locked (flock, exclusive) for one chunk; None for other sinks."""
        assert spec.sink is not None
        if spec.sink["type"] not in FILE_SINKS:
            yield None
            return
        path = check_sink(spec.sink, self.settings, spec.tenant)  # roots may have narrowed since
        assert path is not None
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o640)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd
        finally:
            os.close(fd)  # releases the lock

    def _write(self, spec: JobSpec, fd: int | None, state: SinkState, records: list[dict[str, Any]],
               name: str | None = None) -> int:
        """Deliver ``records``; returns the sink file's offset after them (0 for other sinks). ``name``:
        the S3 object's name under the job's folder (default: the chunk's first seq)."""
        assert spec.sink is not None
        kind = spec.sink["type"]
        if kind == "discard":
            return 0
        if kind == "http":
            self._post(spec, records)
            return 0
        if kind == "s3":
            self._put(spec, name or f"{state.seq:012d}", records)
            return 0
        assert fd is not None
        size = os.fstat(fd).st_size
        if size < state.offset:
            raise SinkFailed(f"the sink file holds {size} bytes, fewer than the {state.offset} delivered: "
                             "it was truncated or replaced; delivery stops until an operator looks")
        os.ftruncate(fd, state.offset)  # lines a killed delivery wrote but never recorded
        data = _jsonl(records) if kind == "jsonl" else _csv(spec, records, header=state.offset == 0)
        os.lseek(fd, state.offset, os.SEEK_SET)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.fsync(fd)
        return state.offset + len(data)

    def _post(self, spec: JobSpec, records: list[dict[str, Any]]) -> None:
        assert spec.sink is not None
        if not records:
            return
        timeout = self.settings.sink_timeout.total_seconds()
        first, last = records[0]["seq"], records[-1]["seq"]
        delivery = records[0]["id"] if "amends" in records[0] else f"{spec.job_id}.{first}-{last}"
        resp = self.session.post(spec.sink["url"], data=dumps({"job_id": spec.job_id, "records": records}),
                                 headers={"Content-Type": "application/json", "Batchgate-Delivery": delivery},
                                 timeout=(timeout, timeout), allow_redirects=False)
        if not 200 <= resp.status_code < 300:
            raise SinkFailed(f"the http sink answered {resp.status_code}")

    def _put(self, spec: JobSpec, name: str, records: list[dict[str, Any]]) -> None:
        """Write the chunk (or amendment) as its object ``name`` (or delete that object when the chunk
        has no completed batch: what a dead earlier delivery may have put there is not delivered)."""
        assert spec.sink is not None
        check_sink_s3(spec.sink, self.settings, spec.tenant)  # grants may have narrowed since
        from botocore.exceptions import BotoCoreError, ClientError

        key = s3_object_key(spec.sink, spec.job_id, name)
        try:
            if records:
                self._s3_client().put_object(Bucket=spec.sink["bucket"], Key=key, Body=_jsonl(records),
                                             ContentType="application/x-ndjson")
            else:
                self._s3_client().delete_object(Bucket=spec.sink["bucket"], Key=key)
        except ClientError as exc:
            error = exc.response.get("Error", {})
            raise SinkFailed(f"the s3 sink answered {error.get('Code', '?')} for "
                             f"s3://{spec.sink['bucket']}/{key}: {error.get('Message', '')}"[:300]) from None
        except BotoCoreError as exc:
            raise SinkFailed(f"the s3 sink could not be reached: {type(exc).__name__}") from None

    def _s3_client(self) -> Any:
        if self._s3 is None:
            import boto3
            from botocore.config import Config

            timeout = self.settings.sink_timeout.total_seconds()
            config = Config(connect_timeout=timeout, read_timeout=timeout,
                            retries={"max_attempts": 1, "mode": "standard"},  # the deliverer backs off itself
                            s3={"addressing_style": "path"} if self.settings.s3_endpoint_url else None)
            self._s3 = boto3.session.Session().client("s3", endpoint_url=self.settings.s3_endpoint_url,
                                                      region_name=self.settings.s3_region, config=config)
        return self._s3

    # -- bookkeeping -------------------------------------------------------------------------

    def _failed(self, spec: JobSpec, exc: Exception) -> None:
        """Record the error in the job's sink state (the job view shows it) and back off."""
        _, last = self._retry_at.get(spec.job_id, (0.0, 0.0))
        delay = min(max(last * 2, BACKOFF_S[0]), BACKOFF_S[1])
        self._retry_at[spec.job_id] = (time.monotonic() + delay, delay)
        why = str(exc) if isinstance(exc, SinkFailed) else f"{type(exc).__name__}: {exc}"
        with contextlib.suppress(*REDIS_DOWN):
            self.r.hset(self.ledger.keys.job(spec.job_id).sink,
                        mapping={"error": why[:500], "error_ms": int(time.time() * 1000)})
        log.warning("sink delivery failed job_id=%s sink=%s error=%s retry_in_s=%.0f", spec.job_id,
                    spec.sink["type"] if spec.sink else None, why[:200], delay)

    def _maybe_retire(self, spec: JobSpec, status: str | None, seq: int, wm: int) -> None:
        """Stop following a job at rest whose every batch below the watermark is delivered (a resume
        adds it again: Ledger.persist_job), and trim its log to ``log_at_rest`` entries. A failed job
        with leases out may still commit answers."""
        if status not in AT_REST or seq < wm:
            return
        k = self.ledger.keys.job(spec.job_id)
        if status == "failed" and self.r.zcard(k.leases):
            return
        if self.r.zcard(k.sink_late):  # an amendment still owed (its batch committing too recently)
            return
        self.r.srem(self.ledger.keys.sink_jobs, spec.job_id)
        if self.r.hget(k.job, "status") not in AT_REST:  # resumed meanwhile: keep following it
            self.r.sadd(self.ledger.keys.sink_jobs, spec.job_id)
            return
        # its results are in the sink: the execution log (up to log_maxlen entries, ~70 B each) keeps
        # its last few, and its streams and sink hash lose the slack Redis allocated (rest.lua)
        self.ledger.scripts.rest(keys=[k.job, k.log, k.audit, k.events, k.sink],
                                 args=[self.settings.log_at_rest])
        # and its spec and streams fold into one compressed value (archive.py): ~1.6 KB a job at rest;
        # 'raced' (an entry came in between the read and the script): followed again, folded next pass
        folded = archive.fold(self.ledger, spec.job_id, self.settings.log_at_rest)
        if folded[0] == "raced":
            self.r.sadd(self.ledger.keys.sink_jobs, spec.job_id)
        log.info("sink job at rest job_id=%s folded=%s", spec.job_id, folded[0])


def _jsonl(records: list[dict[str, Any]]) -> bytes:
    return "".join(dumps(r) + "\n" for r in records).encode("utf-8")


def _csv(spec: JobSpec, records: list[dict[str, Any]], header: bool) -> bytes:
    """CSV rows: id, job_id, seq, generation, cursor, end_cursor, items, then one column per stage's
    output (cursors and outputs as JSON); the header row starts the file."""
    out = io.StringIO()
    writer = csv.writer(out, lineterminator="\n")
    names = [s.name for s in spec.flow.stages]
    if header:
        writer.writerow(["id", "job_id", "seq", "generation", "cursor", "end_cursor", "items", *names])
    for r in records:
        writer.writerow([r["id"], r["job_id"], r["seq"], r["generation"], dumps(r["cursor"]),
                         dumps(r["end_cursor"]), r["items"], *[dumps(r["outputs"][n]) for n in names]])
    return out.getvalue().encode("utf-8")
