"""/metrics as Prometheus scrapes it from a real `batchgate up` (API, supervisor and worker processes
counting into one multiprocess folder), during and after a push job and a pull job, and across a crash
and the recovery that follows it.

The counters are checked against the job views: committed stages per stage name equal the batches the
views count, every platform call of the push job is counted by its target and outcome, the commit
latency histogram saw every commit, and the ledger's gauges (jobs by status, push jobs, approvals) read
what Redis holds. A SIGKILL of the whole deployment mid-job, then `up` again on the same data dir,
moves the recovery metrics; the recovered job's success moves the resume success rate's numerator.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

import pytest
import requests

from gateway.ledger.embedded import free_port
from tests.platforms import FakeHttpPlatform
from tests.test_deploy import STARTED, TOKEN, Proc, bg_env, leftovers  # noqa: F401 - the cleanup fixture
from tests.test_deploy import _kill_leftovers  # noqa: F401

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="/proc")]
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def scrape(base: str) -> dict[str, float]:
    """metric{labels} -> value (labels sorted as Prometheus prints them)."""
    resp = requests.get(f"{base}/metrics", timeout=10)
    assert resp.status_code == 200 and resp.headers["Content-Type"].startswith("text/plain"), resp.text[:300]
    out: dict[str, float] = {}
    for line in resp.text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name] = out.get(name, 0.0) + float(value)
    return out


def total(sample: dict[str, float], prefix: str, **labels: str) -> float:
    """The sum of every series of ``prefix`` whose labels include ``labels``."""
    found = 0.0
    for name, value in sample.items():
        if not (name == prefix or name.startswith(prefix + "{")):
            continue
        got = dict(re.findall(r'(\w+)="([^"]*)"', name))
        if all(got.get(k) == v for k, v in labels.items()):
            found += value
    return found


def start(tmp_path: Path, data: Path, port: int, name: str, **env: str) -> Proc:
    up = Proc(tmp_path, name, ["up", "--port", str(port)],
              bg_env(data, BATCHGATE_OUTBOUND_ALLOW='["127.0.0.1/32"]', **env))
    up.wait_healthy(port)
    return up


def test_metrics_move_with_a_push_job_and_a_pull_job(tmp_path):
    data, port = tmp_path / "data", free_port()
    base = f"http://127.0.0.1:{port}"
    with FakeHttpPlatform() as platform:
        up = start(tmp_path, data, port, "up")
        try:
            before = scrape(base)
            pull = {"id": "pull", "version": "1", "batching": {"max_items": 2},
                    "source": {"type": "sequence", "count": 8}, "stages": [{"name": "work"}]}
            push = {"id": "push", "version": "1", "batching": {"max_items": 2},
                    "source": {"type": "sequence", "count": 10},
                    "stages": [{"name": "call", "target": {"type": "http", "url": platform.url,
                                                            "mode": "sync"}}]}
            for flow in (pull, push):
                assert requests.post(f"{base}/v1/flows", json=flow, headers=AUTH, timeout=10).status_code == 201
            pull_id = requests.post(f"{base}/v1/jobs", json={"flow_id": "pull"}, headers=AUTH,
                                    timeout=10).json()["job_id"]
            lease = requests.post(f"{base}/v1/jobs/{pull_id}/lease", headers=AUTH, timeout=10).json()
            requests.post(f"{base}/v1/jobs/{pull_id}/batches/{lease['seq']}/complete", headers=AUTH,
                          json={"lease_token": lease["lease_token"], "output": {}}, timeout=10)
            mid = scrape(base)  # one pull batch committed, the job still running
            assert total(mid, "batchgate_batches_committed_total", stage="work") == 1
            assert total(mid, "batchgate_jobs", status="running") == 1
            push_id = requests.post(f"{base}/v1/jobs", json={"flow_id": "push"}, headers=AUTH,
                                    timeout=10).json()["job_id"]
            while (r := requests.post(f"{base}/v1/jobs/{pull_id}/lease", headers=AUTH, timeout=10)).status_code == 200:
                requests.post(f"{base}/v1/jobs/{pull_id}/batches/{r.json()['seq']}/complete", headers=AUTH,
                              json={"lease_token": r.json()["lease_token"], "output": {}}, timeout=10)
            deadline = time.monotonic() + 60
            while requests.get(f"{base}/v1/jobs/{push_id}", headers=AUTH, timeout=10).json()["status"] != "succeeded":
                assert time.monotonic() < deadline
                time.sleep(0.2)
            views = {j: requests.get(f"{base}/v1/jobs/{j}", headers=AUTH, timeout=10).json()
                     for j in (pull_id, push_id)}
            after = scrape(base)
        finally:
            up.stop()
    assert before.get("batchgate_ledger_up") == 1
    assert total(before, "batchgate_batches_committed_total") == 0
    assert total(after, "batchgate_batches_committed_total", stage="work") == views[pull_id]["batches"]["completed"] == 4
    assert total(after, "batchgate_batches_committed_total", stage="call") == views[push_id]["batches"]["completed"] == 5
    assert total(after, "batchgate_commit_seconds_count") == 9  # every commit timed
    calls = total(after, "batchgate_platform_calls_total", outcome="done")
    assert calls == len(platform.requests) == 5  # counted in the worker process, summed by the API
    assert total(after, "batchgate_platform_call_seconds_count") == 5
    assert total(after, "batchgate_platform_calls_in_flight") == 0
    assert total(after, "batchgate_jobs", status="succeeded") == 2
    assert total(after, "batchgate_batches_failed_total") == 0
    assert total(after, "batchgate_approvals_pending") == 0
    for name in after:  # bounded labels: no job id anywhere
        assert "job_" not in name, name


def wait_until(what, timeout_s: float, why: str = ""):
    deadline = time.monotonic() + timeout_s
    while not (got := what()):
        assert time.monotonic() < deadline, why
        time.sleep(0.1)
    return got


def scrape_when(base: str, ready, timeout_s: float, why: str) -> dict[str, float]:
    """The first scrape for which ``ready(sample)`` holds."""
    def attempt():
        sample = scrape(base)
        return sample if ready(sample) else None

    return wait_until(attempt, timeout_s, why)


def test_failures_retries_expiries_calls_in_flight_and_deliveries_move_their_metrics(tmp_path):
    """The counters for what goes wrong, and the gauges for what is under way, on a real `up`: a push
    call scraped while the platform holds it; a pull job whose batches are failed (once retryably, once
    for good) and left to expire; a subscriber that hears of both jobs' ends. Each counter equals what the
    job's view and log say happened."""
    from tests.test_webhooks import Receiver

    data, port = tmp_path / "data", free_port()
    base = f"http://127.0.0.1:{port}"
    receiver = Receiver()
    with FakeHttpPlatform() as platform:
        platform.slow_s = 3.0
        platform.plan("slow")  # the first call is held 3 s
        up = start(tmp_path, data, port, "up")
        try:
            sub = requests.post(f"{base}/v1/subscriptions", headers=AUTH, timeout=10,
                                json={"url": receiver.url, "events": ["job.succeeded", "job.failed"]})
            assert sub.status_code == 201, sub.text
            receiver.secret = sub.json()["secret"]
            push = {"id": "push", "version": "1", "batching": {"max_items": 2},
                    "source": {"type": "sequence", "count": 2},
                    "stages": [{"name": "call", "target": {"type": "http", "url": platform.url,
                                                            "mode": "sync"}}]}
            flaky = {"id": "flaky", "version": "1", "batching": {"max_items": 1},
                     "source": {"type": "sequence", "count": 2},
                     "stages": [{"name": "work", "lease": 1,
                                 "retry": {"initial_interval": 0.1, "maximum_attempts": 5}}]}
            for flow in (push, flaky):
                resp = requests.post(f"{base}/v1/flows", json=flow, headers=AUTH, timeout=10)
                assert resp.status_code == 201, resp.text
            push_id = requests.post(f"{base}/v1/jobs", json={"flow_id": "push"}, headers=AUTH,
                                    timeout=10).json()["job_id"]
            # the call under way, counted by the worker process and read through the API's scrape
            during = scrape_when(base, lambda m: total(m, "batchgate_platform_calls_in_flight") == 1, 10,
                                 "no call in flight")
            assert total(during, "batchgate_jobs", status="running") == 1

            flaky_id = requests.post(f"{base}/v1/jobs", json={"flow_id": "flaky"}, headers=AUTH,
                                     timeout=10).json()["job_id"]
            jobs = f"{base}/v1/jobs/{flaky_id}"

            def lease() -> dict:
                got = wait_until(lambda: (r := requests.post(f"{jobs}/lease", headers=AUTH, timeout=10))
                                 .status_code == 200 and r.json(), 15, "nothing to lease")
                return got

            def fail(got: dict, retryable: bool) -> None:
                resp = requests.post(f"{jobs}/batches/{got['seq']}/fail", headers=AUTH, timeout=10,
                                     json={"lease_token": got["lease_token"],
                                           "error": {"message": "model said no", "retryable": retryable}})
                assert resp.status_code == 200, resp.text

            fail(lease(), retryable=True)  # retried
            lease()  # held past its 1 s lease: the supervisor expires it, and it is retried
            scrape_when(base, lambda m: total(m, "batchgate_lease_expiries_total", stage="work") == 1, 15,
                        "the lease never expired")
            fail(lease(), retryable=False)  # failed for good
            while (r := requests.post(f"{jobs}/lease", headers=AUTH, timeout=10)).status_code == 200:
                requests.post(f"{jobs}/batches/{r.json()['seq']}/complete", headers=AUTH, timeout=10,
                              json={"lease_token": r.json()["lease_token"], "output": {}})
            views = {j: wait_until(lambda j=j: (v := requests.get(f"{base}/v1/jobs/{j}", headers=AUTH,
                                                                   timeout=10).json())["status"]
                                   in ("succeeded", "failed") and v, 30, f"{j} never ended")
                     for j in (push_id, flaky_id)}
            wait_until(lambda: len({b["data"]["job_id"] for _, b in receiver.got}) == 2, 30,
                       "the subscriber did not hear of both jobs")
            after = scrape_when(base, lambda m: total(m, "batchgate_webhook_deliveries_total",
                                                      outcome="delivered") >= 2, 15, "deliveries not counted")
            log = requests.get(f"{jobs}/log", headers=AUTH, timeout=10).json()["entries"]
        finally:
            up.stop()
            receiver.close()
    assert views[push_id]["status"] == "succeeded" and views[flaky_id]["status"] == "failed"
    assert total(after, "batchgate_platform_calls_in_flight") == 0
    assert total(after, "batchgate_platform_calls_total", outcome="done") == len(platform.requests) == 1
    retried = [e for e in log if e["event"] == "retry_scheduled"]
    expired = [e for e in retried if e.get("error") == "lease expired"]
    # a retry after a reported failure, one after the expiry, a failure for good: as the log says
    assert total(after, "batchgate_batches_retried_total", stage="work") == len(retried) - len(expired) == 1
    assert total(after, "batchgate_lease_expiries_total", stage="work", outcome="retry") == len(expired) == 1
    batches = views[flaky_id]["batches"]
    assert total(after, "batchgate_batches_failed_total", stage="work") == batches["failed"] == 1
    assert total(after, "batchgate_batches_committed_total", stage="work") == batches["completed"]
    assert total(after, "batchgate_jobs", status="failed") == 1 and total(after, "batchgate_jobs",
                                                                        status="succeeded") == 1
    assert receiver.bad == 0
    assert total(after, "batchgate_webhook_deliveries_total", outcome="delivered") == len(receiver.got) == 2
    for name in after:
        assert "job_" not in name, name


