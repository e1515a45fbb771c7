"""Push mode at platform scale: one `batchgate worker` process holds many slow calls in flight, a batch
waiting for a free worker slot holds no lease that can expire, and no call is paid twice.

Real `batchgate worker` processes, the API on a socket, a supervisor thread, and a slow sync platform on
127.0.0.1 that counts calls in flight.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from collections import Counter
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

from gateway.api.app import create_app
from gateway.push.dispatch import Dispatcher
from gateway.errors import NotFound
from gateway.ledger.ledger import Ledger
from gateway.push.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.platforms import SlowSyncPlatform

pytestmark = pytest.mark.slow


def flow(url: str, batches: int, *, concurrency: int, lease: float, timeout: float,
         max_in_flight: int, attempts: int = 3) -> dict:
    return {"id": "wc", "version": "1", "batching": {"max_items": 1}, "concurrency": concurrency,
            "source": {"type": "sequence", "count": batches},
            "stages": [{"name": "score", "lease": lease, "timeout": timeout,
                        "retry": {"initial_interval": 0.1, "maximum_attempts": attempts},
                        "target": {"type": "http", "url": f"{url}/score", "mode": "sync",
                                   "max_in_flight": max_in_flight}}]}


class Stack:
    def __init__(self, api: ApiClient, ledger: Ledger, env: dict[str, str], own) -> None:
        self.api, self.ledger, self.env, self.own = api, ledger, env, own
        self.sup: Supervisor | None = None
        self.procs: list[subprocess.Popen] = []

    def start_supervisor(self) -> None:
        self.sup = Supervisor(self.ledger, name="wc", dispatcher=Dispatcher.build(self.own, self.ledger))
        self.sup_thread = threading.Thread(target=self.sup.run, daemon=True)
        self.sup_thread.start()

    def stop_supervisor(self) -> None:
        if self.sup is not None:
            self.sup.stop.set()
            time.sleep(0.3)  # its current tick ends

    def worker(self, concurrency: int, log_to: Path | None = None, **env: str) -> subprocess.Popen:
        """A `batchgate worker` process; its log goes to ``log_to`` (appended) if given."""
        out = open(log_to, "ab") if log_to else subprocess.DEVNULL  # noqa: SIM115 (the child keeps it)
        proc = subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "worker", "--concurrency",
                                 str(concurrency)], env={**self.env, **env}, start_new_session=True,
                                stdout=out, stderr=out)
        if log_to:
            out.close()
        self.procs.append(proc)
        return proc

    def job(self, job_id: str) -> dict:
        return self.api.get(f"/v1/jobs/{job_id}").json()

    def wait_done(self, job_id: str, timeout_s: float) -> dict:
        deadline = time.monotonic() + timeout_s
        while (job := self.job(job_id))["status"] == "running":
            assert time.monotonic() < deadline, f"job did not finish: {job}"
            time.sleep(0.1)
        return job

    def batches(self, job_id: str, count: int) -> list[dict]:
        return [self.ledger.batch_record(job_id, seq) for seq in range(count)]

    def log(self, job_id: str) -> list[dict]:
        return [f for _, f in self.ledger.r.xrange(self.ledger.keys.job(job_id).log)]


@contextmanager
def stack(settings, redis_client, data, **over):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "data_dir": data,
                                      "supervisor_interval": timedelta(milliseconds=100), **over})
    holder: dict = {}
    base, stop_api = serve_app(lambda environ, start: holder["app"](environ, start))
    own = own.model_copy(update={"public_url": base})
    holder["app"] = create_app(own, redis_client)
    env = {**os.environ, "BATCHGATE_REDIS_URL": own.redis_url.get_secret_value(),
           "BATCHGATE_SIGNING_KEY": own.signing_secret().decode(), "BATCHGATE_PUBLIC_URL": base,
           "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_LOG_LEVEL": "WARNING",
           "BATCHGATE_DATA_DIR": str(data)}
    s = Stack(ApiClient(base, TOKEN), Ledger(redis_client, own), env, own)
    s.start_supervisor()
    try:
        yield s
    finally:
        for proc in s.procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        s.stop_supervisor()
        stop_api()


def start_job(s: Stack, spec: dict) -> str:
    assert s.api.post("/v1/flows", json=spec).status_code == 201
    return s.api.post("/v1/jobs", json={"flow_id": spec["id"]}).json()["job_id"]


def test_batches_waiting_for_a_busy_worker_longer_than_their_lease_are_called_once(
        settings, redis_client, tmp_path):
    """The issue's case: 1 worker running 1 call at a time, flow concurrency 32, a 2 s platform, a 10 s
    lease: the last batches wait far longer than their lease for the worker (8 x 2 s); none is leased
    while it waits, so none expires and paid calls == batches."""
    batches = 8
    platform = SlowSyncPlatform(delay=2.0)
    try:
        with stack(settings, redis_client, tmp_path / "data") as s:
            s.worker(1)
            job_id = start_job(s, flow(platform.url, batches, concurrency=32, lease=10, timeout=5,
                                       max_in_flight=32))
            job = s.wait_done(job_id, 60)
            log = s.log(job_id)
            records = s.batches(job_id, batches)
    finally:
        platform.close()
    assert job["status"] == "succeeded", job
    assert sorted(platform.seqs()) == list(range(batches))  # paid calls == batches, one per batch
    assert platform.peak == 1
    assert [e for e in log if e["event"] in ("retry_scheduled", "batch_failed")] == []
    assert {r["attempt"] for r in records} == {"1"}
    # the wait really was longer than the lease: the last call began > 10 s after the first
    starts = sorted(t for t, _ in platform.arrivals)
    assert starts[-1] - starts[0] > 12


def test_one_worker_process_holds_many_calls_in_flight(settings, redis_client, tmp_path):
    batches = 32
    platform = SlowSyncPlatform(delay=1.0)
    try:
        with stack(settings, redis_client, tmp_path / "data") as s:
            s.worker(16)
            job_id = start_job(s, flow(platform.url, batches, concurrency=32, lease=10, timeout=5,
                                       max_in_flight=32))
            started = time.monotonic()
            job = s.wait_done(job_id, 60)
            took = time.monotonic() - started
    finally:
        platform.close()
    assert job["status"] == "succeeded", job
    assert sorted(platform.seqs()) == list(range(batches))  # paid calls == batches
    assert platform.peak >= 12, platform.peak
    assert took < 16, took  # one call at a time would take 32 s


def test_target_max_in_flight_holds_across_worker_threads(settings, redis_client, tmp_path):
    batches = 12
    platform = SlowSyncPlatform(delay=0.5)
    try:
        with stack(settings, redis_client, tmp_path / "data") as s:
            s.worker(16)
            job_id = start_job(s, flow(platform.url, batches, concurrency=32, lease=10, timeout=5,
                                       max_in_flight=3))
            job = s.wait_done(job_id, 60)
    finally:
        platform.close()
    assert job["status"] == "succeeded", job
    assert sorted(platform.seqs()) == list(range(batches))
    assert platform.peak <= 3


def test_sigterm_lets_calls_in_flight_commit_and_releases_the_rest_unspent(
        settings, redis_client, tmp_path):
    batches = 16
    platform = SlowSyncPlatform(delay=2.0)
    try:
        with stack(settings, redis_client, tmp_path / "data") as s:
            proc = s.worker(4)
            job_id = start_job(s, flow(platform.url, batches, concurrency=16, lease=10, timeout=5,
                                       max_in_flight=16, attempts=1))
            deadline = time.monotonic() + 30
            while platform.in_flight < 4:
                assert time.monotonic() < deadline, "the worker never had 4 calls in flight"
                time.sleep(0.01)
            s.stop_supervisor()  # nothing expires meanwhile: what stays leased is the worker's doing
            proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            assert proc.wait(timeout=40) == 0
            exited = time.monotonic()
            calls_before = platform.seqs()
            job = s.job(job_id)
            records = planned(s, job_id, batches)
            leases = redis_client.zcard(s.ledger.keys.job(job_id).leases)
            # a new worker and supervisor finish the job: nothing was spent on the released batches
            s.start_supervisor()
            s.worker(16)
            done = s.wait_done(job_id, 60)
    finally:
        platform.close()
    assert len(calls_before) == 4  # no call started after the signal
    assert [t for t, _ in platform.arrivals[:4] if t > signalled] == []
    assert exited - signalled < 10
    assert job["batches"]["completed"] == 4 and job["batches"]["leased"] == 0, job
    assert leases == 0
    called = set(calls_before)
    for seq, rec in enumerate(records):
        if seq in called:
            assert rec["status"] == "completed", rec
        else:  # planned but not called: back in the pool, nothing spent
            assert rec["status"] == "pending", rec
            assert int(rec["attempt"]) - int(rec.get("unspent") or 0) == 0, rec
    assert done["status"] == "succeeded", done  # maximum_attempts 1: a spent attempt would have failed
    assert sorted(platform.seqs()) == list(range(batches))  # paid calls == batches


def planned(s: Stack, job_id: str, count: int) -> list[dict]:
    """The records of the batches planned so far, in seq order."""
    out = []
    for seq in range(count):
        try:
            out.append(s.ledger.batch_record(job_id, seq))
        except NotFound:
            break
    return out


def test_sigkill_of_a_worker_with_100_calls_in_flight_reruns_exactly_those(settings, redis_client, tmp_path):
    """SIGKILL a worker holding 100 calls in flight: after their leases run out a new worker runs them
    again; every batch commits exactly once, and the re-run calls are exactly the ones in flight."""
    batches, in_flight = 150, 100
    platform = SlowSyncPlatform(delay=2.0)
    try:
        with stack(settings, redis_client, tmp_path / "data") as s:
            proc = s.worker(in_flight)
            job_id = start_job(s, flow(platform.url, batches, concurrency=in_flight, lease=4, timeout=3,
                                       max_in_flight=in_flight, attempts=3))
            deadline = time.monotonic() + 60
            while platform.in_flight < in_flight:
                assert time.monotonic() < deadline, f"only {platform.in_flight} calls in flight"
                time.sleep(0.01)
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            # in flight = called but not committed when the worker died
            called = set(platform.seqs())
            killed_calls = sorted(seq for seq in called
                                  if s.ledger.batch_record(job_id, seq)["status"] != "completed")
            s.worker(in_flight)
            done = s.wait_done(job_id, 120)
            records = s.batches(job_id, batches)
    finally:
        platform.close()
    assert done["status"] == "succeeded", done
    assert done["batches"]["completed"] == batches and done["items_done"] == batches
    assert in_flight <= len(killed_calls) <= in_flight + 4  # (+ calls answered, not yet committed)
    calls = Counter(platform.seqs())
    assert set(calls) == set(range(batches))
    rerun = sorted(seq for seq, n in calls.items() if n > 1)
    assert rerun == killed_calls and max(calls.values()) == 2  # re-runs == the calls that were in flight
    assert all(r["status"] == "completed" for r in records)
