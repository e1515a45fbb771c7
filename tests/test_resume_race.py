"""Resume by cursor (forward and backward) while batches are leased and committing, 200 times with
random timing: every run ends with exact counters and every item of the final range committed exactly
once in the final plan."""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import pytest

from gateway.errors import JobCancelled, StaleLease

RUNS = 200
ITEMS = 60
STAGES = ("score", "store")


def _worker(ledger, job_id, rng, stop, committed, lock, replanned):
    """A pull loop: lease, maybe take a moment, complete (or now and then fail, retryably). It leaves
    once the job is final after the cursor move (a job that finished before it is re-opened by it)."""
    while not stop.is_set():
        got = ledger.lease(job_id)
        if got is None:
            status = ledger.job_fields(job_id)["status"]
            if status in ("succeeded", "failed", "cancelled") and replanned.is_set():
                return
            time.sleep(0.0005)
            continue
        if rng.random() < 0.5:
            time.sleep(rng.random() * 0.002)
        try:
            if rng.random() < 0.05:
                ledger.fail(job_id, got.seq, got.lease_token, "flaky", retryable=True)
            else:
                res = ledger.complete(job_id, got.seq, got.lease_token, {"n": len(got.items or [])})
                if not res["duplicate"]:
                    with lock:
                        committed.append((got.seq, got.stage))
        except (StaleLease, JobCancelled):
            pass  # superseded by the cursor move: the answer is refused, nothing changes


def _committed_offset(ledger, job_id):
    done_at = json.loads(ledger.job_fields(job_id)["committed_cursor"] or "null")
    return ITEMS if done_at is None else done_at["offset"]


def _offsets(batch):
    start = json.loads(batch["start_cursor"])["offset"]
    return start, start + int(batch["n_items"])


def _check(ledger, job_id, cursor):
    job = ledger.job_fields(job_id)
    assert job["status"] == "succeeded", job
    base, nxt = int(job["base_seq"]), int(job["next_seq"])
    batches = [ledger.batch_record(job_id, s) for s in range(base, nxt)]
    by_status = Counter(b["status"] for b in batches)
    # counters equal a recount of the current plan
    assert int(job["n_done"]) == by_status["completed"] == len(batches)
    assert int(job["n_open"]) == 0 and int(job["n_failed"]) == 0
    assert int(job["items_done"]) == sum(int(b["n_items"]) for b in batches) == ITEMS - cursor
    assert int(job["wm"]) == nxt and json.loads(job["committed_cursor"]) is None
    # the final plan's batches tile [cursor, ITEMS) exactly: every item once, none skipped
    covered = sorted(_offsets(b) for b in batches)
    assert covered[0][0] == cursor and covered[-1][1] == ITEMS
    assert all(a[1] == b[0] for a, b in zip(covered, covered[1:], strict=False))
    for b in batches:
        assert all(b.get(f"st:{i}") == "completed" for i in range(len(STAGES)))
    return base


@pytest.mark.parametrize("seed", [11])
def test_resume_by_cursor_while_batches_are_leased(ledger, make_job, seed):
    rng = random.Random(seed)
    moves = Counter()
    for run in range(RUNS):
        job_id = make_job(items=ITEMS, max_items=rng.choice([2, 3, 5]), stages=STAGES,
                          concurrency=rng.choice([2, 4, 8]), tolerated_failure_percentage=0,
                          stage_defs=[{"name": s, "retry": {"initial_interval": 0.001,
                                                            "maximum_attempts": 100}} for s in STAGES])
        stop, lock, committed, replanned = threading.Event(), threading.Lock(), [], threading.Event()
        threads = [threading.Thread(target=_worker,
                                    args=(ledger, job_id, random.Random(rng.random()), stop, committed, lock,
                                          replanned))
                   for _ in range(rng.choice([2, 3, 4]))]
        for t in threads:
            t.start()
        time.sleep(rng.random() * 0.02)
        want = rng.choice(["forward", "backward"])
        here = _committed_offset(ledger, job_id)
        while want == "backward" and here == 0:  # something must be committed to rewind over
            time.sleep(0.0005)
            here = _committed_offset(ledger, job_id)
        if want == "forward" and here < ITEMS:
            cursor = rng.randrange(here, ITEMS)
        else:
            want, cursor = "backward", rng.randrange(0, here)
        moves[want] += 1
        ledger.replan(job_id, {"type": "offset", "offset": cursor}, "race-test", f"run {run}")
        replanned.set()
        deadline = time.monotonic() + 60  # generous: CI machines can be busy
        for t in threads:
            t.join(max(deadline - time.monotonic(), 0.1))
        stop.set()
        assert not any(t.is_alive() for t in threads), f"run {run}: the job did not finish"
        base = _check(ledger, job_id, cursor)
        # each (seq, stage) of the final plan was committed exactly once
        final = Counter(c for c in committed if c[0] >= base)
        assert final and set(final.values()) == {1}, (run, final)
        assert len(final) == (int(ledger.job_fields(job_id)["next_seq"]) - base) * len(STAGES)
    assert moves["backward"] > 60 and moves["forward"] > 60, moves
