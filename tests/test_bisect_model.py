"""Model-based test of bisection (docs/design.md "Bisection"): a Hypothesis state machine drives jobs
with an ``on_fatal: bisect`` first stage through the real Ledger and checks, after every step, what a
user relies on.

Jobs run over a ``sequence`` of 3..30 items, 1..8 per batch, with 1 or 2 stages (the second an ordinary
one), a bisection cap of 2, 6 or 64 extra calls, some poison items and a ledger planning 1 or 16 batches
at a time. Actions: lease; answer a held lease as the stand-in platform would (a piece with a poison item
fails with retryable=false while the platform is broken, anything else completes); a retryable failure;
a lease running out (expire_due); an answer with a token no longer current; the platform fixed; a retry
of one or every quarantined item; pause and resume. Time: ready scores are set to 0 before each lease, so
retries are due and nothing depends on the clock.

Invariants:
  1. each (item, stage) is committed at most once, ever (a retry of a quarantined item runs only it);
  2. with a cap that cannot run out (64), no good item is ever quarantined;
  3. ``items_done`` counts the items that passed in committed batches (at most those committed at the
     last stage: a batch's pieces commit before it does); ``n_quar`` equals the quarantine
     zset's size and the sum of the batches' ``bq`` lists; a batch's extra calls never pass the cap;
  4. ``wm`` is the first seq not completed, and every batch below it is completed (or re-opened by a
     retry of its quarantined items: quarantined items do not hold the watermark);
  5. a leased piece holds items of its batch only, none quarantined, none already committed at its stage;
  6. a succeeded job has every item committed at the last stage or quarantined (none both), and its
     quarantined items are exactly those ``GET .../quarantine`` lists;
  7. every record passes its checksum;
  8. with a jsonl result sink (half the examples; actions: deliver, with a torn tail now and then), the
     file up to the recorded offset holds each item's last-stage output at most once, counting the
     amendments that bring retried quarantined items (a retry may come before or after its batch was
     delivered); once the job succeeded and everything is delivered, exactly the items that passed.
"""

from __future__ import annotations

import json
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from gateway.errors import JobCancelled, StaleLease
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest
from gateway.ledger.records import intact
from gateway.push.sinks import SinkDeliverer
from gateway.settings import Settings
from tests.conftest import TOKEN, ready_all_now

TENANT = "acme"
STATS: Counter = Counter()  # what the examples reached (BATCHGATE_MODEL_STATS=1 with pytest -s prints it)


@pytest.fixture(name="settings")
def sink_settings(redis_server, tmp_path):
    (tmp_path / "out").mkdir()
    return Settings(redis_url=redis_server.url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"},
                    sink_roots={"*": [str(tmp_path / "out")]}, sink_chunk=3, sink_grace=0)


