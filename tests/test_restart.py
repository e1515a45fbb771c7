"""Restarts, as real processes on real sockets against a real redis-server.

- ``batchgate serve`` whose gunicorn master is SIGKILLed while a request is in flight can be started
  again on the same port at once (gateway/gunicorn_conf.py), and the orphaned worker still finishes
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
import requests

from gateway.embedded import EmbeddedRedis, client_for, free_port
from gateway.ledger import Ledger
from gateway.settings import Settings
from tests.conftest import TOKEN

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
            self.proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", *args], env=env, stdout=log,
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
        # the orphans held the port until their in-flight request ended (about 4.5 s from the kill), and
        # gunicorn gives up binding after 5 tries a second apart: the fix is what makes this quick
        assert took < 4.0, f"serve took {took:.1f} s to answer again:\n{second.output()}"
        assert "Connection in use" not in second.output()
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
