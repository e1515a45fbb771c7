"""A platform target that is unavailable costs no attempt: the breaker cools the target down, lets one
probe through, shows the job why it waits, pauses the job after a long outage, and closes when the target
answers. Real sockets on 127.0.0.1: a closed port (connection refused), then a server on that port."""

from __future__ import annotations

import socket
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler

import pytest

from gateway.push.dispatch import Dispatcher, target_id
from gateway.ledger.ledger import Ledger
from tests.platforms import respond, serve_on


class Platform:
    """Answers the contract, or 503 while ``unavailable``; counts calls."""

    def __init__(self, port: int) -> None:
        self.calls = 0
        self.unavailable = False
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                self.rfile.read(int(self.headers["Content-Length"]))
                outer.calls += 1
                if outer.unavailable:
                    respond(self, 503)
                    return
                respond(self, 200, {"status": "succeeded", "output": {}})

        self.server = serve_on(Handler, port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def redis_ms(ledger: Ledger) -> int:
    seconds, micros = ledger.r.time()
    return seconds * 1000 + micros // 1000


def long_outage(ledger: Ledger, breaker: str) -> None:
    """The breaker as after a minute of failed probes: its wait has doubled six times (to the cap)."""
    ledger.r.hset(breaker, mapping={"since_ms": redis_ms(ledger) - 60_000, "until_ms": 1, "fails": 6})


def closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def push(settings, redis_client):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"],
                                      "outage_pause_after": timedelta(seconds=2),
                                      "outage_cooldown_max": timedelta(milliseconds=400)})
    ledger = Ledger(redis_client, own)
    return ledger, Dispatcher.build(own, ledger)


def flow(port: int, idempotent: bool = False) -> list[dict]:
    return [{"name": "call", "idempotent": idempotent, "lease": 5, "timeout": 2,
             "retry": {"initial_interval": 0.01, "maximum_attempts": 1},
             "target": {"type": "http", "url": f"http://127.0.0.1:{port}/hook", "mode": "sync"}}]


def spent(ledger: Ledger, job_id: str, seq: int) -> int:
    rec = ledger.batch_record(job_id, seq)
    return int(rec["attempt"]) - int(rec.get("unspent") or 0)


def test_refused_connections_spend_no_attempt_and_the_job_shows_why(push, make_job, api):
    ledger, d = push
    port = closed_port()
    job_id = make_job(items=list(range(6)), max_items=2, stage_defs=flow(port))
    assert d.run_ready(job_id) == 1  # the first call is refused: the target cools down
    assert d.run_ready(job_id) == 0  # ... so nothing else is called while it cools
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "running" and view["batches"]["failed"] == 0
    assert view["waiting"]["target"] == f"http://127.0.0.1:{port}" and "reach" in view["waiting"]["reason"]
    assert spent(ledger, job_id, 0) == 0  # maximum_attempts 1, and still pending: nothing spent
    batch = api.get(f"/v1/jobs/{job_id}/batches/0").json()
    assert batch["status"] == "pending" and batch["attempts_spent"] == 0
    breaker = ledger.r.hgetall(ledger.keys.target_breaker(target_id({"url": f"http://127.0.0.1:{port}/"})))
    assert int(breaker["fails"]) == 1 and int(breaker["until_ms"]) > int(breaker["since_ms"])

    time.sleep(0.5)  # cooled down: one probe, refused again, the wait doubles (up to 400 ms here)
    assert d.run_ready(job_id) == 1
    breaker = ledger.r.hgetall(ledger.keys.target_breaker(target_id({"url": f"http://127.0.0.1:{port}/"})))
    assert int(breaker["fails"]) == 2

    platform = Platform(port)  # the platform is back
    try:
        deadline = time.monotonic() + 10
        while ledger.job_fields(job_id)["status"] == "running":
            assert time.monotonic() < deadline
            d.run_ready(job_id)
            time.sleep(0.05)
    finally:
        platform.close()
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "succeeded" and view["waiting"] is None  # the probe closed the breaker
    assert platform.calls == 3  # each batch called once it answered; the refused tries cost nothing
    assert [spent(ledger, job_id, seq) for seq in range(3)] == [1, 1, 1]
    assert not ledger.r.exists(ledger.keys.target_breaker(target_id({"url": f"http://127.0.0.1:{port}/"})))