class BisectMachine(RuleBasedStateMachine):
    ledger = registry = jobs = out = None  # set by the test (fixtures)
    counter = 0

    @initialize(n=st.integers(3, 30), max_items=st.integers(1, 8), stages=st.integers(1, 2),
                cap=st.sampled_from([2, 6, 64]), poison=st.sets(st.integers(0, 29), max_size=4),
                ahead=st.sampled_from([1, 16]), sink=st.booleans())
    def start(self, n, max_items, stages, cap, poison, ahead, sink):
        type(self).counter += 1
        stage_defs = [{"name": "s0", "on_fatal": "bisect", "bisect_max_calls": cap,
                       "retry": {"maximum_attempts": 100, "initial_interval": 0.001}}]
        if stages == 2:
            stage_defs.append({"name": "s1", "retry": {"maximum_attempts": 100, "initial_interval": 0.001}})
        flow = parse_flow({"id": f"bm{self.counter}", "version": "1", "stages": stage_defs,
                           "batching": {"max_items": max_items}, "tolerated_failure_percentage": 100,
                           "source": {"type": "sequence", "count": n}})
        self.registry.register(TENANT, flow)
        self.path = self.out / f"{flow.id}.jsonl" if sink else None
        self.job_id = self.jobs.create(TENANT, JobRequest(
            flow_id=flow.id, sink={"type": "jsonl", "path": str(self.path)} if sink else None))["job_id"]
        self.deliverer = SinkDeliverer(self.ledger)
        self.seen: dict[int, dict[str, str]] = {}  # seq -> its record when last read (compaction removes it)
        self.k = self.ledger.keys.job(self.job_id)
        self.ledger.plan_ahead = ahead
        self.n, self.stages, self.cap = n, stages, cap
        self.poison = {p % n for p in poison}
        self.broken = True
        self.held: dict[str, object] = {}  # token -> Lease
        self.gone: list = []  # leases no longer current
        self.committed: dict[tuple[int, int], int] = {}  # (item, stage) -> commits

    # -- helpers ------------------------------------------------------------------------------------
    def ready_now(self) -> None:
        ready_all_now(self.ledger.r, self.k, self.stages)

    def pick(self, data):
        token = list(self.held)[data.draw(st.integers(0, len(self.held) - 1))]  # by lease order (tokens are random)
        return self.held.pop(token)

    def status(self) -> str:
        return self.ledger.job_fields(self.job_id)["status"]

    # -- actions ------------------------------------------------------------------------------------
    @rule()
    def lease(self):
        self.ready_now()
        got = self.ledger.lease(self.job_id)
        if got is None:
            return
        record = self.ledger.batch_record(self.job_id, got.seq)
        quarantined = set(json.loads(record.get("bq") or "[]"))
        start = json.loads(record["start_cursor"])["offset"]
        indices = got.piece if got.piece is not None else list(range(int(record["n_items"])))
        assert got.items == [start + i for i in indices]  # 5: items of its batch only
        assert not quarantined & set(indices)
        assert all(self.committed.get((item, got.stage_index), 0) == 0 for item in got.items)
        self.held[got.lease_token] = got

    @rule(data=st.data())
    def work(self, data):
        """Lease and answer, a few times (the common path, so examples get far)."""
        for _ in range(data.draw(st.integers(1, 6))):
            self.lease()
            if self.held:
                self.answer(data)

    @rule(data=st.data())
    def answer(self, data):
        if not self.held:
            return
        lease = self.pick(data)
        bad = [i for i in lease.items if i in self.poison]
        try:
            if lease.stage_index == 0 and bad and self.broken:
                out = self.ledger.fail(self.job_id, lease.seq, lease.lease_token, f"item {bad[0]} is poison",
                                       retryable=False)
                assert out["outcome"] in ("split", "quarantined"), out
                STATS[out["outcome"]] += 1
            else:
                out = self.ledger.complete(self.job_id, lease.seq, lease.lease_token,
                                           {"items": lease.items})
                assert not out["duplicate"]
                for item in lease.items:
                    self.committed[(item, lease.stage_index)] = self.committed.get((item, lease.stage_index), 0) + 1
        except JobCancelled:
            pass
        self.gone.append(lease)

    @rule(data=st.data())
    def flaky(self, data):
        if not self.held:
            return
        lease = self.pick(data)
        out = self.ledger.fail(self.job_id, lease.seq, lease.lease_token, "flaky", retryable=True)
        assert out["outcome"] == "retry"
        self.gone.append(lease)

    @rule(data=st.data())
    def run_out(self, data):
        if not self.held:
            return
        lease = self.pick(data)
        self.ledger.r.zadd(self.k.leases, {str(lease.seq): 0}, xx=True)
        self.ledger.expire_due(self.job_id)
        self.gone.append(lease)

    @rule(data=st.data())
    def stale_answer(self, data):
        if not self.gone:
            return
        lease = data.draw(st.sampled_from(self.gone))
        with pytest.raises((StaleLease, JobCancelled)):
            self.ledger.fail(self.job_id, lease.seq, lease.lease_token, "late", retryable=False)

    @rule()
    def fix_platform(self):
        self.broken = False

    @rule(data=st.data())
    def retry_quarantined(self, data):
        listed = self.ledger.quarantined(self.job_id)
        if not listed:
            return
        ids = None if data.draw(st.booleans()) else [data.draw(st.sampled_from(listed))["id"]]
        STATS["retried: " + str(self.ledger.retry_quarantined(self.job_id, ids, "tenant:acme")["retried"] > 0)] += 1
        STATS["retried after delivery"] += self.ledger.r.zcard(self.k.sink_late) > 0

    @rule(data=st.data())
    def run_to_rest(self, data):
        """Lease and answer until nothing is ready (so examples reach the end, deliveries and retries
        after it)."""
        for _ in range(4 * self.n + 20):
            self.lease()
            if not self.held:
                break
            self.answer(data)
        self.deliver(torn=False)  # the supervisor delivers while the job runs

    @rule(data=st.data())
    def operator_fixes_it(self, data):
        """What a user does about a run with quarantined items: it runs to rest (delivering), the
        platform is fixed, the items are retried and the job runs to rest again (amendments for the
        batches delivered before)."""
        self.run_to_rest(data)
        self.fix_platform()
        self.retry_quarantined(data)
        self.run_to_rest(data)
        self.deliver(torn=False)

    @rule(torn=st.booleans())
    def deliver(self, torn):
        """The supervisor's sink pass; ``torn``: a delivery killed mid-write left half a line first."""
        if self.path is None:
            return
        if torn:
            with self.path.open("a") as fh:
                fh.write('{"id": "half')
        job = self.ledger.job_fields(self.job_id)
        for s in range(int(job["base_seq"]), int(job["wm"])):  # what compaction may remove: final now
            if got := self.ledger.r.hgetall(self.k.batch(s)):
                self.seen[s] = got
        self.deliverer.run_once()
        if err := self.ledger.r.hget(self.k.sink, "error"):
            STATS["sink error: " + err[:80]] += 1
        STATS["amendments delivered"] += int(self.ledger.r.hget(self.k.sink, "amended") or 0) > 0

    @rule()
    def pause_and_resume(self):
        if self.status() == "running":
            self.ledger.pause(self.job_id, "t")
            self.ledger.reopen(self.job_id, "t")  # a paused job runs again; its leases stand

    # -- invariants ---------------------------------------------------------------------------------
    @invariant()
    def holds(self):
        if not hasattr(self, "job_id"):
            return
        job = self.ledger.job_fields(self.job_id)
        assert intact(job)  # 7
        assert all(v == 1 for v in self.committed.values())  # 1
        last = self.stages - 1
        done_items = {item for (item, stage) in self.committed if stage == last}
        assert int(job["items_done"]) <= len(done_items)  # 3: pieces commit before their batch does
        members = self.ledger.r.zrange(self.k.quarantine, 0, -1)
        assert int(job.get("n_quar") or 0) == len(members)
        seqs = range(int(job["base_seq"]), int(job["next_seq"]))
        sink = self.ledger.r.hgetall(self.k.sink)
        delivered_below = int(sink.get("seq") or 0)
        batches = {}
        for s in seqs:  # a compacted record (delivered, final) is as it was last read
            got = self.ledger.r.hgetall(self.k.batch(s))
            assert got or s < delivered_below, f"batch {s} lost before it was delivered"
            batches[s] = self.seen[s] = got or self.seen[s]
        assert all(intact(b) for b in batches.values())
        quarantined = set()
        for seq, b in batches.items():
            start = json.loads(b["start_cursor"])["offset"]
            quarantined |= {start + i for i in json.loads(b.get("bq") or "[]")}
            assert int(b.get("bx") or 0) <= self.cap
        assert len(quarantined) == len(members)
        # items_done: the items that passed, of batches committed (a retry pass keeps what it counted)
        assert int(job["items_done"]) == sum(
            int(b["n_good"]) if "n_good" in b else int(b["n_items"]) if b["status"] == "completed" else 0
            for b in batches.values())
        if self.cap == 64:
            assert quarantined <= self.poison  # 2
        wm = int(job["wm"])  # 4
        # below it: completed, or re-opened for a retry of its quarantined items (they never held it)
        assert all(batches[s]["status"] == "completed" or batches[s].get("only")
                   for s in range(int(job["base_seq"]), wm))
        assert wm == int(job["next_seq"]) or batches[wm]["status"] != "completed"
        STATS[f"job {job['status']}"] += 1
        if got_pieces := any(b.get("bis") for b in batches.values()):
            STATS["a batch in pieces"] += got_pieces
        if job["status"] == "succeeded":  # 6
            assert done_items | quarantined == set(range(self.n)) and not done_items & quarantined
            assert int(job["items_done"]) == len(done_items)
            listed = {q["item"] for q in self.ledger.quarantined(self.job_id)}
            assert listed == quarantined
        if self.path is not None:  # 8
            text = self.path.read_bytes()[:int(sink.get("off") or 0)].decode()
            assert text == "" or text.endswith("\n")
            stored = Counter(item for line in text.splitlines()
                             for item in _last_stage_items(json.loads(line), f"s{last}"))
            assert all(n == 1 for n in stored.values()), stored  # at most once, amendments included
            assert set(stored) <= done_items
            STATS["amended in file"] += any('"amends"' in line for line in text.splitlines())
            if job["status"] == "succeeded" and delivered_below == wm and not int(sink.get("late") or 0) \
                    and all(b["status"] == "completed" for b in batches.values()):
                assert set(stored) == done_items, (sorted(stored), sorted(done_items))
                STATS["sink complete"] += 1


def _last_stage_items(record: dict, stage: str) -> list[int]:
    """The items whose last-stage output a sink record carries: its parts' (a bisected stage, and an
    amendment's), else the whole output's."""
    out = record["outputs"].get(stage)
    if out is None:
        return []
    if "parts" in out:
        return [item for part in out["parts"] for item in part["output"]["items"]]
    return out["items"]


def test_bisection_model(ledger, registry, jobs, tmp_path):
    machine = type("Machine", (BisectMachine,), {"ledger": ledger, "registry": registry, "jobs": jobs,
                                                "out": tmp_path / "out"})
    run_state_machine_as_test(machine, settings=settings(
        max_examples=120, stateful_step_count=40, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    if os.environ.get("BATCHGATE_MODEL_STATS") == "1":
        print("\n".join(f"{name}: {n}" for name, n in sorted(STATS.items())))
