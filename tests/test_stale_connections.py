"""Stale keep-alive connections: a call the platform never read is not taken for "may have run".

A keep-alive server closes a connection idle for its timeout (Node, so n8n, after 5 s). A request written
to a pooled connection the server has just closed fails before any answer, and the platform never read
it; batchgate used to class that as "the flow may have run" and fail a stage that is not idempotent as
``outcome_unknown`` (about one n8n job in nine). gateway.net.keepalive: pooled connections idle past a limit
are not reused, and a request whose bytes the peer's TCP never acknowledged is sent once more on a fresh
connection. Real sockets on 127.0.0.1 throughout; the platforms count what they billed by Idempotency-Key.
"""

from __future__ import annotations

import json
import random
import socket
import sys
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import urllib3.connectionpool

from connectors import get_connector
from connectors.base import PlatformError, Retry
from gateway.push.dispatch import Dispatcher
from gateway.errors import NotFound
from gateway.net.keepalive import delivery_verdict, idle_limit, tcp_state
from gateway.ledger.ledger import Ledger
from gateway.net.outbound import guarded_session
from gateway.net.urlguard import Allowlist
from tests.connectors.helpers import call
from tests.platforms import respond

LINUX = sys.platform.startswith("linux")
needs_tcp_info = pytest.mark.skipif(not LINUX, reason="the delivery proof reads Linux TCP_INFO")


class KeepAlivePlatform:
    """A sync platform that keeps connections alive and closes one idle for ``idle_close_s``.

    ``after_answer``: "keep" (keep-alive, like Node), "close" (closes right after answering, without
    saying so: the worst moment of an idle close), "read_then_close" (reads the next request on the
    connection, then closes without answering, as a platform that crashed mid-call). Answers take
    ``random.uniform(*answer_s)``. ``billed`` counts each Idempotency-Key the platform read; ``connections``
    counts accepted connections. ``hint`` adds ``Keep-Alive: timeout=<hint>`` to answers.
    """

    def __init__(self, idle_close_s: float = 10.0, answer_s: tuple[float, float] = (0.0, 0.0),
                 after_answer: str = "keep", hint: int | None = None, seed: int = 7) -> None:
        self.billed: Counter[str] = Counter()
        self.connections = 0
        self.lock = threading.Lock()
        self.after_answer = after_answer
        rng = random.Random(seed)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"
            timeout = idle_close_s  # an idle connection is closed after this, as Node's keepAliveTimeout

            def setup(self):
                super().setup()
                self.served = 0
                with outer.lock:
                    outer.connections += 1

            def log_message(self, *args):
                pass

            def do_POST(self):
                if self.served and outer.after_answer == "read_then_close":
                    self.rfile.read(int(self.headers["Content-Length"]))
                    with outer.lock:
                        outer.billed[self.headers["Idempotency-Key"]] += 1
                    self.close_connection = True  # read, ran, never answered
                    return
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with outer.lock:
                    outer.billed[self.headers["Idempotency-Key"]] += 1
                    delay = rng.uniform(*answer_s)
                time.sleep(delay)
                items = json.loads(body).get("items") or []
                self.served += 1
                if hint is not None:
                    self.send_response(200)
                    data = b'{"status": "succeeded", "output": {"n": %d}}' % len(items)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.send_header("Keep-Alive", f"timeout={hint}")
                    self.end_headers()
                    self.wfile.write(data)
                else:
                    respond(self, 200, {"status": "succeeded", "output": {"n": len(items)}})
                if outer.after_answer == "close":
                    self.wfile.flush()
                    self.close_connection = True  # closed without "Connection: close"

        self.server = _NodeLikeServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _NodeLikeServer(ThreadingHTTPServer):
    """Closes a connection as Node (so n8n) does when its keep-alive timeout fires: ``close()`` at once.
    Python's socketserver half-closes first (``shutdown(SHUT_WR)``, then ``close()``); a request that
    arrives between the two is acknowledged by the kernel and never read, which no platform here does."""

    daemon_threads = True
    request_queue_size = 512

    def shutdown_request(self, request: socket.socket) -> None:
        self.close_request(request)


