"""compose.yaml, as written, run as processes (this machine has no Docker daemon).

The file is parsed (anchors and merge keys as Compose reads them), checked for what a deployment needs
(Redis with AOF on a volume, a healthcheck and a restart policy on every long-running service, workers
scaled out), and then every service's own command, environment and healthcheck run here as processes:
the same redis-server binary with the compose file's arguments, `config` first (once), then the API,
the supervisor and each worker replica. Container addresses map to this machine: ``redis:6379`` to
the test's Redis, ``/config`` and ``/data`` to folders of their own, the API's 8080 to a free port.
A pull job and a push job (to a platform on 127.0.0.1) then run to success through that stack, with the
token the README's command prints. Where a Docker daemon answers, ``docker build`` is tried too.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from threading import Thread

import pytest
import redis
import requests
import yaml

from gateway.ledger.embedded import find_redis_server, free_port
from gateway.runtime import procs

pytestmark = pytest.mark.slow
ROOT = Path(__file__).resolve().parent.parent
COMPOSE = yaml.safe_load((ROOT / "compose.yaml").read_text())
SERVICES = COMPOSE["services"]
LONG_RUNNING = ("redis", "api", "supervisor", "worker")


def test_the_file_has_what_a_deployment_needs():
    redis_ = SERVICES["redis"]
    assert {"--appendonly", "yes"} <= set(redis_["command"])
    assert any(v.endswith(":/data") for v in redis_["volumes"]) and "redis-data" in COMPOSE["volumes"]
    for name in LONG_RUNNING:
        service = SERVICES[name]
        assert service["restart"] == "unless-stopped", name
        assert service["healthcheck"]["test"][0] == "CMD", name
    for name in ("api", "supervisor", "worker"):
        depends = SERVICES[name]["depends_on"]
        assert depends["redis"]["condition"] == "service_healthy"
        assert depends["config"]["condition"] == "service_completed_successfully"
        assert SERVICES[name]["environment"]["BATCHGATE_REDIS_URL"] == "redis://redis:6379/0"
        assert SERVICES[name]["environment"]["BATCHGATE_CONFIG_FILE"] == "/config/batchgate.json"
    assert SERVICES["worker"]["deploy"]["replicas"] >= 2
    assert SERVICES["api"]["ports"] == ["${BATCHGATE_HTTP_PORT:-8080}:8080"]
    assert any(v.endswith(":/data") for v in SERVICES["api"]["volumes"])  # the callback spool persists


def test_the_dockerfile_installs_dependencies_before_the_source_and_runs_as_a_user():
    lines = [ln.strip() for ln in (ROOT / "Dockerfile").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    order = [i for i, ln in enumerate(lines) if ln.startswith(("COPY", "RUN pip"))]
    steps = [lines[i] for i in order]
    assert steps[0] == "COPY requirements.txt ./" and steps[1].startswith("RUN pip install --no-cache-dir -r")
    assert all(not s.startswith("COPY gateway") for s in steps[:2])
    assert steps[-1] == "RUN pip install --no-cache-dir --no-deps ."
    assert "VOLUME /data" in lines and "USER batchgate" in lines
    healthcheck = next(ln for ln in lines if ln.startswith("HEALTHCHECK"))
    assert "8080" not in healthcheck and '"batchgate", "health", "api"' in healthcheck


def test_the_lock_files_pin_every_dependency_pyproject_names():
    """requirements.txt (the image) and constraints.txt (the venv, CI) pin what pyproject asks for;
    after a change there, run scripts/lock."""
    import tomllib

    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def pins(path: Path) -> dict[str, str]:
        out = {}
        for line in path.read_text().splitlines():
            if "==" in line and not line.lstrip().startswith("#"):
                name, version = line.split("==", 1)
                out[re.sub(r"[-_.]+", "-", name.strip().lower())] = version.split(";")[0].strip()
        return out

    for path, wanted in ((ROOT / "requirements.txt", project["dependencies"]),
                         (ROOT / "constraints.txt",
                          [*project["dependencies"], *project["optional-dependencies"]["test"]])):
        pinned = pins(path)
        for spec in map(Requirement, wanted):
            name = re.sub(r"[-_.]+", "-", spec.name.lower())
            assert name in pinned, f"{path.name} does not pin {name}: run scripts/lock"
            assert spec.specifier.contains(pinned[name], prereleases=True), (
                f"{path.name} pins {name}=={pinned[name]}, outside {spec.specifier}: run scripts/lock")


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker client")
def test_docker_build_where_a_daemon_answers():
    if subprocess.run(["docker", "info"], capture_output=True, timeout=30).returncode != 0:
        pytest.skip("no Docker daemon answers here")
    built = subprocess.run(["docker", "build", "-t", "batchgate:test", str(ROOT)], capture_output=True,
                           text=True, timeout=1200)
    assert built.returncode == 0, built.stderr[-3000:]


# -- the services as processes ---------------------------------------------------------------------

def interpolate(value: str, env: dict[str, str]) -> str:
    """Compose's ${VAR:-default} and ${VAR} (the forms the file uses)."""
    return re.sub(r"\$\{([A-Z_]+)(?::-([^}]*))?\}", lambda m: env.get(m.group(1), m.group(2) or ""), value)


