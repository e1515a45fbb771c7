"""Event webhooks: events appended by the ledger scripts, delivered signed, at least once, to the tenant only.

A local receiver on 127.0.0.1 verifies every signature (Standard Webhooks) and records what it got.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from gateway.ledger.events import SubscriptionStore
from gateway.ledger.ledger import Ledger
from gateway.push.webhooks import Deliverer, RetryPolicy, sign, verify
from tests.conftest import OTHER_TOKEN, TOKEN, drain

FAST = RetryPolicy(initial_interval=timedelta(milliseconds=100), backoff_coefficient=2.0,
                   maximum_interval=timedelta(milliseconds=500))


def test_signature_matches_the_standard_webhooks_test_vector():
    secret = "whsec_MfKQ9r8GKYqrTwjUPD8ILPZIo2LaLaSw"
    body = b'{"test": 2432232314}'
    assert sign(secret, "msg_p5jXN8AQM9LWM0D4loKWxJek", 1614265330, body) == \
        "v1,g0hM9SsE+OTPJTGt/tmIKtSyZlE3uFJELVlNIOLJ1OE="
    fresh = int(time.time())
    headers = {"webhook-id": "m1", "webhook-timestamp": str(fresh),
               "webhook-signature": sign(secret, "m1", fresh, body)}
    assert verify(secret, headers, body)
    assert not verify(secret, headers, body + b" ")


# -- events exist exactly when the status change committed ---------------------------------------------


def outbox(ledger, job_id):
    return [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).events)]


def test_each_status_change_appends_one_event_and_a_refused_change_none(ledger, make_job):
    done = make_job(items=6, max_items=3)
    drain(ledger, done)
    assert [e["type"] for e in outbox(ledger, done)] == ["job.succeeded"]
    assert outbox(ledger, done)[0]["n_done"] == "2" and outbox(ledger, done)[0]["from"] == "running"
    with pytest.raises(Exception):
        ledger.pause(done, "tester")  # refused: a succeeded job does not pause
    assert len(outbox(ledger, done)) == 1

    other = make_job(items=6, max_items=3)
    ledger.pause(other, "tester")
    ledger.cancel(other, "tester")
    ledger.cancel(other, "tester")  # already cancelled: no second event
    assert [e["type"] for e in outbox(ledger, other)] == ["job.paused", "job.cancelled"]

    failing = make_job(items=3, max_items=3)
    lease = ledger.lease(failing)
    ledger.fail(failing, lease.seq, lease.lease_token, "boom", retryable=False)
    events = outbox(ledger, failing)
    assert [e["type"] for e in events] == ["batch.failed", "job.failed"] and "budget" in events[1]["error"]


# -- delivery to a local receiver --------------------------------------------------------------------------


class Receiver:
    """An HTTP receiver on 127.0.0.1 that verifies signatures; answers 500 to the first ``fail_first``."""

    def __init__(self, port: int = 0, fail_first: int = 0) -> None:
        self.got: list[tuple[str, dict]] = []  # (webhook-id, body) of every verified request
        self.bad = 0
        self.fail_first = fail_first
        self.secret = ""
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802
                body = self.rfile.read(int(self.headers["content-length"]))
                if not verify(receiver.secret, self.headers, body):
                    receiver.bad += 1
                    self.send_response(401)
                elif receiver.fail_first > 0:
                    receiver.fail_first -= 1
                    receiver.got.append((self.headers["webhook-id"], json.loads(body)))
                    self.send_response(500)
                else:
                    receiver.got.append((self.headers["webhook-id"], json.loads(body)))
                    self.send_response(204)
                self.end_headers()

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", port), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def ids(self):
        return [i for i, _ in self.got]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def hooks(settings, redis_client):
    """A ledger allowed to call loopback, the API (same settings) and a deliverer factory."""
    from gateway.api.app import create_app
    from tests.http import ApiClient, serve_app

    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
    base, stop = serve_app(create_app(own, redis_client))
    yield Ledger(redis_client, own), ApiClient(base, TOKEN)
    stop()


def subscribe(api, url, events=("job.succeeded", "job.failed", "job.cancelled", "job.paused")):
    resp = api.post("/v1/subscriptions", json={"url": url, "events": list(events)})
    assert resp.status_code == 201, resp.text
    return resp.json()


def run_until(deliverer, done, timeout_s=15.0):
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        deliverer.tick()
        if done():
            return
        time.sleep(0.05)
    raise AssertionError("not delivered in time")


def test_every_event_is_delivered_signed_and_a_retried_one_keeps_its_id(hooks, make_job):
    ledger, api = hooks
    receiver = Receiver(fail_first=2)
    sub = subscribe(api, receiver.url)
    receiver.secret = sub["secret"]
    assert sub["secret"].startswith("whsec_")
    assert "secret" not in api.get(f"/v1/subscriptions/{sub['id']}").json()
    a, b = make_job(items=3), make_job(items=3)
    drain(ledger, a)
    ledger.pause(b, "tester")
    ledger.cancel(b, "tester")
    deliverer = Deliverer(ledger, retry=FAST)
    run_until(deliverer, lambda: len(set(receiver.ids())) == 3 and len(receiver.got) == 5)
    receiver.close()
    assert receiver.bad == 0
    by_id = {}
    for msg_id, body in receiver.got:
        by_id.setdefault(msg_id, []).append(body)
    assert len(receiver.got) == 5  # two failed answers: one event sent three times, same id and body
    assert {body["type"] for bodies in by_id.values() for body in bodies} == \
        {"job.succeeded", "job.paused", "job.cancelled"}
    assert all(len({json.dumps(x) for x in bodies}) == 1 for bodies in by_id.values())
    first = receiver.got[0]
    assert first[1]["data"]["job_id"] in (a, b) and first[1]["data"]["tenant"] == "acme"
    for bodies in by_id.values():  # ordered per job: paused before cancelled
        assert bodies[0]["data"]["job_id"] in (a, b)
    order_b = [body["type"] for _, body in receiver.got if body["data"]["job_id"] == b]
    assert order_b.index("job.paused") < order_b.index("job.cancelled")
    shown = api.get(f"/v1/subscriptions/{sub['id']}/deliveries").json()["deliveries"]
    assert [d["status"] for d in shown].count(500) == 2 and [d["ok"] for d in shown].count(True) == 3


def test_a_receiver_down_for_a_while_still_gets_every_event(hooks, make_job):
    ledger, api = hooks
    port = free_port()  # nothing listens yet: every attempt is refused
    sub = subscribe(api, f"http://127.0.0.1:{port}/hook")
    jobs = [make_job(items=3) for _ in range(3)]
    for job_id in jobs:
        drain(ledger, job_id)
    deliverer = Deliverer(ledger, retry=FAST, interval=timedelta(milliseconds=50))
    thread = threading.Thread(target=deliverer.run, daemon=True)
    thread.start()
    time.sleep(4.0)
    shown = api.get(f"/v1/subscriptions/{sub['id']}/deliveries").json()["deliveries"]
    assert shown and all(d["status"] is None and not d["ok"] for d in shown)
    receiver = Receiver(port=port)
    receiver.secret = sub["secret"]
    try:
        end = time.monotonic() + 10
        while len(set(receiver.ids())) < 3 and time.monotonic() < end:
            time.sleep(0.05)
    finally:
        deliverer.stop.set()
        thread.join(5)
        receiver.close()
    assert {body["data"]["job_id"] for _, body in receiver.got} == set(jobs)
    assert receiver.bad == 0


class Killed(BaseException):
    """Stands for the process dying: nothing after it runs."""


def test_a_deliverer_killed_after_a_send_loses_nothing_on_restart(hooks, make_job, redis_client):
    ledger, api = hooks
    receiver = Receiver()
    sub = subscribe(api, receiver.url)
    receiver.secret = sub["secret"]
    jobs = [make_job(items=3) for _ in range(3)]
    for job_id in jobs:
        drain(ledger, job_id)

    class DiesAfterSecondSend(Deliverer):
        sent = 0

        def _deliver(self, *args):
            handled = super()._deliver(*args)
            DiesAfterSecondSend.sent += 1
            if DiesAfterSecondSend.sent == 2:
                raise Killed  # delivered, but its cursor never written
            return handled

    with pytest.raises(Killed):
        DiesAfterSecondSend(ledger, retry=FAST).tick()
    assert len(receiver.got) == 2
    run_until(Deliverer(ledger, retry=FAST), lambda: len(set(receiver.ids())) == 3)
    receiver.close()
    ids = receiver.ids()
    assert len(ids) == 4 and ids[1] == ids[2]  # the one in flight again, same id; no other repeat
    assert {body["data"]["job_id"] for _, body in receiver.got} == set(jobs)


def test_another_tenants_subscription_gets_nothing(hooks, make_job):
    ledger, api = hooks
    mine, theirs = Receiver(), Receiver()
    sub = subscribe(api, mine.url)
    mine.secret = sub["secret"]
    other = api.as_token(OTHER_TOKEN)
    theirs.secret = subscribe(other, theirs.url)["secret"]
    assert other.get(f"/v1/subscriptions/{sub['id']}").status_code == 404
    assert other.delete(f"/v1/subscriptions/{sub['id']}").status_code == 404
    assert [s["id"] for s in api.get("/v1/subscriptions").json()["subscriptions"]] == [sub["id"]]
    drain(ledger, make_job(items=3))
    run_until(Deliverer(ledger, retry=FAST), lambda: len(mine.got) == 1)
    time.sleep(0.3)
    Deliverer(ledger, retry=FAST).tick()
    mine.close()
    theirs.close()
    assert theirs.got == [] and len(mine.got) == 1


def test_a_subscription_to_a_url_the_guard_refuses_is_a_422(hooks, api):
    _, loopback_ok = hooks
    for url in ("http://169.254.169.254/latest", "http://10.1.2.3/hook", "ftp://example.com/x", ""):
        resp = api.post("/v1/subscriptions", json={"url": url, "events": ["job.failed"]})
        assert resp.status_code in (400, 422), (url, resp.text)
        assert resp.headers["content-type"].startswith("application/problem+json")
    resp = api.post("/v1/subscriptions", json={"url": "http://127.0.0.1:9/x", "events": ["job.failed"]})
    assert resp.status_code == 422  # loopback, without an outbound allowance
    resp = loopback_ok.post("/v1/subscriptions", json={"url": "http://127.0.0.1:9/x", "events": ["job.nope"]})
    assert resp.status_code == 422 and [e["field"] for e in resp.json()["errors"]] == ["events.0"]


def test_deleting_a_subscription_stops_its_deliveries(hooks, make_job, redis_client):
    ledger, api = hooks
    receiver = Receiver()
    sub = subscribe(api, receiver.url)
    assert api.delete(f"/v1/subscriptions/{sub['id']}").status_code == 204
    assert api.get(f"/v1/subscriptions/{sub['id']}").status_code == 404
    drain(ledger, make_job(items=3))
    Deliverer(ledger, retry=FAST).tick()
    receiver.close()
    assert receiver.got == [] and SubscriptionStore(redis_client, ledger.keys).for_tenant("acme") == []


def test_cancelling_a_failed_job_the_supervisor_retired_is_still_delivered(hooks, make_job):
    from gateway.push.supervisor import Supervisor

    ledger, api = hooks
    receiver = Receiver()
    receiver.secret = subscribe(api, receiver.url)["secret"]
    job_id = make_job(items=3)
    lease = ledger.lease(job_id)
    ledger.fail(job_id, lease.seq, lease.lease_token, "boom", retryable=False)
    Supervisor(ledger).tick()  # retired: no longer active
    deliverer = Deliverer(ledger, retry=FAST)
    run_until(deliverer, lambda: len(receiver.got) == 1)
    deliverer.tick()  # drained: the job leaves the pending set
    assert not ledger.r.sismember(ledger.keys.active, job_id)
    ledger.cancel(job_id, "tester")
    run_until(deliverer, lambda: len(receiver.got) == 2)
    receiver.close()
    assert [body["type"] for _, body in receiver.got] == ["job.failed", "job.cancelled"]


def test_a_folded_jobs_outbox_folds_once_every_subscriber_has_had_its_events(hooks, registry):
    """A job at rest whose results are delivered folds into its past (archive.py), but its event outbox
    stays a stream while a subscriber has not had its events (the receiver is down); once delivered,
    the deliverer folds the outbox too, and nothing was delivered twice or lost."""
    from gateway.ledger import archive
    from gateway.ledger.jobs import JobService
    from gateway.push.sinks import SinkDeliverer
    from gateway.push.supervisor import Supervisor
    from tests.test_sinks import new_job, output

    ledger, api = hooks
    ledger = Ledger(ledger.r, ledger.settings.model_copy(update={"sink_grace": timedelta(0)}))
    port = free_port()  # nothing listens yet
    sub = subscribe(api, f"http://127.0.0.1:{port}/hook")
    job_id = new_job(JobService(ledger, registry), registry, {"type": "discard"}, items=6)
    drain(ledger, job_id, output)
    Supervisor(ledger, name="sup", sweep_visits=0).tick()  # retires it: its events are pending
    deliverer = Deliverer(ledger, retry=FAST)
    deliverer.tick()  # refused: the subscriber has not had job.succeeded
    SinkDeliverer(ledger).run_once()
    k = ledger.keys.job(job_id)
    assert ledger.r.exists(k.past) and not ledger.r.exists(k.audit)  # folded...
    assert ledger.r.xlen(k.events) == 1  # ...but not the outbox the deliverer still reads
    receiver = Receiver(port=port)
    receiver.secret = sub["secret"]
    try:
        run_until(deliverer, lambda: not ledger.r.exists(k.events))
    finally:
        receiver.close()
    assert [body["type"] for _, body in receiver.got] == ["job.succeeded"]
    assert [f["type"] for _, f in archive.past(ledger.r, k)["events"]] == ["job.succeeded"]
    deliverer.tick()
    assert len(receiver.got) == 1


def test_a_quarantined_item_reaches_a_subscriber_signed_with_its_batch_and_index(hooks, make_job):
    """items.quarantined over a real socket: a receiver down for the first two tries still gets one
    event per quarantine, with the item's batch, stage index and index in the batch, and the tenant."""
    from tests.test_bisect import run

    ledger, api = hooks
    receiver = Receiver(fail_first=2)
    sub = subscribe(api, receiver.url, events=("items.quarantined",))
    receiver.secret = sub["secret"]
    job_id = make_job(items=12, max_items=6, stage_defs=[{"name": "score", "on_fatal": "bisect"}],
                      tolerated_failure_percentage=50)
    run(ledger, job_id, {4, 8})
    deliverer = Deliverer(ledger, retry=FAST)
    run_until(deliverer, lambda: len(set(receiver.ids())) == 2 and len(receiver.got) == 4)
    time.sleep(0.3)
    deliverer.tick()
    receiver.close()
    assert receiver.bad == 0 and len(receiver.got) == 4  # two failed answers, sent again; nothing else
    firsts = {msg_id: body for msg_id, body in reversed(receiver.got)}
    assert sorted((b["type"], b["data"]["seq"], b["data"]["stage"], b["data"]["items"], b["data"]["error"])
                  for b in firsts.values()) == [("items.quarantined", 0, 0, [4], "item 4 is malformed"),
                                                ("items.quarantined", 1, 0, [2], "item 8 is malformed")]
    assert all(b["data"]["job_id"] == job_id and b["data"]["tenant"] == "acme" for b in firsts.values())