@pytest.fixture
def push(settings, redis_client):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
    ledger = Ledger(redis_client, own)
    return ledger, Dispatcher.build(own, ledger)


def stage(url: str, **target: object) -> list[dict]:
    return [{"name": "score", "idempotent": False, "lease": 10, "timeout": 5,
             "retry": {"initial_interval": 0.01, "maximum_attempts": 3},
             "target": {"type": "http", "url": url, "mode": "sync", **target}}]


def outcome_unknown(ledger: Ledger, job_id: str, batches: int) -> list[int]:
    """Seqs of the planned batches (up to ``batches``) that failed outcome_unknown."""
    found = []
    for seq in range(batches):
        try:
            record = ledger.batch_record(job_id, seq)
        except NotFound:
            break
        if record.get("error_type") == "outcome_unknown":
            found.append(seq)
    return found


@pytest.fixture
def fin_unseen(monkeypatch):
    """urllib3's check before reuse does not see the server's close (it landed just after the check)."""
    monkeypatch.setattr(urllib3.connectionpool, "is_connection_dropped", lambda conn: False)


# -- the proof -------------------------------------------------------------------------------------

REQUEST = b"POST /hook HTTP/1.1\r\nContent-Length: 0\r\n\r\n"


@needs_tcp_info
@pytest.mark.parametrize("steps,acked,not_read", [
    (("close", "write"), False, True),  # the peer closed before the request came: reset, not a byte acked
    (("write", "read", "close"), True, False),  # read, then closed (a crash mid-call): FIN after the bytes
    (("write", "close"), True, True),   # its kernel took the bytes, the application closed unread: reset
    (("write", "read"), True, False),   # still working on it (what a read timeout sees)
], ids=["closed-before", "read-then-closed", "closed-unread", "still-working"])
def test_the_delivery_verdict_reads_what_the_peers_tcp_did_with_the_request(steps, acked, not_read):
    with socket.create_server(("127.0.0.1", 0)) as srv:
        client = socket.create_connection(srv.getsockname())
        peer, _ = srv.accept()
        before = tcp_state(client)
        for step in steps:
            if step == "close":
                peer.close()
            elif step == "write":
                client.sendall(REQUEST)
            else:
                assert peer.recv(100) == REQUEST
            time.sleep(0.02)
        assert (tcp_state(client).acked > before.acked) is acked
        assert delivery_verdict(before, client) is not_read
        client.close()
        peer.close()


# -- the race, made certain ----------------------------------------------------------------------

@needs_tcp_info
def test_a_call_written_to_a_connection_the_platform_just_closed_is_sent_again_and_billed_once(
        push, make_job, fin_unseen):
    """The failure the issue measured, every time: the platform closes the pooled connection right after
    answering (without saying so) and the client's check does not see it. Before the fix the second
    batch failed outcome_unknown for a request the platform never read."""
    ledger, d = push
    platform = KeepAlivePlatform(after_answer="close")
    try:
        job_id = make_job(items=list(range(8)), max_items=1, stage_defs=stage(platform.url))
        for _ in range(8):
            assert d.run_ready(job_id, limit=1) == 1
            time.sleep(0.05)  # the platform's close has reached the client's socket
    finally:
        platform.close()
    assert ledger.job_fields(job_id)["status"] == "succeeded"
    assert outcome_unknown(ledger, job_id, 8) == []
    assert sorted(platform.billed.values()) == [1] * 8  # every key billed once
    assert platform.connections == 8  # each retry went out on a new connection
    assert {ledger.batch_record(job_id, seq)["attempt"] for seq in range(8)} == {"1"}


