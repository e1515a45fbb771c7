"""Liveness and readiness as an orchestrator sees them, over real sockets and a Redis that goes away.

``/livez`` answers while the process serves; ``/readyz`` says whether this API can do its work (Redis,
the ledger's scripts, a live supervisor) and which check fails; ``batchgate health ROLE`` is the
container healthcheck of each process kind, reading the beats the supervisor and worker write.
"""

from __future__ import annotations

import threading
import time
from datetime import timedelta

import pytest
import requests

from gateway.api.app import create_app
from gateway.ledger.embedded import EmbeddedRedis, client_for
from gateway.ledger.ledger import Ledger
from gateway.ledger.liveness import Liveness
from gateway.push.supervisor import Supervisor
from gateway.runtime import cli
from gateway.settings import Settings
from tests.http import serve_app

INTERVAL = 0.1
READY_INTERVALS = 5  # a supervisor counts while its beat is younger than 0.5 s


@pytest.fixture
def stack(tmp_path):
    """A private Redis (stopped and started by the test), the app on a real socket, and a supervisor
    started and stopped at will."""
    server = EmbeddedRedis(tmp_path / "redis", fsync="always")
    url = server.start()
    settings = Settings(redis_url=url, data_dir=tmp_path / "data", tokens={"t-health-0123456789": "acme"},
                        supervisor_interval=timedelta(seconds=INTERVAL), ready_intervals=READY_INTERVALS)
    client = client_for(url)
    base, stop = serve_app(create_app(settings, client))

    class Stack:
        def __init__(self):
            self.server, self.url, self.settings, self.base = server, url, settings, base
            self.supervisor: Supervisor | None = None
            self.thread: threading.Thread | None = None

        def start_supervisor(self):
            self.supervisor = Supervisor(Ledger(client_for(url), settings), name="sup-test")
            self.thread = threading.Thread(target=self.supervisor.run, daemon=True)
            self.thread.start()

        def stop_supervisor(self):
            self.supervisor.stop.set()
            self.thread.join(15)
            assert not self.thread.is_alive()

        def kill_supervisor(self):
            """As SIGKILL would: the loop stops without a goodbye (its beat is left to age)."""
            self.supervisor.liveness.gone = lambda: None
            self.stop_supervisor()

        def get(self, path):
            return requests.get(self.base + path, timeout=10)

    s = Stack()
    try:
        yield s
    finally:
        if s.thread is not None and s.thread.is_alive():
            s.stop_supervisor()
        stop()
        s.server.stop()


def wait_for(check, timeout_s=10.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (got := check()):
            return got
        time.sleep(0.05)
    raise AssertionError("timed out")


def test_readyz_needs_a_live_supervisor_and_says_so(stack):
    resp = stack.get("/readyz")
    assert resp.status_code == 503
    body = resp.json()
    assert resp.headers["Content-Type"] == "application/problem+json"
    assert body["type"].endswith("/not-ready") and "batchgate supervisor" in body["detail"]
    assert body["checks"]["redis"]["ok"] and body["checks"]["scripts"]["ok"]
    assert not body["checks"]["supervisor"]["ok"]
    assert "batchgate supervisor" in body["checks"]["supervisor"]["detail"]
    assert stack.get("/livez").status_code == 200
    stack.start_supervisor()
    ready = wait_for(lambda: (r := stack.get("/readyz")).status_code == 200 and r.json())
    assert ready["status"] == "ready" and ready["checks"]["supervisor"]["alive"] == 1
    # a supervisor that dies (no goodbye) is noticed within ready_intervals supervisor intervals
    stack.kill_supervisor()
    died = time.monotonic()
    wait_for(lambda: stack.get("/readyz").status_code == 503)
    assert time.monotonic() - died <= READY_INTERVALS * INTERVAL + 1.0
    # a clean stop is noticed at once
    stack.start_supervisor()
    wait_for(lambda: stack.get("/readyz").status_code == 200)
    stack.stop_supervisor()
    assert stack.get("/readyz").status_code == 503


def test_redis_going_away_makes_readyz_unready_and_its_return_ready_again(stack):
    stack.start_supervisor()
    wait_for(lambda: stack.get("/readyz").status_code == 200)
    stack.server.kill()
    down = stack.get("/readyz")
    assert down.status_code == 503 and down.json()["checks"]["redis"]["ok"] is False
    assert "secret" not in down.text.lower() and stack.url not in down.text  # the URL is not shown
    assert stack.get("/livez").status_code == 200  # alive: no restart for a Redis outage
    stack.server = EmbeddedRedis(stack.server.data_dir, fsync="always")
    assert stack.server.start() == stack.url
    back = wait_for(lambda: (r := stack.get("/readyz")).status_code == 200 and r.json())
    assert back["checks"]["scripts"]["ok"]


def test_scripts_lost_by_redis_are_loaded_again_by_readyz(stack):
    stack.start_supervisor()
    wait_for(lambda: stack.get("/readyz").status_code == 200)
    client_for(stack.url).script_flush()
    body = stack.get("/readyz").json()
    assert body["checks"]["scripts"] == {"ok": True, "loaded_now": body["checks"]["scripts"]["loaded_now"]}
    assert body["checks"]["scripts"]["loaded_now"] > 10
    assert stack.get("/readyz").json()["checks"]["scripts"]["loaded_now"] == 0


def test_health_command_checks_each_role_like_a_container_healthcheck(stack, monkeypatch, capsys):
    for key, value in {"BATCHGATE_REDIS_URL": stack.url, "BATCHGATE_SUPERVISOR_INTERVAL": str(INTERVAL),
                       "BATCHGATE_READY_INTERVALS": str(READY_INTERVALS),
                       "BATCHGATE_PORT": stack.base.rsplit(":", 1)[1]}.items():
        monkeypatch.setenv(key, value)
    assert cli.main(["health", "supervisor"]) == 1
    assert "none alive" in capsys.readouterr().out
    stack.start_supervisor()
    wait_for(lambda: cli.main(["health", "supervisor"]) == 0)
    assert "1 alive" in capsys.readouterr().out
    # another host's supervisor does not make this container healthy, unless asked
    stack.stop_supervisor()
    Liveness(client_for(stack.url), Ledger(client_for(stack.url), stack.settings).keys,
             "supervisor").r.hset("bg:alive:supervisor", "elsewhere:1", int(time.time() * 1000))
    assert cli.main(["health", "supervisor"]) == 1
    assert cli.main(["health", "supervisor", "--any-host"]) == 0
    assert cli.main(["health", "worker"]) == 1
    assert cli.main(["health", "api"]) == 0
    assert cli.main(["health", "api", "--ready"]) == 0  # the other host's supervisor counts for the API
    stack.server.kill()
    capsys.readouterr()
    assert cli.main(["health", "supervisor"]) == 1
    assert "Redis does not answer" in capsys.readouterr().out
    assert cli.main(["health", "api"]) == 0 and cli.main(["health", "api", "--ready"]) == 1
