"""Approvals end to end (issue 16, Done when): a 3-stage flow over 200 items, people in the loop, events out.

score runs on a stand-in platform over a real socket (push mode, `batchgate worker` processes), every
batch then waits at an approval stage, and store runs on the platform again. Approvals are decided
through the API (approve, approve with an edited output, reject), through the signed links the
approval.requested events carry (a GET, as a link preview would, then the form POST) and by the
supervisor's timeout. Rejected batches count against the failure budget. A local receiver subscribed
to every event type verifies each Standard Webhooks signature, answers 500 to some first deliveries (so
duplicates happen, and must carry the same webhook-id), and is down (connection refused) for 30 s in the
middle of the run; afterwards it must still have every event the job's outbox holds.
"""

from __future__ import annotations

import json
import os
import random
import re
import sys
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests

from gateway.api.app import create_app
from gateway.ledger.events import EVENT_TYPES
from gateway.ledger.ledger import Ledger
from gateway.push.dispatch import Dispatcher
from gateway.push.supervisor import Supervisor
from gateway.push.webhooks import Deliverer, RetryPolicy, verify
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.test_push_e2e import Workers

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "resume_screening"))
from standin_platform import StandInPlatform  # noqa: E402

pytestmark = pytest.mark.slow

ITEMS, PER_BATCH = 200, 2
BATCHES = ITEMS // PER_BATCH
TIMEOUT_S = 40  # the approval stage's timeout: batches nobody decides are approved by the supervisor
DOWN_S = 30
TOLERATED = 15  # % of batches that may fail (be rejected) with the job still succeeding


def flow(platform_url: str) -> dict:
    retry = {"initial_interval": 0.2, "maximum_interval": 1, "maximum_attempts": 5}
    return {
        "id": "reviewed", "version": "1", "batching": {"max_items": PER_BATCH}, "concurrency": 16,
        "source": {"type": "sequence", "count": ITEMS}, "tolerated_failure_percentage": TOLERATED,
        "stages": [
            {"name": "score", "lease": 5, "idempotent": True, "retry": retry, "timeout": 5,
             "target": {"type": "http", "url": f"{platform_url}/score-sync", "mode": "sync"}},
            {"name": "review", "approval": {"timeout": TIMEOUT_S, "on_timeout": "approve", "show": "score"}},
            {"name": "store", "lease": 5, "idempotent": True, "retry": retry, "timeout": 5,
             "target": {"type": "http", "url": f"{platform_url}/store", "mode": "sync"}},
        ],
    }


class Receiver:
    """A subscriber: verifies every delivery's signature; can be taken down (connection refused)."""

    def __init__(self) -> None:
        self.secret = ""
        self.lock = threading.Lock()
        self.deliveries: list[tuple[str, str, dict]] = []  # (webhook-id, type, body) of valid ones
        self.bad_signatures = 0
        self.refused_first: set[str] = set()
        self.server: ThreadingHTTPServer | None = None
        self.port = 0
        self.rng = random.Random(5)
        self.up()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}/hook"

    def up(self) -> None:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = receiver.receive(self.headers, body)
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

        self.server = ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.server.daemon_threads = True
        self.port = self.server.server_port
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def down(self) -> None:
        self.server.shutdown()
        self.server.server_close()  # the port now refuses connections

    def receive(self, headers, body: bytes) -> int:
        if not verify(self.secret, headers, body):
            with self.lock:
                self.bad_signatures += 1
            return 401
        msg_id = headers["webhook-id"]
        event = json.loads(body)
        with self.lock:
            self.deliveries.append((msg_id, event["type"], event))
            if msg_id not in self.refused_first and self.rng.random() < 0.1:
                self.refused_first.add(msg_id)  # answered 500 once: the deliverer sends it again
                return 500
        return 204

    def seen(self) -> dict[str, list[dict]]:
        with self.lock:
            out: dict[str, list[dict]] = {}
            for msg_id, _, event in self.deliveries:
                out.setdefault(msg_id, []).append(event)
            return out