def test_a_platform_that_read_the_call_and_then_dropped_the_connection_is_not_called_again(
        push, make_job, fin_unseen):
    """The other side of the proof: the platform read the request (its TCP acknowledged it) and closed
    without answering, as a crash mid-call. The run may have happened: no silent second call."""
    ledger, d = push
    platform = KeepAlivePlatform(after_answer="read_then_close")
    try:
        job_id = make_job(items=[1, 2], max_items=1, stage_defs=stage(platform.url))
        assert d.run_ready(job_id, limit=1) == 1
        time.sleep(0.05)
        assert d.run_ready(job_id, limit=1) == 1  # on the pooled connection: read, then dropped
    finally:
        platform.close()
    assert sorted(platform.billed.values()) == [1, 1]
    assert outcome_unknown(ledger, job_id, 2) == [1]
    entry = [e for _, e in ledger.r.xrange(ledger.keys.job(job_id).log) if e["event"] == "batch_failed"]
    assert entry and "may have happened" in entry[-1]["error"]


@needs_tcp_info
def test_a_connection_closed_before_the_request_was_read_is_an_outage_not_may_have_run():
    """A fresh connection the server closes without reading (an overloaded or stopping server): the proof
    says nothing ran, so the call is an outage (no attempt spent, the target cools), not 'may have run'."""
    with socket.create_server(("127.0.0.1", 0)) as srv:
        port = srv.getsockname()[1]

        def refuse():
            for _ in range(2):
                try:
                    conn, _ = srv.accept()
                except OSError:  # the test is over and closed the socket (the client tried once)
                    return
                conn.close()  # accepted, then closed unread

        threading.Thread(target=refuse, daemon=True).start()
        target = {"type": "http", "url": f"http://127.0.0.1:{port}/hook", "mode": "sync"}
        session = guarded_session(Allowlist.parse(["127.0.0.1/32"]))
        time.sleep(0.05)
        with pytest.raises(PlatformError) as info:
            get_connector("http").trigger(call(target), session)
    assert info.value.outage and info.value.retry is Retry.RETRYABLE, info.value.message


@needs_tcp_info
def test_a_server_that_stops_with_the_call_in_its_accept_queue_ran_nothing():
    """The platform stops (its listening socket closes) while the call waits in its accept queue: the
    kernel acknowledged the request, no process ever read it, and the connection is reset. Before, that
    was 'may have run' (a chaos run failed a batch outcome_unknown this way); now it is an outage."""
    srv = socket.create_server(("127.0.0.1", 0), backlog=8)
    port = srv.getsockname()[1]
    target = {"type": "http", "url": f"http://127.0.0.1:{port}/hook", "mode": "sync"}
    session = guarded_session(Allowlist.parse(["127.0.0.1/32"]))
    threading.Timer(0.3, srv.close).start()  # never accepted: the platform stops
    with pytest.raises(PlatformError) as info:
        get_connector("http").trigger(call(target), session)
    assert info.value.outage and info.value.retry is Retry.RETRYABLE, info.value.message


# -- the idle limit --------------------------------------------------------------------------------

def connections_used(platform: KeepAlivePlatform, limit: float, calls: int, pause_s: float) -> int:
    """Connections one session opened for ``calls`` posts ``pause_s`` apart under ``idle_limit(limit)``."""
    session = guarded_session(Allowlist.parse(["127.0.0.1/32"]))
    before = platform.connections
    with idle_limit(limit):
        for n in range(calls):
            session.post(platform.url, data=b"{}", headers={"Idempotency-Key": f"k{n}"}, timeout=5)
            time.sleep(pause_s)
    session.close()
    return platform.connections - before


def test_a_pooled_connection_idle_past_the_target_limit_is_not_reused():
    platform = KeepAlivePlatform()
    try:
        assert connections_used(platform, 5.0, 3, 0.3) == 1  # idle 0.3 s < 5 s: one connection reused
        assert connections_used(platform, 0.2, 3, 0.3) == 3  # idle 0.3 s > 0.2 s: a new one each time
        assert connections_used(platform, 0, 2, 0.0) == 2  # 0: never reused
    finally:
        platform.close()