def test_cursors_of_a_job_retention_removed_are_dropped_and_a_resumed_jobs_kept(hooks, make_job):
    """A subscription keeps one cursor per job it heard of; once retention has removed a job, the
    deliverer drops it (a hash field per job and subscription would grow for ever). A job resumed
    before its keys expired keeps its cursor, so its old events are not sent again."""
    from gateway.push.supervisor import Supervisor

    ledger, api = hooks
    receiver = Receiver()
    sub = subscribe(api, receiver.url)
    receiver.secret = sub["secret"]
    gone, kept = make_job(items=3, retention=1), make_job(items=3, retention=1)
    drain(ledger, gone)
    drain(ledger, kept)
    deliverer = Deliverer(ledger, retry=FAST)
    run_until(deliverer, lambda: len(receiver.got) == 2)
    cursor = ledger.keys.sub_cursor(sub["id"])
    assert set(ledger.r.hkeys(cursor)) == {gone, kept}
    Supervisor(ledger, name="retention").tick()  # retires both: their keys expire in 1 s
    assert len(ledger.r.zrange(ledger.keys.events_gone, 0, -1)) == 2
    ledger.persist_job(kept)  # what a resume does
    assert deliverer.prune() == 0  # not gone yet (1 s and a minute's slack)
    time.sleep(1.2)
    assert not ledger.r.exists(ledger.keys.job(gone).job)
    assert deliverer.prune(now_ms=int(time.time() * 1000) + 120_000) == 1
    assert ledger.r.hkeys(cursor) == [kept] and ledger.r.zcard(ledger.keys.events_gone) == 0
    deliverer.tick()
    time.sleep(0.2)
    receiver.close()
    assert len(receiver.got) == 2  # nothing sent again
