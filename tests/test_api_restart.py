"""A restart of the API refuses no callback when its listening socket outlives it.

Issue 15: callbacks that arrived while the API restarted were refused; platforms post a callback once,
so each became a paid re-run. With socket activation (systemd's ``LISTEN_FDS``: the service manager
holds the listening socket, gunicorn takes it over), connections that arrive between the old server's
exit and the new one's first accept wait in the kernel's backlog. Here the test plays the service
manager: it holds the socket and starts ``batchgate serve`` on it three times, right after a SIGTERM (a
deploy) and after a SIGKILL of the gunicorn master (a crash), while a platform that posts each callback
once, never retrying, keeps posting.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests

from gateway.runtime import procs
from tests.conftest import TOKEN
from tests.platforms import OnceCallbackPlatform

pytestmark = [pytest.mark.slow, pytest.mark.skipif(not sys.platform.startswith("linux"),
                                                   reason="socket activation as on Linux")]

BATCHES = 120
ACTIVATE = ("import os, sys; os.dup2(int(sys.argv[1]), 3); "
            "os.environ.update(LISTEN_PID=str(os.getpid()), LISTEN_FDS='1'); "
            "os.execv(sys.executable, [sys.executable, '-P', '-m', 'gateway.runtime.cli', 'serve', "
            "'--workers', '2'])")


def activated_serve(listener: socket.socket, env: dict[str, str], log: Path) -> subprocess.Popen:
    """``batchgate serve`` as a service manager starts it: the socket on fd 3, LISTEN_PID/LISTEN_FDS."""
    fd = listener.fileno()
    with open(log, "a") as out:
        return subprocess.Popen([sys.executable, "-c", ACTIVATE, str(fd)], env=env, pass_fds=(fd,),
                                stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def healthy(base: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert proc.poll() is None, log.read_text()
        try:
            if requests.get(f"{base}/healthz", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.05)
    raise AssertionError(log.read_text())


def test_restarts_of_a_socket_activated_api_refuse_no_callback(redis_server, tmp_path):
    listener = socket.create_server(("127.0.0.1", 0), backlog=512)
    base = f"http://127.0.0.1:{listener.getsockname()[1]}"
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
    env.update(BATCHGATE_REDIS_URL=redis_server.url, BATCHGATE_DATA_DIR=str(tmp_path / "data"),
               BATCHGATE_TOKENS=json.dumps({TOKEN: "acme"}), BATCHGATE_PUBLIC_URL=base,
               BATCHGATE_SIGNING_KEY="k" * 32, BATCHGATE_OUTBOUND_ALLOW='["127.0.0.1/32"]',
               BATCHGATE_CALLBACK_GRACE="2", BATCHGATE_SUPERVISOR_INTERVAL="0.2",
               BATCHGATE_LOG_LEVEL="WARNING", BATCHGATE_HOST="127.0.0.1")
    platform = OnceCallbackPlatform(0.2, 1.0, seed=3)
    log = tmp_path / "serve.log"
    children: list[subprocess.Popen] = []
    api = requests.Session()
    # a new connection per request, as the platform's callbacks: a kept-alive one to the server just
    # killed would be reset, which says nothing about the listening socket
    api.headers.update(Authorization=f"Bearer {TOKEN}", Connection="close")
    flow = {"id": "cb", "version": "1", "batching": {"max_items": 1}, "concurrency": 12,
            "source": {"type": "sequence", "count": BATCHES},
            # the lease must outlast a restart of the API: with 8 s, a run on a loaded 2-core machine (load
            # average 8) took longer than that to bring serve back, the supervisor expired 12 leases and
            # their callbacks, held in the backlog meanwhile, met a re-dispatched attempt (409)
            "stages": [{"name": "score", "lease": 30, "idempotent": False,
                        "target": {"type": "http", "url": platform.url, "mode": "callback",
                                   "max_in_flight": 12}}]}
    try:
        serve = activated_serve(listener, env, log)
        children.append(serve)
        healthy(base, serve, log)
        children += [procs.start_supervisor(env), procs.start_worker(env, concurrency=12)]
        assert api.post(f"{base}/v1/flows", json=flow).status_code == 201
        job_id = api.post(f"{base}/v1/jobs", json={"flow_id": "cb"}).json()["job_id"]

        def committed() -> int:
            return api.get(f"{base}/v1/jobs/{job_id}", timeout=30).json()["batches"]["completed"]

        for at, sig in ((30, signal.SIGTERM), (70, signal.SIGKILL)):
            while committed() < at:
                time.sleep(0.05)
            # the deploy (SIGTERM to all), then the crash of the master (its workers stop gracefully:
            # PR_SET_PDEATHSIG); callbacks keep coming meanwhile. (A SIGKILL of every process would reset
            # the requests they were in the middle of, as any crash does.)
            (os.killpg if sig == signal.SIGTERM else os.kill)(serve.pid, sig)
            serve.wait(30)
            serve = activated_serve(listener, env, log)
            children.append(serve)
        deadline = time.monotonic() + 120
        while (view := api.get(f"{base}/v1/jobs/{job_id}", timeout=30).json())["status"] == "running":
            assert time.monotonic() < deadline, view
            time.sleep(0.1)
    finally:
        platform.close()
        for proc in children:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        listener.close()
    assert view["status"] == "succeeded" and view["batches"]["completed"] == BATCHES, view
    assert set(platform.posted) == {200}, platform.posted  # not one refused, reset or lost
    assert len(platform.runs) == BATCHES
    assert not platform.reruns(), f"paid re-runs: {platform.reruns()}"