def test_the_servers_keep_alive_hint_shortens_the_limit():
    """A server that says ``Keep-Alive: timeout=1`` closes idle connections after 1 s: batchgate reuses
    a connection only within that hint less a second, whatever the target allows."""
    platform = KeepAlivePlatform(hint=1)
    try:
        assert connections_used(platform, 30.0, 3, 0.05) == 3
    finally:
        platform.close()


def test_keepalive_idle_is_checked_when_the_flow_is_registered(api):
    url = "http://93.184.216.34/hook"  # a public address: the guard checks it, nothing is sent there
    flow = {"id": "ka", "version": "1", "source": {"type": "sequence", "count": 1}}
    for bad in (-1, "5s", True, 3601):
        resp = api.post("/v1/flows", json={**flow, "stages": stage(url, keepalive_idle=bad)})
        assert resp.status_code == 422, resp.text
        assert "keepalive_idle must be a number of seconds" in resp.json()["errors"][0]["message"]
    resp = api.post("/v1/flows", json={**flow, "stages": stage(url, keepalive_idle=0.5)})
    assert resp.status_code == 201, resp.text
    assert api.get("/v1/flows/ka").json()["flow"]["stages"][0]["target"]["keepalive_idle"] == 0.5


# -- the measure: 2,000 calls each against servers closing idle connections at 1 s and 5 s --

def run_worker_job(settings, redis_client, tmp_path, *, idle_close_s: float, calls: int,
                   concurrency: int, threads: int) -> tuple[dict, KeepAlivePlatform, list[int], list[dict]]:
    from tests.test_worker_concurrency import stack, start_job

    platform = KeepAlivePlatform(idle_close_s=idle_close_s, answer_s=(0.2 * idle_close_s, 1.8 * idle_close_s))
    spec = {"id": "stale", "version": "1", "batching": {"max_items": 1}, "concurrency": concurrency,
            "source": {"type": "sequence", "count": calls},
            "stages": [{"name": "score", "idempotent": False, "lease": 60, "timeout": 30,
                        "retry": {"initial_interval": 0.1, "maximum_attempts": 3},
                        # reuse allowed past the server's timeout: the race is left to the proof to catch
                        "target": {"type": "http", "url": platform.url, "mode": "sync",
                                   "max_in_flight": concurrency, "keepalive_idle": 2 * idle_close_s}}]}
    try:
        with stack(settings, redis_client, tmp_path / "data") as s:
            s.worker(threads, log_to=tmp_path / "worker.log", BATCHGATE_LOG_LEVEL="DEBUG")
            job_id = start_job(s, spec)
            job = s.wait_done(job_id, 600)
            unknown = outcome_unknown(s.ledger, job_id, calls)
            log = [e for e in s.log(job_id) if e["event"] in ("platform_error", "batch_failed")]
    finally:
        platform.close()
    return job, platform, unknown, log


@pytest.mark.slow
@pytest.mark.parametrize("idle_close_s,concurrency", [(1.0, 64), (5.0, 200)])
def test_2000_calls_through_a_server_closing_idle_connections_fail_none_and_bill_each_key_once(
        settings, redis_client, tmp_path, idle_close_s, concurrency):
    """Answers spread around the server's idle timeout (0.2x to 1.8x), and twice as many call threads
    as the job's concurrency, so each thread's pooled connection sits idle for about one answer's time:
    thousands of reuses near the moment the server closes. Not one batch fails outcome_unknown, and the
    platform bills every key once."""
    calls = 2000
    job, platform, unknown, errors = run_worker_job(settings, redis_client, tmp_path,
                                                    idle_close_s=idle_close_s, calls=calls,
                                                    concurrency=concurrency, threads=2 * concurrency)
    assert unknown == [] and errors == [], (job["status"], [e.get("error") for e in errors[:5]])
    assert job["status"] == "succeeded", job
    assert len(platform.billed) == calls and set(platform.billed.values()) == {1}
    assert platform.connections > concurrency  # the server did close idle connections along the way