@contextmanager
def stack(settings, redis_client, data: Path):
    """API on a real socket; a supervisor (lease expiry, approval timeouts, webhook deliveries with a
    short backoff) in a thread; one `batchgate worker` process."""
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "data_dir": data,
                                      "supervisor_interval": timedelta(milliseconds=100)})
    holder: dict = {}
    base, stop_api = serve_app(lambda environ, start: holder["app"](environ, start))
    own = own.model_copy(update={"public_url": base})
    holder["app"] = create_app(own, redis_client)
    env = {**os.environ, "BATCHGATE_REDIS_URL": own.redis_url.get_secret_value(),
           "BATCHGATE_SIGNING_KEY": own.signing_secret().decode(), "BATCHGATE_PUBLIC_URL": base,
           "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_LOG_LEVEL": "WARNING",
           "BATCHGATE_DATA_DIR": str(data)}
    ledger = Ledger(redis_client, own)
    deliverer = Deliverer(ledger, retry=RetryPolicy(initial_interval=timedelta(milliseconds=200),
                                                    maximum_interval=timedelta(seconds=2)),
                          interval=timedelta(milliseconds=100))
    sup = Supervisor(ledger, name="e2e", dispatcher=Dispatcher.build(own, ledger), deliverer=deliverer)
    threading.Thread(target=sup.run, daemon=True).start()
    pool = Workers(env, count=1)
    pool.start()
    try:
        yield ApiClient(base, TOKEN), ledger
    finally:
        pool.kill()
        sup.stop.set()
        stop_api()