def test_a_target_down_past_outage_pause_after_pauses_the_job_with_the_reason(push, make_job, api):
    ledger, d = push
    port = closed_port()
    job_id = make_job(items=[1, 2], max_items=1, stage_defs=flow(port))
    deadline = time.monotonic() + 10
    while ledger.job_fields(job_id)["status"] == "running":
        assert time.monotonic() < deadline, "the job was never paused"
        d.run_ready(job_id)
        time.sleep(0.1)
    view = api.get(f"/v1/jobs/{job_id}").json()
    assert view["status"] == "paused" and view["batches"]["failed"] == 0
    audit = api.get(f"/v1/jobs/{job_id}/audit").json()["entries"]
    paused = [e for e in audit if e["event"] == "job_paused"]
    reason = paused[-1]["reason"] if paused else ""
    assert "unavailable for" in reason and f"127.0.0.1:{port}" in reason
    assert spent(ledger, job_id, 0) == 0
    # the pause is an event, appended by the same script (subscribers hear of it)
    events = [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).events)]
    assert [(e["type"], e["from"]) for e in events] == [("job.paused", "running")]


def test_503_waits_for_an_idempotent_stage_but_is_may_have_run_for_one_that_is_not(push, make_job, api):
    ledger, d = push
    port = closed_port()
    platform = Platform(port)
    platform.unavailable = True
    try:
        safe = make_job(items=[1], max_items=1, stage_defs=flow(port, idempotent=True))
        d.run_ready(safe)
        assert spent(ledger, safe, 0) == 0 and ledger.batch_record(safe, 0)["status"] == "pending"
        ledger.r.delete(ledger.keys.target_breaker(target_id({"url": f"http://127.0.0.1:{port}/"})))
        unsafe = make_job(items=[1], max_items=1, stage_defs=flow(port, idempotent=False))
        d.run_ready(unsafe)
    finally:
        platform.close()
    batch = api.get(f"/v1/jobs/{unsafe}/batches/0").json()
    assert batch["status"] == "failed" and batch["error_type"] == "outcome_unknown", batch
    assert platform.calls == 2


def test_a_platform_answering_that_it_is_booting_is_probed_again_within_seconds(push, make_job):
    """After a long outage (the breaker's wait grown to the 30 s cap), n8n comes back and answers "not
    registered" while it registers its webhooks: the next probe comes within 2 s, not 30 s, so the job
    resumes within 2 s of the webhooks being back."""
    from tests.platforms import FakeN8n

    ledger, d = push
    d.settings = d.settings.model_copy(update={"outage_cooldown_max": timedelta(seconds=30),
                                               "outage_pause_after": timedelta(minutes=10)})
    with FakeN8n(path="score") as n8n:
        target = {"type": "n8n", "url": n8n.url, "mode": "sync"}
        job_id = make_job(items=[1, 2], max_items=1, stage_defs=[
            {"name": "call", "lease": 5, "timeout": 2, "retry": {"maximum_attempts": 1}, "target": target}])
        breaker = ledger.keys.target_breaker(target_id(target))
        long_outage(ledger, breaker)
        n8n.plan("not_registered", "not_registered")
        assert d.run_ready(job_id) == 1
        now_ms = redis_ms(ledger)
        assert int(ledger.r.hget(breaker, "until_ms")) - now_ms <= 2000  # not 30 s
        deadline = time.monotonic() + 3
        while int(ledger.r.hget(breaker, "until_ms")) > redis_ms(ledger):
            assert time.monotonic() < deadline
            time.sleep(0.05)
        assert d.run_ready(job_id, limit=1) == 1  # the second probe: still booting, again <= 2 s out
        assert int(ledger.r.hget(breaker, "until_ms")) - redis_ms(ledger) <= 2000
        registered = time.monotonic()
        while ledger.job_fields(job_id)["status"] == "running":  # now the webhook answers
            assert time.monotonic() - registered < 4, "the job did not resume within a probe or two"
            d.run_ready(job_id)
            time.sleep(0.05)
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    assert all(int(ledger.batch_record(job_id, s)["attempt"]) - int(ledger.batch_record(job_id, s).get(
        "unspent") or 0) == 1 for s in range(2))  # the booting answers cost no attempt


def test_a_refused_connection_still_backs_off_to_the_cap(push, make_job):
    """Nothing answers at all (the platform is down, not booting): the wait keeps doubling to the cap."""
    ledger, d = push
    d.settings = d.settings.model_copy(update={"outage_cooldown_max": timedelta(seconds=30),
                                               "outage_pause_after": timedelta(minutes=10)})
    port = closed_port()
    job_id = make_job(items=[1], max_items=1, stage_defs=flow(port))
    tid = target_id({"url": f"http://127.0.0.1:{port}/"})
    long_outage(ledger, ledger.keys.target_breaker(tid))
    assert d.run_ready(job_id) == 1
    wait_ms = int(ledger.r.hget(ledger.keys.target_breaker(tid), "until_ms")) - redis_ms(ledger)
    assert 25_000 <= wait_ms <= 30_000
