"""No child outlives its parent, and no child imports from the directory batchgate was started in.

Measured before: a SIGKILLed ``batchgate worker`` left its forked child (RQ's scheduler) alive 2 s later in
2 of 3 kills; a ``numbers.py`` in the folder ``batchgate up`` started from ran inside every child.

Each parent kind is SIGKILLed while idle, several at once: ``batchgate worker`` (its fork: RQ's
scheduler), ``batchgate serve`` (the gunicorn master: its workers), ``batchgate up`` (API master and
workers, supervisor, worker and its scheduler, embedded redis-server). Every process of one deployment
carries a tag in its environment (forks and exec'd children inherit it), so its survivors are found in
/proc whoever their parent is now. Bound: CHILD_GONE_S after the kill (the slowest is RQ's scheduler,
which sees its SIGTERM after its 1 s sleep; gunicorn and the worker stop at once when idle).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest
import requests

from gateway.ledger.embedded import client_for, free_port
from tests.conftest import TOKEN

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG, /proc")

CHILD_GONE_S = 8.0
TAG = "BGTEST_DEPLOYMENT"  # not BATCHGATE_: the embedded redis-server's environment keeps it too

NUMBERS_PY = '''\
import importlib.util, os, sys, sysconfig
open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "imported-%d" % os.getpid()), "w").close()
spec = importlib.util.spec_from_file_location(
    "numbers", os.path.join(sysconfig.get_paths()["stdlib"], "numbers.py"))
real = importlib.util.module_from_spec(spec)
sys.modules["numbers"] = real
spec.loader.exec_module(real)
'''


def tagged(tag: str, data_dir: Path | None = None) -> dict[int, str]:
    """pid -> name of every live (not zombie) process whose environment carries ``tag``, and of a
    redis-server working in ``data_dir`` (it writes its title over its environment)."""
    marker = f"{TAG}={tag}".encode()
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            if stat.rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                continue
            name = stat.split("(", 1)[1].rsplit(")", 1)[0]
            if marker in (entry / "environ").read_bytes().split(b"\0") or (
                    data_dir is not None and name == "redis-server"
                    and os.readlink(entry / "cwd") == os.path.realpath(data_dir)):
                found[int(entry.name)] = name
        except (OSError, IndexError):
            continue
    return found


def batchgate() -> list[str]:
    """The console script, as an operator runs it (not ``python -m``, which would put the current
    directory on the parent's own path)."""
    script = shutil.which("batchgate") or str(Path(sys.executable).with_name("batchgate"))
    return [script] if Path(script).exists() else [sys.executable, "-P", "-m", "gateway.runtime.cli"]


class Deployment:
    def __init__(self, tmp_path: Path, name: str, args: list[str], cwd: Path | None = None, **env: str) -> None:
        self.tag = f"{name}-{uuid.uuid4().hex[:8]}"
        self.data = tmp_path / name / "data"
        self.cwd = cwd or tmp_path / name
        self.cwd.mkdir(parents=True, exist_ok=True)
        self.log_path = tmp_path / f"{name}.log"
        full = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
        full.update({TAG: self.tag, "BATCHGATE_DATA_DIR": str(self.data), "BATCHGATE_HOST": "127.0.0.1",
                     "BATCHGATE_TOKENS": json.dumps({TOKEN: "acme"}), "BATCHGATE_LOG_LEVEL": "WARNING"}, **env)
        with open(self.log_path, "w") as out:
            self.proc = subprocess.Popen([*batchgate(), *args], env=full, cwd=self.cwd, stdout=out,
                                         stderr=subprocess.STDOUT)

    def wait_for(self, count: int, port: int | None = None, timeout_s: float = 60.0) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc.poll() is None, self.log_path.read_text()
            healthy = port is None or _healthy(port)
            if healthy and len(tagged(self.tag, self.data)) >= count:
                return
            found = tagged(self.tag, self.data)
            assert time.monotonic() < deadline, f"{len(found)} of {count}: {found}\n{self.log_path.read_text()}"
            time.sleep(0.1)

    def cleanup(self) -> None:
        for pid in tagged(self.tag, self.data):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def _healthy(port: int) -> bool:
    try:
        return requests.get(f"http://127.0.0.1:{port}/healthz", timeout=1).status_code == 200
    except requests.RequestException:
        return False


def _kill_all(deployments: list[Deployment]) -> list[tuple[float, dict[int, str]]]:
    """SIGKILL every parent at once (the parent only); per deployment, seconds until none of its
    processes was left (polled for up to 15 s) and what was left then."""
    for d in deployments:
        d.proc.send_signal(signal.SIGKILL)
    started = time.monotonic()
    for d in deployments:
        d.proc.wait()
    gone: dict[str, float] = {}
    while len(gone) < len(deployments) and time.monotonic() - started < 15:
        for d in deployments:
            if d.tag not in gone and not tagged(d.tag, d.data):
                gone[d.tag] = time.monotonic() - started
        time.sleep(0.05)
    return [(gone.get(d.tag, float("inf")), tagged(d.tag, d.data)) for d in deployments]


@pytest.fixture
def deployments():
    started: list[Deployment] = []
    yield started
    for d in started:
        if d.proc.poll() is None:
            d.proc.kill()
            d.proc.wait()
        d.cleanup()


def test_a_sigkilled_worker_leaves_no_forked_child(tmp_path, redis_server, deployments):
    """Three workers, each on its own Redis database (RQ forks one scheduler per queue and Redis)."""
    for db in (1, 2, 3):
        client_for(redis_server.url.replace("db=0", f"db={db}")).flushdb()
        deployments.append(Deployment(tmp_path, f"worker{db}", ["worker", "--concurrency", "1"],
                                      BATCHGATE_REDIS_URL=redis_server.url.replace("db=0", f"db={db}")))
    for d in deployments:
        d.wait_for(2)  # the worker and the scheduler it forked
    results = _kill_all(deployments)
    print("worker kill -> no child left (s):", [round(t, 2) for t, _ in results])
    assert all(left == {} and t <= CHILD_GONE_S for t, left in results), results


def test_a_sigkilled_serve_leaves_no_gunicorn_worker_and_imports_nothing_from_its_directory(
        tmp_path, redis_server, deployments):
    start_dir = tmp_path / "start"
    start_dir.mkdir()
    (start_dir / "numbers.py").write_text(NUMBERS_PY)
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        deployments.append(Deployment(tmp_path, f"serve{i}", ["serve", "--port", str(port), "--workers", "2"],
                                      cwd=start_dir if i == 0 else None,
                                      BATCHGATE_REDIS_URL=redis_server.url))
    for d, port in zip(deployments, ports):
        d.wait_for(3, port)  # the master and its two workers
    resp = requests.get(f"http://127.0.0.1:{ports[0]}/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=10)
    assert resp.status_code == 200, resp.text
    results = _kill_all(deployments)
    print("serve kill -> no child left (s):", [round(t, 2) for t, _ in results])
    assert all(left == {} and t <= CHILD_GONE_S for t, left in results), results
    assert sorted(p.name for p in start_dir.glob("imported-*")) == []


def test_a_sigkilled_up_leaves_no_child_and_imports_nothing_from_its_directory(tmp_path, deployments):
    start_dir = tmp_path / "start"
    start_dir.mkdir()
    (start_dir / "numbers.py").write_text(NUMBERS_PY)
    ports = [free_port(), free_port()]
    for i, port in enumerate(ports):
        deployments.append(Deployment(tmp_path, f"up{i}", ["up", "--port", str(port)],
                                      cwd=start_dir if i == 0 else None,
                                      BATCHGATE_SUPERVISOR_INTERVAL="0.2"))
    for d, port in zip(deployments, ports):
        # up, redis-server, gunicorn master + 2 workers, supervisor, worker + its scheduler
        d.wait_for(8, port)
    resp = requests.get(f"http://127.0.0.1:{ports[0]}/v1/jobs", headers={"Authorization": f"Bearer {TOKEN}"},
                        timeout=10)
    assert resp.status_code == 200, resp.text
    results = _kill_all(deployments)
    print("up kill -> no child left (s):", [round(t, 2) for t, _ in results])
    assert all(left == {} and t <= CHILD_GONE_S for t, left in results), results
    assert sorted(p.name for p in start_dir.glob("imported-*")) == []
