"""A rewind (resume by cursor backwards) never hands the same items to a stage under another key.

Issue 15 measured 19-42 items stored twice per run: a rewind re-planned the range under new seqs, and
the idempotency key was ``<job>:<seq>:<stage>``, so a store flow that deduplicates by key stored them
again. Keys are now made per item range (JobSpec.stage_key) and the rewind's ``generation`` travels
beside them.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

from gateway.errors import JobCancelled, StaleLease
from gateway.ledger.ledger import Ledger
from gateway.ledger.records import seal
from tests.conftest import drain

ITEMS = 48
STAGES = ("score", "store")


class KeyedStore:
    """A store flow as the README asks for: the first call per idempotency key writes, a repeat answers
    what the first wrote. Counts how often each item was written."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.by_key: dict[str, list] = {}
        self.writes: Counter = Counter()

    def store(self, key: str, items: list) -> dict:
        with self.lock:
            if key not in self.by_key:
                self.by_key[key] = items
                self.writes.update(items)
            return {"stored": len(self.by_key[key])}


def _worker(ledger, job_id, rng, store, stop, generations):
    while not stop.is_set():
        got = ledger.lease(job_id)
        if got is None:
            if ledger.job_fields(job_id)["status"] == "succeeded":
                return
            time.sleep(0.0005)
            continue
        generations.add((got.generation, got.stage))
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.002)
        output = store.store(got.idempotency_key, got.items) if got.stage == "store" else {"ok": 1}
        try:
            ledger.complete(job_id, got.seq, got.lease_token, output)
        except (StaleLease, JobCancelled):
            pass  # superseded by the rewind: the stage ran (and stored), the answer is refused


def test_rewinds_to_a_committed_cursor_store_nothing_twice(ledger, make_job):
    """Rewinds while batches are leased and storing, to a cursor the job had committed (what a person
    reads from the job view or the log): every item is written once by a store that deduplicates by key."""
    rng = random.Random(15)
    for run in range(25):
        job_id = make_job(items=[f"i{n}" for n in range(ITEMS)], max_items=rng.choice([2, 3, 4]),
                          stages=STAGES, concurrency=rng.choice([2, 4]))
        store, stop, generations = KeyedStore(), threading.Event(), set()
        seen_cursors = []
        threads = [threading.Thread(target=_worker, args=(ledger, job_id, random.Random(rng.random()),
                                                          store, stop, generations)) for _ in range(3)]
        for t in threads:
            t.start()
        while len(seen_cursors) < 3:  # watch the committed cursor move, as a person would
            c = json.loads(ledger.job_fields(job_id)["committed_cursor"])
            if c is None or c["offset"] >= ITEMS * 3 // 4:
                break
            if c["offset"] > 0 and c not in seen_cursors:
                seen_cursors.append(c)
            time.sleep(0.001)
        if seen_cursors:
            ledger.replan(job_id, rng.choice(seen_cursors), "test", f"rewind {run}")
        deadline = time.monotonic() + 60
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.1))
        stop.set()
        assert ledger.job_fields(job_id)["status"] == "succeeded"
        assert sorted(store.writes) == sorted(f"i{n}" for n in range(ITEMS)), f"run {run}: missing"
        twice = {item: n for item, n in store.writes.items() if n > 1}
        assert not twice, f"run {run}: stored more than once: {twice}"
        if seen_cursors:
            assert (1, "store") in generations, "the re-planned batches carry generation 1"


def test_the_same_range_keeps_its_key_and_the_generation_counts_rewinds(ledger, make_job):
    job_id = make_job(items=list(range(8)), max_items=2)
    first = {(lease.cursor["offset"], lease.stage): lease for lease in drain(ledger, job_id)}
    ledger.replan(job_id, {"type": "offset", "offset": 4}, "op", "rewind")
    again = {(lease.cursor["offset"], lease.stage): lease for lease in drain(ledger, job_id)}
    assert set(again) == {(4, "score"), (4, "store"), (6, "score"), (6, "store")}
    for at, lease in again.items():
        assert lease.idempotency_key == first[at].idempotency_key
        assert (lease.generation, first[at].generation) == (1, 0)
        assert lease.seq != first[at].seq  # new seqs, same keys
    assert len({lease.idempotency_key for lease in first.values()}) == len(first)  # one per range+stage
    ledger.replan(job_id, {"type": "offset", "offset": 6}, "op", "rewind again")
    assert {lease.generation for lease in drain(ledger, job_id)} == {2}


def test_a_job_recorded_before_range_keys_keeps_its_seq_keys(ledger, make_job, redis_client, settings):
    """A batch in flight across the upgrade keeps the key its platform has already seen."""
    job_id = make_job(items=list(range(4)), max_items=2)
    key = ledger.keys.job(job_id).spec
    fields = {k: v for k, v in redis_client.hgetall(key).items() if k not in ("checksum", "key_scheme")}
    redis_client.delete(key)
    redis_client.hset(key, mapping=seal(fields))
    old = Ledger(redis_client, settings)  # a fresh spec cache: the record as an older version wrote it
    lease = old.lease(job_id)
    assert lease.idempotency_key == f"{job_id}:{lease.seq}:score"


def test_the_envelope_carries_the_generation(api):
    from tests.test_api import create_job, lease, register

    register(api, count=6)
    job_id = create_job(api)["job_id"]
    env = lease(api, job_id)
    assert env["generation"] == 0 and env["idempotency_key"].startswith(f"{job_id}:score:")
    moved = api.post(f"/v1/jobs/{job_id}/resume", json={"cursor": env["cursor"], "reason": "redo"})
    assert moved.status_code == 200, moved.text
    again = lease(api, job_id)
    assert (again["generation"], again["idempotency_key"]) == (1, env["idempotency_key"])
