"""Restarts, as real processes on real sockets against a real redis-server.

- ``batchgate serve`` whose gunicorn master is SIGKILLed while a request is in flight can be started
  again on the same port at once (gateway/runtime/gunicorn_conf.py), and the orphaned worker still finishes
  the request it was serving, then exits.
- The API while its Redis is down answers 503 problem+json with Retry-After, never a 500; once Redis is
  back (restarted from its AOF on the same socket), the same API process answers again.
- The supervisor started while Redis is down waits for it (no crash), then recovers and expires.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import redis
import requests

from gateway.ledger.embedded import EmbeddedRedis, client_for, free_port
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from tests.conftest import TOKEN
from tests.test_record_mode import crashed_generation

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="Linux process semantics")

AUTH = {"Authorization": f"Bearer {TOKEN}"}
FLOW = {"id": "restart", "version": "1", "stages": [{"name": "s", "lease": 0.5}],
        "source": {"type": "sequence", "count": 6}, "batching": {"max_items": 2}}


def env_for(redis_url: str, data_dir: Path, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
    env.update(BATCHGATE_REDIS_URL=redis_url, BATCHGATE_DATA_DIR=str(data_dir), BATCHGATE_HOST="127.0.0.1",
               BATCHGATE_TOKENS=json.dumps({TOKEN: "acme"}), BATCHGATE_LOG_LEVEL="INFO", **extra)
    return env


class Proc:
    """A ``batchgate`` command in its own process group, output in a file; killed with its group."""

    def __init__(self, tmp_path: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        env = dict(env)
        self.log_path = tmp_path / f"{name}.log"
        self.instance = env["BATCHGATE_INSTANCE_ID"] = f"{name}-{os.urandom(4).hex()}"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", *args], env=env, stdout=log,
                                         stderr=subprocess.STDOUT, start_new_session=True)

    def output(self) -> str:
        return self.log_path.read_text()

    def group(self) -> list[int]:
        """Live members of the process group (gunicorn workers stay in it when the master dies)."""
        members = []
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit():
                try:
                    fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                except OSError:
                    continue
                if int(fields[2]) == self.proc.pid and fields[0] != "Z":
                    members.append(int(entry.name))
        return members

    def kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.proc.wait(10)


def wait_healthy(proc: Proc, port: int, timeout_s: float) -> float:
    """Seconds until GET /healthz answers 200 from ``proc`` itself (its BATCHGATE_INSTANCE_ID: not an
    orphaned worker of an earlier server still accepting); fails if ``proc`` exits or time runs out."""
    started = time.monotonic()
    while time.monotonic() - started < timeout_s:
        assert proc.proc.poll() is None, f"exited with {proc.proc.returncode}:\n{proc.output()}"
        try:
            resp = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
            if resp.status_code == 200 and resp.json().get("instance") == proc.instance:
                return time.monotonic() - started
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise AssertionError(f"not healthy within {timeout_s} s:\n{proc.output()}")


def test_serve_starts_again_at_once_after_its_master_is_sigkilled(redis_server, redis_client, tmp_path):
    port = free_port()
    env = env_for(redis_server.url, tmp_path / "data")
    first = Proc(tmp_path, "serve-1", ["serve", "--port", str(port), "--workers", "2"], env)
    second = None
    try:
        wait_healthy(first, port, 30)
        base = f"http://127.0.0.1:{port}"
        requests.post(f"{base}/v1/flows", json=FLOW, headers=AUTH, timeout=5).raise_for_status()
        job_id = requests.post(f"{base}/v1/jobs", json={"flow_id": "restart"}, headers=AUTH,
                               timeout=5).json()["job_id"]
        # A request that stays in flight for 5 s: a lease waits (LEASE_PATIENCE_S) for the holder of the
        # job's plan lock to cut a batch, which here never comes.
        ledger = Ledger(redis_client, Settings(redis_url=redis_server.url))
        redis_client.set(ledger.keys.job(job_id).plan_lock, "someone", px=60_000)
        answers: list = []

        def in_flight():
            try:
                answers.append(requests.post(f"{base}/v1/jobs/{job_id}/lease", json={}, headers=AUTH,
                                             timeout=30).status_code)
            except requests.RequestException as exc:
                answers.append(type(exc).__name__)

        caller = threading.Thread(target=in_flight)
        caller.start()
        time.sleep(0.5)
        workers = [pid for pid in first.group() if pid != first.proc.pid]
        assert len(workers) == 2, first.group()
        os.kill(first.proc.pid, signal.SIGKILL)
        first.proc.wait(5)
        killed = time.monotonic()
        second = Proc(tmp_path, "serve-2", ["serve", "--port", str(port), "--workers", "2"], env)
        wait_healthy(second, port, 30)
        took = time.monotonic() - killed
        # Before gateway/runtime/gunicorn_conf.py the orphans held the port until their request in flight ended
        # (about 4.5 s after the kill; up to graceful_timeout, 30 s, in general): the new master's bind
        # failed ("Connection in use"), and gunicorn gives up after 5 tries a second apart. Now its
        # first bind succeeds; the time to answer is then the workers' boot (loose bound: a busy machine).
        assert "Connection in use" not in second.output(), second.output()
        assert took < 15.0, f"serve took {took:.1f} s to answer again:\n{second.output()}"
        # the orphaned worker finished the request it was serving: an answer, not a reset
        caller.join(15)
        assert answers == [204]
        deadline = time.monotonic() + 10
        while any(Path(f"/proc/{pid}").exists() and _alive(pid) for pid in workers):
            assert time.monotonic() < deadline, "orphaned gunicorn workers did not exit"
            time.sleep(0.1)
        assert requests.get(f"{base}/v1/jobs/{job_id}", headers=AUTH, timeout=5).status_code == 200
    finally:
        first.kill_group()
        if second is not None:
            second.kill_group()


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _problem_503(resp: requests.Response) -> None:
    assert resp.status_code == 503, (resp.status_code, resp.text)
    assert resp.headers["Content-Type"] == "application/problem+json"
    assert int(resp.headers["Retry-After"]) >= 1
    body = resp.json()
    assert body["status"] == 503 and body["type"] == "https://batchgate.dev/problems/ledger-unavailable"
    assert "Traceback" not in resp.text and "unix://" not in resp.text


def test_api_answers_503_while_redis_is_down_and_recovers_without_a_restart(tmp_path):
    """A real gunicorn API on a real redis-server that is SIGKILLed, then started again from its AOF on
    the same socket: meanwhile every route answers 503 problem+json with Retry-After (never a 500);
    afterwards the same API process serves again."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    server.kill()  # the API starts while its Redis is down: it waits, answering 503
    port = free_port()
    api = Proc(tmp_path, "serve", ["serve", "--port", str(port), "--workers", "2"],
               env_for(url, tmp_path / "data"))
    base = f"http://127.0.0.1:{port}"
    s = requests.Session()
    s.headers.update(AUTH)
    try:
        deadline = time.monotonic() + 30
        while True:
            assert api.proc.poll() is None, api.output()
            try:
                resp = requests.get(f"{base}/healthz", timeout=5)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline, api.output()
                time.sleep(0.1)
        for _ in range(4):
            _problem_503(requests.get(f"{base}/healthz", timeout=5))
            _problem_503(requests.get(f"{base}/v1/jobs", headers=AUTH, timeout=5))
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        wait_healthy(api, port, 10)
        s.post(f"{base}/v1/flows", json=FLOW, timeout=5).raise_for_status()
        job_id = s.post(f"{base}/v1/jobs", json={"flow_id": "restart"}, timeout=5).json()["job_id"]
        env = s.post(f"{base}/v1/jobs/{job_id}/lease", json={}, timeout=10).json()
        server.kill()
        calls = [
            ("get", "/healthz", None),
            ("get", f"/v1/jobs/{job_id}", None),
            ("get", "/v1/jobs", None),
            ("get", f"/v1/jobs/{job_id}/log", None),
            ("post", "/v1/flows", {**FLOW, "id": "other"}),
            ("post", "/v1/jobs", {"flow_id": "restart"}),
            ("post", f"/v1/jobs/{job_id}/lease", {}),
            ("post", f"/v1/jobs/{job_id}/batches/{env['seq']}/heartbeat",
             {"lease_token": env["lease_token"]}),
            ("post", f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
             {"lease_token": env["lease_token"], "output": {"n": 2}}),
            ("post", f"/v1/jobs/{job_id}/pause", {}),
        ]
        for _ in range(2):  # every worker and thread: each call on a fresh connection
            for method, path, body in calls:
                resp = requests.request(method, base + path, json=body, headers=AUTH, timeout=10)
                _problem_503(resp)
                assert resp.json()["title"] == "Ledger unavailable"
        # an idempotent create while the ledger is down is not remembered as failed
        resp = s.post(f"{base}/v1/jobs", json={"flow_id": "restart"}, headers={"Idempotency-Key": "k1"},
                      timeout=10)
        _problem_503(resp)
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        deadline = time.monotonic() + 10
        while requests.get(f"{base}/healthz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the API did not reconnect"
            time.sleep(0.1)
        for _ in range(4):  # fresh connections reach both workers
            view = requests.get(f"{base}/v1/jobs/{job_id}", headers=AUTH, timeout=5).json()
            assert view["status"] == "running"
        done = s.post(f"{base}/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                      json={"lease_token": env["lease_token"], "output": {"n": 2}}, timeout=10)
        assert done.status_code == 200, done.text  # the ledger's scripts are loaded again by themselves
        created = s.post(f"{base}/v1/jobs", json={"flow_id": "restart"}, headers={"Idempotency-Key": "k1"},
                         timeout=10)
        assert created.status_code == 201, created.text
        assert " 500 " not in api.output() and "Traceback" not in api.output()
        assert api.proc.poll() is None
    finally:
        api.kill_group()
        server.stop()


def _events(client, ledger, job_id, name):
    return [f for _, f in client.xrange(ledger.keys.job(job_id).log) if f["event"] == name]


def _wait_for(what: str, check, proc: Proc, timeout_s: float = 15.0):
    deadline = time.monotonic() + timeout_s
    while True:
        assert proc.proc.poll() is None, f"exited with {proc.proc.returncode}:\n{proc.output()}"
        try:
            found = check()
        except (redis.ConnectionError, redis.TimeoutError):
            found = None
        if found:
            return found
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n{proc.output()}"
        time.sleep(0.1)


def test_supervisor_started_while_redis_is_down_waits_then_recovers_and_survives_restarts(tmp_path):
    """`batchgate supervisor` as a process: started with its Redis down it waits (no crash); once Redis is
    back (from its AOF, same socket) it recovers the job left running (expires its dead lease); Redis
    SIGKILLed and restarted again under it, its ticks go on (the next dead lease expires too)."""
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService

    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    settings = Settings(redis_url=url, data_dir=tmp_path / "data")
    client = client_for(url)
    ledger = Ledger(client, settings)
    registry = FlowRegistry(client, ledger.keys)
    registry.register("acme", parse_flow(FLOW))
    job_id = JobService(ledger, registry).create("acme", JobRequest(flow_id="restart"))["job_id"]
    first = ledger.lease(job_id)  # its worker dies: the lease (0.5 s) is left to run out
    crashed_generation(ledger)  # with the rest of the deployment: the supervisor's start is a restart
    server.kill()
    sup = Proc(tmp_path, "supervisor", ["supervisor"],
               env_for(url, tmp_path / "data", BATCHGATE_SUPERVISOR_INTERVAL="0.2"))
    try:
        time.sleep(2.0)
        assert sup.proc.poll() is None, f"the supervisor exited with Redis down:\n{sup.output()}"
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        recovered = _wait_for("recovery", lambda: _events(client, ledger, job_id, "job_recovered"), sup)
        assert recovered[0]["actor"].startswith("supervisor@")
        _wait_for("the dead lease expired", lambda: [
            e for e in _events(client, ledger, job_id, "retry_scheduled") if e["seq"] == str(first.seq)], sup)
        # Redis goes away and comes back under the running supervisor
        server.kill()
        time.sleep(1.0)
        assert sup.proc.poll() is None, sup.output()
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        time.sleep(0.6)  # the first lease's retry backoff
        second = _wait_for("a new lease", lambda: ledger.lease(job_id), sup)
        _wait_for("the second dead lease expired", lambda: [
            e for e in _events(client, ledger, job_id, "retry_scheduled")
            if (e["seq"], e["attempt"]) == (str(second.seq), str(second.attempt))], sup)
        assert "Traceback" not in sup.output()
        assert "unavailable" in sup.output()
        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(15) == 0
    finally:
        sup.kill_group()
        client.close()
        server.stop()
