"""One ledger per deployment, through the CLI as real processes.

Only ``batchgate up`` starts an embedded Redis; ``serve``, ``supervisor`` and ``worker`` without
BATCHGATE_REDIS_URL join the Redis a running ``up`` recorded in the data dir, or refuse (exit 2).
``up`` refuses a taken port before starting anything, and leaves nothing running once it stops.
Processes are found through /proc: every process of a deployment has its BATCHGATE_DATA_DIR in its
environment, and its redis-server works in that folder.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from gateway.runtime import procs
from gateway.ledger.embedded import free_port

pytestmark = pytest.mark.skipif(not Path("/proc/self/environ").exists(), reason="reads /proc")

TOKEN = "t-deploy-0123456789"
FLOW = {"id": "shared", "version": "1", "stages": [{"name": "s"}],
        "source": {"type": "sequence", "count": 3}}
STARTED: list[Path] = []  # data dirs of this module's deployments, cleaned up whatever happens


def batchgate(*args: str) -> list[str]:
    return [sys.executable, "-m", "gateway.runtime.cli", *args]


def bg_env(data_dir: Path, **extra: str) -> dict[str, str]:
    """The test's environment without any BATCHGATE_ setting, then this deployment's."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
    env.update(BATCHGATE_DATA_DIR=os.path.realpath(data_dir), BATCHGATE_HOST="127.0.0.1",
               BATCHGATE_TOKENS=json.dumps({TOKEN: "acme"}), BATCHGATE_LOG_LEVEL="WARNING",
               BATCHGATE_SUPERVISOR_INTERVAL="0.2")
    env.update(extra)
    return env


def processes(data_dir: Path) -> dict[int, str]:
    """pid -> command line of every live process of the deployment on ``data_dir``."""
    target = os.path.realpath(data_dir)
    marker = f"BATCHGATE_DATA_DIR={target}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            if (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] == "Z":
                continue
            environ = (entry / "environ").read_bytes().split(b"\0")
            cwd = os.readlink(entry / "cwd")
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            comm = (entry / "comm").read_text().strip()
        except (OSError, IndexError):
            continue
        if marker in environ or (comm == "redis-server" and cwd == target):
            found[int(entry.name)] = f"{comm}: {cmdline}"
    return found


def redis_servers(data_dir: Path) -> list[int]:
    return [pid for pid, cmd in processes(data_dir).items() if cmd.startswith("redis-server")]


def leftovers(data_dir: Path, timeout_s: float = 5.0) -> dict[int, str]:
    """What still runs for ``data_dir`` after a short grace (zombies being reaped)."""
    deadline = time.monotonic() + timeout_s
    while (found := processes(data_dir)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return found


@pytest.fixture(autouse=True)
def _kill_leftovers():
    """A failing test must not leave a deployment running: SIGKILL what it started."""
    yield
    while STARTED:
        for pid in processes(STARTED.pop()):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


class Proc:
    """A batchgate command running in the background, output in a file."""

    def __init__(self, tmp_path: Path, name: str, args: list[str], env: dict[str, str]) -> None:
        STARTED.append(Path(env["BATCHGATE_DATA_DIR"]))
        self.log_path = tmp_path / f"{name}.log"
        with open(self.log_path, "w") as log:
            self.proc = subprocess.Popen(batchgate(*args), env=env, stdout=log, stderr=subprocess.STDOUT,
                                         cwd=tmp_path)

    def output(self) -> str:
        return self.log_path.read_text()

    def wait_healthy(self, port: int, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, f"exited with {self.proc.returncode}:\n{self.output()}"
            try:
                resp = requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1)
                if resp.status_code == 200:
                    return resp.json()
            except requests.RequestException:
                pass
            time.sleep(0.1)
        raise AssertionError(f"not healthy on port {port}:\n{self.output()}")

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 30.0) -> int:
        self.proc.send_signal(sig)
        return self.proc.wait(timeout_s)


