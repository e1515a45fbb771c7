"""Push mode end to end: batchgate drives every batch through a flaky platform by itself.

A stand-in platform (examples/resume_screening/platform.py) runs the process stage in callback mode,
failing 20 % of calls with "Error in workflow" and dropping 5 % of callbacks; the store stage answers
synchronously and counts stores by Idempotency-Key. RQ workers run as real processes and are SIGKILLed
twice during the run. The job must finish with every batch stored exactly once.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest

from gateway.api.app import create_app
from gateway.push.dispatch import Dispatcher
from gateway.ledger.ledger import Ledger
from gateway.push.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.platforms import FakeDify

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "resume_screening"))
from demo import kill_worker  # noqa: E402
from standin_platform import StandInPlatform  # noqa: E402

pytestmark = pytest.mark.slow

RETRY = {"initial_interval": 0.2, "maximum_interval": 2, "maximum_attempts": 12}


def push_flow(platform_url: str, batches: int) -> dict:
    return {
        "id": "push-e2e", "version": "1", "batching": {"max_items": 2}, "concurrency": 16,
        "source": {"type": "sequence", "count": batches * 2},
        "stages": [
            {"name": "process", "lease": 3, "idempotent": True, "retry": RETRY, "timeout": 5,
             "target": {"type": "http", "url": f"{platform_url}/score", "mode": "callback"}},
            {"name": "store", "lease": 5, "idempotent": True, "retry": RETRY, "timeout": 5,
             "target": {"type": "http", "url": f"{platform_url}/store", "mode": "sync"}},
        ],
    }


class Workers:
    """`batchgate worker` processes, killable with SIGKILL."""

    def __init__(self, env: dict[str, str], count: int) -> None:
        self.env, self.count = env, count
        self.procs: list = []

    def start(self) -> None:
        for _ in range(self.count):
            self.procs.append(subprocess.Popen(
                [sys.executable, "-m", "gateway.runtime.cli", "worker"], env=self.env, start_new_session=True,
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))

    def kill(self) -> None:
        """SIGKILL each worker and RQ's work horses (own process groups), so calls in flight die too."""
        for proc in self.procs:
            if proc.poll() is None:
                kill_worker(proc)
        self.procs = []


@contextmanager
def push_stack(settings, redis_client, data: Path, workers: int, secrets: dict | None = None):
    """API on a real socket, a supervisor thread with a dispatcher, and `batchgate worker` processes."""
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "data_dir": data,
                                      "supervisor_interval": timedelta(milliseconds=100),
                                      "secrets": secrets or {}})
    holder: dict = {}
    base, stop_api = serve_app(lambda environ, start: holder["app"](environ, start))
    own = own.model_copy(update={"public_url": base})  # callback URLs need the listening port
    holder["app"] = create_app(own, redis_client)
    env = {**os.environ, "BATCHGATE_REDIS_URL": own.redis_url.get_secret_value(),
           "BATCHGATE_SIGNING_KEY": own.signing_secret().decode(), "BATCHGATE_PUBLIC_URL": base,
           "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_LOG_LEVEL": "WARNING",
           "BATCHGATE_DATA_DIR": str(data), "BATCHGATE_SECRETS": json.dumps(secrets or {})}
    ledger = Ledger(redis_client, own)
    sup = Supervisor(ledger, name="e2e", dispatcher=Dispatcher.build(own, ledger))
    threading.Thread(target=sup.run, daemon=True).start()
    pool = Workers(env, count=workers)
    pool.start()
    try:
        yield ApiClient(base, TOKEN), ledger, pool
    finally:
        pool.kill()
        sup.stop.set()
        stop_api()


def wait_done(api: ApiClient, job_id: str, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while (job := api.get(f"/v1/jobs/{job_id}").json())["status"] == "running":
        assert time.monotonic() < deadline, f"push job did not finish: {job}"
        time.sleep(0.1)
    return job


def test_flaky_platform_and_killed_workers_store_every_batch_exactly_once(
        settings, redis_client, tmp_path):
    batches = 200
    with StandInPlatform(fail_rate=0.2, drop_rate=0.05, duplicate_rate=0.05, seed=7) as platform, \
            push_stack(settings, redis_client, tmp_path / "data", workers=2) as (api, ledger, workers):
        assert api.post("/v1/flows", json=push_flow(platform.url, batches)).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "push-e2e"}).json()["job_id"]
        for fraction in (0.3, 0.6):
            deadline = time.monotonic() + 120
            while api.get(f"/v1/jobs/{job_id}").json()["batches"]["completed"] < fraction * batches:
                assert time.monotonic() < deadline, "push job stalled"
                time.sleep(0.05)
            workers.kill()
            time.sleep(0.5)
            workers.start()
        job = wait_done(api, job_id, 180)
    stats = platform.stats()
    assert job["status"] == "succeeded", job
    assert job["items_done"] == batches * 2
    assert stats["stored_keys"] == batches  # one stored result per batch, by idempotency key
    ranges = [ledger.batch_record(job_id, seq) for seq in range(batches)]
    assert set(platform.stored) == {
        ledger.spec(job_id).stage_key(seq, "store", json.loads(b["start_cursor"]), json.loads(b["end_cursor"]))
        for seq, b in enumerate(ranges)}
    log = redis_client.xrange(ledger.keys.job(job_id).log)
    commits = [(f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_completed"]
    assert len(commits) == len(set(commits)) == batches * 2  # no stage committed twice
    assert stats["calls"]["/score"] > batches  # failures and drops really happened and were retried


def test_polled_dify_runs_finish_through_rq_scheduler(settings, redis_client, tmp_path):
    flow = {"id": "dify-poll", "version": "1", "batching": {"max_items": 2}, "concurrency": 4,
            "source": {"type": "sequence", "count": 6},
            "stages": [{"name": "summarise", "lease": 10, "poll_interval": 0.2,
                        "target": None}]}
    with FakeDify(api_key="app-e2e-key") as dify, \
            push_stack(settings, redis_client, tmp_path / "data", workers=1,
                       secrets={"acme": {"dify_app": "app-e2e-key"}}) as (api, ledger, _):
        dify.plan("async", "async", "async")
        flow["stages"][0]["target"] = {"type": "dify", "base_url": dify.base_url,
                                       "api_key_secret": "dify_app", "mode": "blocking"}
        assert api.post("/v1/flows", json=flow).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "dify-poll"}).json()["job_id"]
        job = wait_done(api, job_id, 60)
        polls = [r for r in dify.requests if r.method == "GET"]
    assert job["status"] == "succeeded", job
    assert len(polls) >= 3  # each run was polled until it finished
    events = [f["event"] for _, f in redis_client.xrange(ledger.keys.job(job_id).log)]
    assert events.count("platform_running") == 3 and events.count("stage_completed") == 3