class Stack:
    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.redis_port = free_port()
        self.api_port = free_port()
        self.procs: list[subprocess.Popen] = []

    def local(self, value: str) -> str:
        value = value.replace("redis://redis:6379", f"redis://127.0.0.1:{self.redis_port}")
        return value.replace("/config/", f"{self.tmp}/config/")

    def env(self, name: str, replica: int = 0) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
        env.update({k: self.local(interpolate(str(v), {})) for k, v in
                    (SERVICES[name].get("environment") or {}).items()})
        # the image's ENV (Dockerfile) with this machine's addresses
        env.update(BATCHGATE_HOST="127.0.0.1", BATCHGATE_DATA_DIR=str(self.tmp / f"{name}-{replica}-data"),
                   BATCHGATE_PORT=str(self.api_port), BATCHGATE_SUPERVISOR_INTERVAL="0.2",
                   BATCHGATE_LOG_LEVEL="WARNING", BATCHGATE_OUTBOUND_ALLOW='["127.0.0.1/32"]')
        return env

    @staticmethod
    def argv(command: list[str]) -> list[str]:
        assert command[0] == "batchgate"
        return [sys.executable, "-m", "gateway.runtime.cli", *command[1:]]

    def start(self, name: str, replica: int = 0) -> subprocess.Popen:
        argv = self.argv([self.local(c) for c in SERVICES[name]["command"]])
        log = open(self.tmp / f"{name}-{replica}.log", "w")  # noqa: SIM115 - the child keeps it
        proc = subprocess.Popen(argv, env=self.env(name, replica), cwd=self.tmp, start_new_session=True,
                                stdout=subprocess.DEVNULL, stderr=log)
        self.procs.append(proc)
        return proc

    def run(self, name: str, command: list[str]) -> subprocess.CompletedProcess:
        return subprocess.run(self.argv([self.local(c) for c in command]), env=self.env(name), cwd=self.tmp,
                              capture_output=True, text=True, timeout=60)

    def healthy(self, name: str, timeout_s: float = 40.0) -> None:
        test = SERVICES[name]["healthcheck"]["test"]
        deadline = time.monotonic() + timeout_s
        while (done := self.run(name, test[1:])).returncode != 0:
            assert time.monotonic() < deadline, (
                f"{name} never healthy: {done.stdout}{done.stderr}\n"
                + (self.tmp / f"{name}-0.log").read_text()[-2000:])
            time.sleep(0.3)