def run(tmp_path: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    STARTED.append(Path(env["BATCHGATE_DATA_DIR"]))
    return subprocess.run(batchgate(*args), env=env, capture_output=True, text=True, timeout=60,
                          cwd=tmp_path)


def start_up(tmp_path: Path, data_dir: Path, port: int, name: str = "up") -> Proc:
    up = Proc(tmp_path, name, ["up", "--port", str(port)], bg_env(data_dir))
    health = up.wait_healthy(port)
    assert health.get("instance"), "up's API did not report its instance id"
    deadline = time.monotonic() + 10
    while not ("API on" in up.output() and len(processes(data_dir)) >= 5):
        assert time.monotonic() < deadline, up.output()
        time.sleep(0.1)
    return up


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["supervisor"], ["worker", "--burst"]])
def test_serve_supervisor_and_worker_refuse_without_a_redis_to_join(tmp_path, command):
    data = tmp_path / "data"
    if command[0] == "serve":
        command = ["serve", "--port", str(free_port())]
    result = run(tmp_path, bg_env(data), *command)
    assert result.returncode == 2, result.stderr
    assert "batchgate up" in result.stderr and "BATCHGATE_REDIS_URL" in result.stderr
    assert str(data.resolve()) in result.stderr and "Traceback" not in result.stderr
    assert not (data / "redis.json").exists()
    assert leftovers(data, timeout_s=0) == {}


def test_serve_and_worker_join_the_redis_of_a_running_up(tmp_path):
    data = tmp_path / "data"
    up_port, serve_port = free_port(), free_port()
    up = start_up(tmp_path, data, up_port)
    serve = Proc(tmp_path, "serve", ["serve", "--port", str(serve_port), "--workers", "2"], bg_env(data))
    try:
        assert "instance" not in serve.wait_healthy(serve_port)
        auth = {"Authorization": f"Bearer {TOKEN}"}
        first, second = f"http://127.0.0.1:{up_port}", f"http://127.0.0.1:{serve_port}"
        assert requests.post(f"{first}/v1/flows", json=FLOW, headers=auth, timeout=5).status_code == 201
        other = {**FLOW, "id": "from-serve"}
        assert requests.post(f"{second}/v1/flows", json=other, headers=auth, timeout=5).status_code == 201
        for base in (first, second) * 4:  # fresh connections: every gunicorn worker of both servers
            listed = requests.get(f"{base}/v1/flows", headers=auth, timeout=5).json()
            ids = {f["flow"]["id"] for f in listed["flows"]}
            assert {"shared", "from-serve"} <= ids, (base, listed)
        assert len(redis_servers(data)) == 1
        burst = run(tmp_path, bg_env(data), "worker", "--burst")
        assert burst.returncode == 0, burst.stderr
    finally:
        serve_code = serve.stop()
        up_code = up.stop()
    assert serve_code == 0 and up_code == 0, up.output()
    assert leftovers(data) == {}
    assert not (data / "redis.json").exists()


def test_serve_beside_up_takes_ups_development_token_and_the_cli_uses_the_public_url(tmp_path):
    """No BATCHGATE_TOKENS: `up` keeps a development token in its data folder; a `serve` started beside it
    on the same folder takes that token too (it answered 401), and the CLI's job commands go to
    BATCHGATE_PUBLIC_URL (they went to HOST:PORT)."""
    data = tmp_path / "data"
    up_port, serve_port = free_port(), free_port()
    env = {k: v for k, v in bg_env(data).items() if k != "BATCHGATE_TOKENS"}
    up = Proc(tmp_path, "up", ["up", "--port", str(up_port)], env)
    serve = None
    try:
        up.wait_healthy(up_port)
        token = (data / "dev-token").read_text().strip()
        serve = Proc(tmp_path, "serve", ["serve", "--port", str(serve_port), "--workers", "1"], env)
        serve.wait_healthy(serve_port)
        auth = {"Authorization": f"Bearer {token}"}
        for port in (up_port, serve_port):
            resp = requests.get(f"http://127.0.0.1:{port}/v1/flows", headers=auth, timeout=5)
            assert resp.status_code == 200, (port, resp.text)
            resp = requests.get(f"http://127.0.0.1:{port}/v1/flows", headers={"Authorization": "Bearer x"},
                                timeout=5)
            assert resp.status_code == 401
        # BATCHGATE_PORT points nowhere; the public URL is the serve process: the CLI must use it
        cli_env = {**env, "BATCHGATE_PORT": str(free_port()),
                   "BATCHGATE_PUBLIC_URL": f"http://127.0.0.1:{serve_port}"}
        result = run(tmp_path, cli_env, "jobs", "list")
        assert result.returncode == 0, result.stderr
    finally:
        if serve is not None:
            assert serve.stop() == 0, serve.output()
        assert up.stop() == 0, up.output()
    assert leftovers(data) == {}


