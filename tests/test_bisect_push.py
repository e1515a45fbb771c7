"""Bisection in push mode, end to end (issue 19, item 1's test).

1,000 items in batches of 50, 3 poison items in different batches, on a stage that is not idempotent:
a stand-in platform on a real 127.0.0.1 socket fails any call holding a poison item with a non-retryable
contract answer and stores the items of every other call, by idempotency key. RQ workers run as real
`batchgate worker` processes through the real dispatcher; one is SIGKILLed while a piece of a bisected
batch is in flight. The job must store the 997 good items exactly once, quarantine the 3 with the
stand-in's message, stay within about 2 log2(50) extra calls per poison item, re-run only the call that
was in flight, and store a quarantined item once it is retried after the stand-in is fixed. The job's
concurrency is 1, so the held call is the only one in flight when the worker dies (with more, every call
in flight then may run again: the stage is not idempotent, and a lease that expires is retried).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter

import pytest

from tests.platforms import FakePlatform, Recorded, Reply, envelope_items
from tests.test_push_e2e import push_stack, wait_done

pytestmark = pytest.mark.slow

ITEMS, PER_BATCH = 1000, 50
POISON = {137, 512, 888}  # batches 2, 10 and 17


class PoisonPlatform(FakePlatform):
    """``/score``: a call holding a poison item fails for good with "item N is malformed"; any other call
    stores its items (``stored``: item -> times) and answers success. ``hold_piece`` blocks the first
    call on a piece (fewer items than a batch) until released; a held call stores nothing."""

    def __init__(self) -> None:
        super().__init__()
        self.fixed = False
        self.stored: Counter = Counter()
        self.keys: Counter = Counter()  # calls per idempotency key
        self.hold_piece = threading.Event()  # set: hold the next piece call
        self.holding = threading.Event()  # a piece call is being held
        self.release = threading.Event()
        self.held_key: str | None = None

    @property
    def url(self) -> str:
        return f"{self.base_url}/score"

    def route(self, req: Recorded, reply: Reply) -> None:
        items = envelope_items(req.json)
        key = req.json["idempotency_key"]
        with self._lock:
            self.keys[key] += 1
            hold = self.hold_piece.is_set() and 0 < len(items) < PER_BATCH
            if hold:
                self.hold_piece.clear()
                self.held_key = key
        if hold:
            self.holding.set()
            self.release.wait(30)
            return None  # the worker died meanwhile: this call never ran
        bad = [i for i in items if i in POISON and not self.fixed]
        if bad:
            return reply.json(200, {"status": "failed", "error": {"message": f"item {bad[0]} is malformed",
                                                                   "retryable": False}})
        with self._lock:
            self.stored.update(items)
        return reply.json(200, {"status": "succeeded", "output": {"count": len(items)}})


def flow(url: str) -> dict:
    return {
        "id": "bisect-e2e", "version": "1", "batching": {"max_items": PER_BATCH}, "concurrency": 1,
        "source": {"type": "sequence", "count": ITEMS}, "tolerated_failure_percentage": 1,
        "stages": [{"name": "score", "lease": 2, "timeout": 5, "on_fatal": "bisect",
                    "retry": {"initial_interval": 0.1, "maximum_attempts": 5},
                    "target": {"type": "http", "url": url, "mode": "sync"}}],
    }


def test_poison_items_are_bisected_out_and_good_items_stored_once(settings, redis_client, tmp_path):
    with PoisonPlatform() as platform, \
            push_stack(settings, redis_client, tmp_path / "data", workers=1) as (api, ledger, workers):
        platform.hold_piece.set()
        assert api.post("/v1/flows", json=flow(platform.url)).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "bisect-e2e"}).json()["job_id"]
        assert platform.holding.wait(60), "no piece call came"
        workers.kill()  # SIGKILL mid-bisection: the held piece call is in flight
        platform.release.set()
        time.sleep(0.3)
        workers.start()
        job = wait_done(api, job_id, 120)
        assert job["status"] == "succeeded", job
        assert job["items_done"] == ITEMS - len(POISON) and job["items_quarantined"] == len(POISON)
        assert job["committed_seq"] == ITEMS // PER_BATCH - 1  # the watermark passed every batch

        good = set(range(ITEMS)) - POISON
        assert set(platform.stored) == good and set(platform.stored.values()) == {1}  # exactly once

        quarantine = api.get(f"/v1/jobs/{job_id}/quarantine").json()
        assert [(q["item"], q["error"]) for q in quarantine["items"]] == [
            (i, f"item {i} is malformed") for i in sorted(POISON)]

        log = redis_client.xrange(ledger.keys.job(job_id).log)
        commits = [(f["seq"], f.get("items")) for _, f in log
                   if f["event"] in ("stage_completed", "piece_completed")]
        assert len(commits) == len(set(commits))  # no batch or piece committed twice
        assert sum(1 for _, f in log if f["event"] == "quarantined") == len(POISON)

        calls = sum(platform.keys.values())
        reruns = [k for k, n in platform.keys.items() if n > 1]
        assert reruns == [platform.held_key]  # only the call in flight at the kill ran again
        extra = calls - ITEMS // PER_BATCH - len(reruns)
        assert extra <= len(POISON) * 2 * math.ceil(math.log2(PER_BATCH)), extra

        platform.fixed = True
        first = quarantine["items"][0]["id"]
        retried = api.post(f"/v1/jobs/{job_id}/quarantine/retry", json={"items": [first]}).json()
        assert retried["quarantine_retry"]["retried"] == 1
        job = wait_done(api, job_id, 60)
        assert job["status"] == "succeeded" and job["items_quarantined"] == len(POISON) - 1
        assert platform.stored[min(POISON)] == 1 and set(platform.stored.values()) == {1}
        assert [q["item"] for q in api.get(f"/v1/jobs/{job_id}/quarantine").json()["items"]] == sorted(
            POISON)[1:]
