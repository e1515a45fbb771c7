"""Start-up recovery is decided once per restart, before any process runs a job, whatever order processes
start in (gateway/ledger/generation.py, boot.lua).

Measured before: with ``BATCHGATE_RECOVERY=record`` a worker started before the supervisor ran a job left
running by a crash (3 platform calls, one paid) before the supervisor held it; and the supervisor's
start-up pass marked a job created 0.45 s before it as ``job_recovered``.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import pytest

from gateway.api.app import create_app
from gateway.ledger.flows import parse_flow
from gateway.ledger.generation import MEMBER_TTL_MS, Generation
from gateway.ledger.ledger import Ledger
from gateway.push.dispatch import Dispatcher
from gateway.push.supervisor import Supervisor
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.platforms import SlowSyncPlatform

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="pids and /proc")


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def crashed_generation(ledger: Ledger) -> None:
    """The ledger as a SIGKILLed deployment left it: generation 1, decided, one member whose process is
    gone (its TTL not yet run out)."""
    member = f"{socket.gethostname()}|{_dead_pid()}||worker-dead"
    deadline = int(time.time() * 1000) + MEMBER_TTL_MS
    ledger.r.hset(ledger.keys.boot, mapping={"gen": 1, "gen_ms": 1, "decided": 1, f"m:{member}": deadline})


def audit(ledger: Ledger, job_id: str) -> list[str]:
    return [f["event"] for _, f in ledger.r.xrange(ledger.keys.job(job_id).audit)]


def boot(ledger: Ledger, op: str, member: str, gen: str = "", *dead: str, ttl_ms: int = 30_000,
         claim_ms: int = 60_000) -> list:
    return Generation(ledger.r, ledger.keys, "t").script(
        keys=[ledger.keys.boot], args=[op, member, ttl_ms, claim_ms, gen, *dead])


def test_boot_script_starts_a_generation_only_when_no_member_lives_and_one_member_decides(ledger):
    first = boot(ledger, "join", "a")
    assert first[:2] == ["ready", 1]  # the first generation on a ledger has nothing to recover
    assert boot(ledger, "join", "b")[:2] == ["ready", 1]  # joins a live generation
    assert boot(ledger, "leave", "a") == ["ok"]
    assert boot(ledger, "join", "a", "1")[:2] == ["ready", 1]  # b lives: a renews into generation 1
    for m in ("a", "b"):
        boot(ledger, "leave", m)
    restart = boot(ledger, "join", "c")  # nobody alive: a restart
    assert restart[:2] == ["decide", 2] and int(restart[2]) > int(first[2])
    assert boot(ledger, "join", "d")[:2] == ["wait", 2]  # c holds the claim
    assert boot(ledger, "decided", "d", "2") == ["lost"]
    assert boot(ledger, "decided", "c", "2") == ["ok"]
    assert boot(ledger, "join", "d", "2")[:2] == ["ready", 2]
    # a member past its TTL is dead; so is one the caller found gone on its host
    boot(ledger, "join", "c", "2", ttl_ms=1)
    boot(ledger, "leave", "d")
    time.sleep(0.01)
    assert boot(ledger, "join", "e")[:2] == ["decide", 3]
    assert boot(ledger, "join", "f", "", "e")[:2] == ["decide", 4]
    # a decider that died mid-pass is replaced once its claim runs out
    assert boot(ledger, "join", "f", "4", claim_ms=1)[:2] == ["decide", 4]
    time.sleep(0.01)
    assert boot(ledger, "join", "g")[:2] == ["decide", 4]
    assert boot(ledger, "decided", "f", "4") == ["lost"]


def test_a_member_whose_process_is_gone_on_this_host_is_a_restart_not_a_join(ledger, make_job):
    crashed_generation(ledger)
    job_id = make_job(items=6, max_items=2)
    record = Ledger(ledger.r, ledger.settings.model_copy(update={"recovery": "record"}))
    worker = Supervisor(record, name="restarted")
    assert worker.generation.ready()  # decided here: the dead member's TTL had not run out
    assert worker.generation.gen == "2"
    assert record.job_fields(job_id)["status"] == "held"


@pytest.fixture
def settings(settings):
    return settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})


def _push_flow(url: str) -> dict:
    return {"id": "rec", "version": "1", "batching": {"max_items": 1}, "concurrency": 8,
            "source": {"type": "sequence", "count": 8},
            "stages": [{"name": "score", "lease": 60, "timeout": 60,
                        "target": {"type": "http", "url": f"{url}/score", "mode": "sync",
                                   "max_in_flight": 8}}]}


def _worker(env: dict[str, str], log_path) -> subprocess.Popen:
    with open(log_path, "ab") as out:
        return subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "worker", "--concurrency", "2"],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def _until(what: str, check, timeout_s: float, log_path=None):
    deadline = time.monotonic() + timeout_s
    while not (found := check()):
        assert time.monotonic() < deadline, f"{what}: not within {timeout_s} s\n" + (
            log_path.read_text()[-3000:] if log_path else "")
        time.sleep(0.05)
    return found


def test_record_mode_a_worker_started_before_the_supervisor_calls_no_platform_for_a_crashed_job(
        settings, redis_client, registry, jobs, tmp_path):
    """A worker runs two calls of a push job and is SIGKILLed (the calls hang on the platform); a new
    worker starts before any supervisor. It holds the job (it is the first process after the crash) and
    the platform gets no call from it; a supervisor started later joins and changes nothing."""
    from gateway.ledger.jobs import JobRequest

    platform = SlowSyncPlatform(delay=30)
    own = settings.model_copy(update={"recovery": "record", "data_dir": tmp_path / "data"})
    ledger = Ledger(redis_client, own)
    registry.register("acme", parse_flow(_push_flow(platform.url)))
    env = {**os.environ, "BATCHGATE_REDIS_URL": own.redis_url.get_secret_value(),
           "BATCHGATE_SIGNING_KEY": own.signing_secret().decode(), "BATCHGATE_PUBLIC_URL": "http://127.0.0.1:9",
           "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_LOG_LEVEL": "INFO",
           "BATCHGATE_RECOVERY": "record", "BATCHGATE_DATA_DIR": str(tmp_path / "data")}
    log_path = tmp_path / "workers.log"
    procs = []
    try:
        procs.append(first := _worker(env, log_path))
        job_id = jobs.create("acme", JobRequest(flow_id="rec"))["job_id"]
        Dispatcher.build(own, ledger).kick(job_id)
        _until("two calls in flight", lambda: len(platform.seqs()) >= 2, 30, log_path)
        os.killpg(first.pid, signal.SIGKILL)
        first.wait()
        at_crash = len(platform.seqs())
        procs.append(_worker(env, log_path))  # the first process after the crash: no supervisor yet
        _until("the job held, or a call", lambda: ledger.job_fields(job_id)["status"] == "held"
               or len(platform.seqs()) > at_crash, 30, log_path)
        time.sleep(0.5)  # the worker feeds every 0.1 s: it would have called by now
        assert len(platform.seqs()) == at_crash, "a crashed job was called before (or despite) its hold"
        assert ledger.job_fields(job_id)["status"] == "held"
        sup = Supervisor(ledger, name="late")
        assert sup.generation.ready() and sup.generation.gen == "2"
        sup.tick()
        assert ledger.job_fields(job_id)["status"] == "held"
        assert audit(ledger, job_id) == ["job_created", "job_held"]
        assert len(platform.seqs()) == at_crash
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        platform.close()


def test_record_mode_the_api_first_after_a_crash_leases_nothing_of_a_crashed_job(settings, redis_client,
                                                                                 make_job):
    own = settings.model_copy(update={"recovery": "record"})
    ledger = Ledger(redis_client, own)
    job_id = make_job(items=12, max_items=2)
    ledger.lease(job_id)  # its worker dies with the deployment
    crashed_generation(ledger)
    base, stop = serve_app(create_app(own, redis_client))
    try:
        api = ApiClient(base, TOKEN)
        resp = api.post(f"/v1/jobs/{job_id}/lease", json={})
        assert resp.status_code == 204 and resp.headers["Batchgate-Job-Status"] == "held"
    finally:
        stop()
    assert audit(ledger, job_id) == ["job_created", "job_held"]


@pytest.mark.parametrize("mode", ["auto", "record"])
def test_a_job_created_just_before_the_supervisors_start_is_not_recovered(settings, redis_client, make_job,
                                                                          registry, mode):
    """After a crash the API comes up first (it decides recovery: the job left running is recovered or
    held), a tenant creates a job, and 0.45 s later the supervisor starts: the new job is untouched."""
    own = settings.model_copy(update={"recovery": mode})
    ledger = Ledger(redis_client, own)
    crashed = make_job(items=6, max_items=2)
    ledger.lease(crashed)
    crashed_generation(ledger)
    registry.register("acme", parse_flow({"id": "fresh", "version": "1", "stages": [{"name": "s"}],
                                          "source": {"type": "sequence", "count": 4}}))
    base, stop = serve_app(create_app(own, redis_client))
    try:
        resp = ApiClient(base, TOKEN).post("/v1/jobs", json={"flow_id": "fresh"})
        assert resp.status_code == 201, resp.text
        fresh = resp.json()["job_id"]
    finally:
        stop()
    time.sleep(0.45)
    sup = Supervisor(ledger, name="sup-late")
    thread = threading.Thread(target=sup.run, daemon=True)
    thread.start()
    time.sleep(0.5)
    sup.stop.set()
    thread.join(5)
    assert audit(ledger, fresh) == ["job_created"]
    assert ledger.job_fields(fresh)["status"] == "running"
    assert audit(ledger, crashed) == ["job_created", "job_held" if mode == "record" else "job_recovered"]


def test_the_recovery_pass_skips_jobs_created_after_the_crash(ledger, make_job):
    before = make_job(items=4)
    crash_ms = int(time.time() * 1000)
    time.sleep(0.01)
    after = make_job(items=4)
    report = Supervisor(ledger, name="sup").recover(crash_ms)
    assert [e["job_id"] for e in report] == [before]
    assert audit(ledger, after) == ["job_created"]