def wait_for(what: str, check, timeout_s: float, every: float = 0.1):
    deadline = time.monotonic() + timeout_s
    while not (got := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(every)
    return got


def pending_ids(api: ApiClient) -> list[str]:
    ids, path = [], "/v1/approvals?status=pending&limit=37"
    while path:
        page = api.get(path).json()
        ids += [a["id"] for a in page["approvals"]]
        path = page["next"]
    return ids


def test_three_stage_flow_with_people_and_events(settings, redis_client, tmp_path):
    receiver = Receiver()
    with StandInPlatform(seed=3) as platform, \
            stack(settings, redis_client, tmp_path / "data") as (api, ledger):
        sub = api.post("/v1/subscriptions", json={"url": receiver.url, "events": list(EVENT_TYPES)})
        assert sub.status_code == 201, sub.text
        receiver.secret = sub.json()["secret"]
        assert api.post("/v1/flows", json=flow(platform.url)).status_code == 201
        job_id = api.post("/v1/jobs", json={"flow_id": "reviewed"}).json()["job_id"]

        def all_waiting():
            ids = pending_ids(api)
            return ids if len(ids) == BATCHES else None

        def requested_events():
            got = [evs[0] for evs in receiver.seen().values() if evs[0]["type"] == "approval.requested"]
            return got if len(got) >= 20 else None

        ids = wait_for("every batch to wait for a person", all_waiting, 90, every=0.5)
        assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "waiting_human"
        # the links come from the approval.requested events the receiver got
        requested = wait_for("the approval.requested events", requested_events, 60)
        by_link = {}
        for event in requested:
            (link,) = event["data"]["links"]
            assert link["approver"] is None and "/decide/" in link["url"]
            by_link.setdefault(event["data"]["approval_id"], link["url"])
        link_ids = sorted(by_link)[:10]

        receiver.down()
        went_down = time.monotonic()
        rest = [i for i in ids if i not in link_ids]
        random.Random(11).shuffle(rest)
        rejected, edited, approved = rest[:10], rest[10:20], rest[20:55]  # the rest times out
        for aid in rejected:
            res = api.post(f"/v1/approvals/{aid}", json={"decision": "reject", "comment": "not good enough"})
            assert res.status_code == 200 and res.json()["status"] == "rejected"
        for aid in edited:
            res = api.post(f"/v1/approvals/{aid}", json={"decision": "approve",
                                                          "output": {"scores": {"edited": 1}}})
            assert res.status_code == 200 and res.json()["decision"]["edited_output"]
        for aid in approved:
            assert api.post(f"/v1/approvals/{aid}", json={"decision": "approve"}).status_code == 200
        assert api.post(f"/v1/approvals/{rejected[0]}", json={"decision": "approve"}).status_code == 409
        for aid in link_ids:
            page = requests.get(by_link[aid], timeout=10)  # a link preview: decides nothing
            assert page.status_code == 200 and 'value="approve"' in page.text
            assert api.get(f"/v1/approvals/{aid}").json()["status"] == "pending"
            done = requests.post(by_link[aid], data={"decision": "approve"}, timeout=10)
            assert done.status_code == 200, done.text
            again = requests.post(by_link[aid], data={"decision": "approve"}, timeout=10)
            assert again.status_code == 409  # one decision per link
        time.sleep(max(0.0, DOWN_S - (time.monotonic() - went_down)))
        tried = api.get(f"/v1/subscriptions/{sub.json()['id']}/deliveries?limit=100").json()["deliveries"]
        refused = [d for d in tried if d["status"] is None and d["at_ms"] >= (time.time() - DOWN_S) * 1000]
        assert refused, "no delivery was tried while the receiver was down"
        receiver.up()

        def ended():
            job = api.get(f"/v1/jobs/{job_id}").json()
            return job if job["status"] in ("succeeded", "failed") else None

        job = wait_for("the job to end", ended, TIMEOUT_S + 90, every=0.5)
        # the failure budget decides: 10 rejected of 100 batches, 15 % tolerated
        assert job["batches"]["failed"] == len(rejected)
        assert job["status"] == ("succeeded" if len(rejected) * 100 <= TOLERATED * BATCHES else "failed")
        timed_out = [a for a in ids if a not in set(rejected) | set(edited) | set(approved) | set(link_ids)]
        for aid in timed_out[:5]:
            view = api.get(f"/v1/approvals/{aid}").json()
            assert view["status"] == "approved" and view["decision"]["actor"] == "supervisor:timeout"
        for aid in link_ids[:3]:
            assert api.get(f"/v1/approvals/{aid}").json()["decision"]["actor"] == "link"

        # every approved batch stored once, with the edited output where one was given
        stored = requests.get(f"{platform.url}/stored", timeout=10).json()
        assert len(stored) == BATCHES - len(rejected) and platform.store_repeats == 0
        edited_seqs = {int(a.split(".")[1]) for a in edited}
        assert {v["seq"] for v in stored.values() if v["scores"] == {"edited": 1}} == edited_seqs
        assert not {int(a.split(".")[1]) for a in rejected} & {v["seq"] for v in stored.values()}

        # every event of the outbox reached the receiver at least once, signed, duplicates alike
        outbox = redis_client.xrange(ledger.keys.job(job_id).events)
        expected = {f"{job_id}:{entry_id}": fields["type"] for entry_id, fields in outbox}
        types = set(expected.values())
        assert {"approval.requested", "approval.decided", "batch.failed", "job.succeeded"} <= types
        assert sum(1 for t in expected.values() if t == "approval.decided") == BATCHES
        wait_for("every event to be delivered", lambda: set(expected) <= set(receiver.seen()), 60)
        seen = receiver.seen()
        assert receiver.bad_signatures == 0
        for msg_id, events in seen.items():
            assert {e["type"] for e in events} == {expected[msg_id]}
            assert all(e["data"] == events[0]["data"] for e in events[1:]), msg_id
        assert any(len(events) > 1 for events in seen.values()), "no duplicate was delivered"
        failed_batches = [e for evs in seen.values() for e in evs[:1] if e["type"] == "batch.failed"]
        assert {e["data"]["error_type"] for e in failed_batches} == {"rejected"}
        assert all(re.fullmatch(r"job_[0-9a-f]+:\d+-\d+", m) for m in seen)