class Platform:
    def __init__(self) -> None:
        platform = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def do_POST(self) -> None:  # noqa: N802
                envelope = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)))
                platform.keys.append(envelope["idempotency_key"])
                body = json.dumps({"status": "succeeded", "output": {"n": len(envelope["items"])}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args) -> None:
                pass

        self.keys: list[str] = []
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/run"
        Thread(target=self.server.serve_forever, daemon=True).start()


def test_the_services_run_as_written_and_a_job_runs_through_them(tmp_path):
    stack = Stack(tmp_path)
    (tmp_path / "config").mkdir()
    platform = Platform()
    redis_args = [a for a in SERVICES["redis"]["command"][1:]]
    redis_proc = subprocess.Popen([find_redis_server(), *redis_args, "--port", str(stack.redis_port),
                                   "--bind", "127.0.0.1", "--dir", str(tmp_path), "--save", ""],
                                  stdout=subprocess.DEVNULL, start_new_session=True)
    stack.procs.append(redis_proc)
    try:
        client = redis.Redis(port=stack.redis_port, socket_timeout=1)
        deadline = time.monotonic() + 10
        while True:
            try:
                client.ping()
                break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)
        assert client.config_get("appendonly") == {"appendonly": "yes"}
        # config: once, to completion; a second run keeps the file
        first = stack.run("config", SERVICES["config"]["command"])
        assert first.returncode == 0, first.stderr
        config = (tmp_path / "config" / "batchgate.json").read_text()
        assert stack.run("config", SERVICES["config"]["command"]).returncode == 0
        assert (tmp_path / "config" / "batchgate.json").read_text() == config
        assert (tmp_path / "config" / "batchgate.json").stat().st_mode & 0o077 == 0
        for name in ("api", "supervisor"):
            stack.start(name)
        for replica in range(SERVICES["worker"]["deploy"]["replicas"]):
            stack.start("worker", replica)
        for name in ("api", "supervisor", "worker"):
            stack.healthy(name)
        ready = requests.get(f"http://127.0.0.1:{stack.api_port}/readyz", timeout=5)
        assert ready.status_code == 200, ready.text
        # the README's command for the token
        token = stack.run("config", [*SERVICES["config"]["command"], "--print-token"]).stdout.strip()
        assert token.startswith("bg_")
        s = requests.Session()
        s.headers["Authorization"] = f"Bearer {token}"
        base = f"http://127.0.0.1:{stack.api_port}"
        pull = {"id": "pull", "version": "1", "batching": {"max_items": 5},
                "source": {"type": "sequence", "count": 12}, "stages": [{"name": "work"}]}
        push = {"id": "push", "version": "1", "batching": {"max_items": 5},
                "source": {"type": "sequence", "count": 12},
                "stages": [{"name": "call", "target": {"type": "http", "url": platform.url, "mode": "sync"}}]}
        for flow in (pull, push):
            assert s.post(f"{base}/v1/flows", json=flow).status_code == 201
        pull_job = s.post(f"{base}/v1/jobs", json={"flow_id": "pull"}).json()["job_id"]
        push_job = s.post(f"{base}/v1/jobs", json={"flow_id": "push"}).json()["job_id"]
        while (lease := s.post(f"{base}/v1/jobs/{pull_job}/lease")).status_code == 200:
            body = lease.json()
            done = s.post(f"{base}/v1/jobs/{pull_job}/batches/{body['seq']}/complete",
                          json={"lease_token": body["lease_token"], "output": {}})
            assert done.status_code == 200, done.text
        deadline = time.monotonic() + 30
        while s.get(f"{base}/v1/jobs/{push_job}").json()["status"] != "succeeded":
            assert time.monotonic() < deadline, s.get(f"{base}/v1/jobs/{push_job}").text
            time.sleep(0.2)
        assert s.get(f"{base}/v1/jobs/{pull_job}").json()["status"] == "succeeded"
        assert sorted(set(platform.keys)) == sorted(platform.keys) and len(platform.keys) == 3
        for proc in stack.procs:
            assert proc.poll() is None, f"{proc.args} exited {proc.returncode}"
    finally:
        procs.stop_all(stack.procs)
        platform.server.shutdown()