def test_a_crash_and_recovery_move_the_recovery_metrics(tmp_path):
    data, port = tmp_path / "data", free_port()
    base = f"http://127.0.0.1:{port}"
    up = start(tmp_path, data, port, "up")
    flow = {"id": "pull", "version": "1", "batching": {"max_items": 2},
            "source": {"type": "sequence", "count": 6}, "stages": [{"name": "work", "lease": 3}]}
    assert requests.post(f"{base}/v1/flows", json=flow, headers=AUTH, timeout=10).status_code == 201
    job_id = requests.post(f"{base}/v1/jobs", json={"flow_id": "pull"}, headers=AUTH,
                           timeout=10).json()["job_id"]
    lost = requests.post(f"{base}/v1/jobs/{job_id}/lease", headers=AUTH, timeout=10).json()
    assert lost["seq"] == 0
    assert up.stop(signal.SIGKILL) == -signal.SIGKILL  # the whole deployment dies (its children are tied)
    assert leftovers(data) == {}
    up = start(tmp_path, data, port, "up-again")
    try:
        deadline = time.monotonic() + 30
        while total(scrape(base), "batchgate_recoveries_total") < 1:
            assert time.monotonic() < deadline, up.output()
            time.sleep(0.2)
        # the batch the crash left leased comes back once its lease runs out (recovery decided at start
        # that the crash's leases belong to nobody; the supervisor expires them when due)
        deadline = time.monotonic() + 30
        while (view := requests.get(f"{base}/v1/jobs/{job_id}", headers=AUTH, timeout=10).json())[
                "status"] == "running":
            assert time.monotonic() < deadline, view
            r = requests.post(f"{base}/v1/jobs/{job_id}/lease", headers=AUTH, timeout=10)
            if r.status_code == 200:
                requests.post(f"{base}/v1/jobs/{job_id}/batches/{r.json()['seq']}/complete", headers=AUTH,
                              json={"lease_token": r.json()["lease_token"], "output": {}}, timeout=10)
            else:
                time.sleep(0.1)
        assert view["status"] == "succeeded" and view["batches"]["completed"] == 3
        deadline = time.monotonic() + 30
        while total(sample := scrape(base), "batchgate_recovered_jobs_finished_total", outcome="succeeded") < 1:
            assert time.monotonic() < deadline  # counted when the supervisor retires the job
            time.sleep(0.2)
    finally:
        up.stop()
    assert total(sample, "batchgate_recoveries_total") == 1
    assert total(sample, "batchgate_recovery_seconds_count") == 1
    assert total(sample, "batchgate_recovered_jobs_finished_total") == 1
    assert json.dumps(sample).count("job_") == 0


def test_the_grafana_dashboard_asks_only_for_metrics_batchgate_exports():
    """examples/grafana/batchgate-dashboard.json: every metric a panel's query names is one /metrics has."""
    from prometheus_client import REGISTRY

    from gateway import metrics  # noqa: F401 - registers the process metrics
    from gateway.api import metrics as scrape_side

    root = Path(__file__).resolve().parent.parent
    dashboard = json.loads((root / "examples" / "grafana" / "batchgate-dashboard.json").read_text())
    exported = {m.name for m in REGISTRY.collect()}
    source = (root / "gateway" / "api" / "metrics.py").read_text()
    exported |= set(re.findall(r'GaugeMetricFamily\("(batchgate_\w+)"', source))
    assert scrape_side.LedgerCollector  # the scrape-time side the regex read
    asked = {name for panel in dashboard["panels"] for target in panel["targets"]
             for name in re.findall(r"\b(batchgate_\w+?)(?:_total|_bucket|_count|_sum)?\b", target["expr"])}
    assert asked and asked <= exported, asked - exported