def test_up_refuses_a_port_in_use_before_starting_anything(tmp_path):
    data = tmp_path / "data"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = run(tmp_path, bg_env(data), "up", "--port", str(port))
    assert result.returncode == 2, result.stderr
    assert f"port {port} on 127.0.0.1 is in use" in result.stderr and "--port" in result.stderr
    assert "API on" not in result.stdout
    assert not data.exists(), "up started something before checking its port"
    assert leftovers(data, timeout_s=0) == {}


def test_a_second_up_on_a_taken_port_or_data_dir_refuses_and_sigterm_stops_everything(tmp_path):
    data, other = tmp_path / "data", tmp_path / "other"
    port = free_port()
    up = start_up(tmp_path, data, port)
    running = processes(data)
    try:
        for part in ("redis-server", "gunicorn", "gateway.runtime.cli supervisor", "gateway.runtime.cli worker"):
            assert any(part in cmd for cmd in running.values()), (part, running)
        same_port = run(tmp_path, bg_env(other), "up", "--port", str(port))
        assert same_port.returncode == 2 and f"port {port}" in same_port.stderr, same_port.stderr
        assert "API on" not in same_port.stdout
        assert leftovers(other, timeout_s=0) == {} and not (other / "redis.json").exists()
        same_dir = run(tmp_path, bg_env(data), "up", "--port", str(free_port()))
        assert same_dir.returncode == 2 and "another `batchgate up`" in same_dir.stderr, same_dir.stderr
        assert len(redis_servers(data)) == 1
        assert up.wait_healthy(port)["status"] == "ok"
    finally:
        code = up.stop(signal.SIGTERM)
    assert code == 0, up.output()
    assert leftovers(data) == {}
    assert all(not Path(f"/proc/{pid}").exists() or "Z" in Path(f"/proc/{pid}/stat").read_text()
               for pid in running), running


def test_up_stops_the_rest_and_fails_when_a_child_dies(tmp_path):
    data = tmp_path / "data"
    up = start_up(tmp_path, data, free_port())
    supervisor = [pid for pid, cmd in processes(data).items() if "gateway.runtime.cli supervisor" in cmd]
    assert len(supervisor) == 1
    os.kill(supervisor[0], signal.SIGKILL)
    assert up.proc.wait(30) == 1
    assert "supervisor exited" in up.output()
    assert leftovers(data) == {}
    assert not (data / "redis.json").exists()


# a SIGKILLed `up` taking every child along: tests/test_children.py (with the bound and the import path)


class _Health(BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802
        body = json.dumps({"status": "ok", "instance": "someone-else"}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def test_wait_healthy_knows_its_own_api_from_another_server_and_a_dead_one():
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Health)
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_port}"
    try:
        procs.wait_healthy(base, timeout_s=5, instance_id="someone-else")
        with pytest.raises(RuntimeError, match="another server"):
            procs.wait_healthy(base, timeout_s=5, instance_id="mine")
    finally:
        server.shutdown()
        server.server_close()
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    dead.wait()
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="exited with code 3"):
        procs.wait_healthy(f"http://127.0.0.1:{free_port()}", timeout_s=10, instance_id="x", proc=dead)
    assert time.monotonic() - started < 2
