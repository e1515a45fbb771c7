"""Chaos: the outages a long push job meets spend no attempt and fail no batch.

One job of 120 one-item batches through an n8n-style sync webhook on 127.0.0.1, run by a real
`batchgate worker` process, while, in turn (the issue's script):
1. Redis is killed (SIGKILL) and restarted from its AOF with calls in flight;
2. the platform refuses connections for 60 s (its listening socket closed);
3. the platform boots for 10 s: its webhooks answer n8n's HTML 404 "Cannot POST";
4. the worker is stopped (SIGTERM) for 3 minutes, then started again.
The job must succeed with zero failed batches, every batch paid for exactly once and no attempt spent
on any of these (each batch's spent attempts == 1: the one call that answered).
"""

from __future__ import annotations

import json
import signal
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import redis
from pydantic import SecretStr

from gateway.push.dispatch import target_id
from gateway.ledger.embedded import EmbeddedRedis, client_for
from tests.platforms import respond, serve_on
from tests.test_worker_concurrency import stack

pytestmark = pytest.mark.slow

BOOT_404 = ("<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n<title>Error</title>\n"
            "</head>\n<body>\n<pre>Cannot POST /webhook/score</pre>\n</body>\n</html>\n")


class ChaosPlatform:
    """An n8n-like sync webhook: 'ok' answers the contract after ``delay``; 'booting' answers the HTML
    404 n8n serves before its webhooks are registered; 'down' closes the listening socket."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.mode = "ok"
        self.paid: Counter = Counter()  # answered calls per seq (what the user pays for)
        self.refused_404 = 0
        self.lock = threading.Lock()
        self.server = self._serve(0)
        self.port = self.server.server_port
        self.url = f"http://127.0.0.1:{self.port}/webhook/score"

    def _serve(self, port: int) -> ThreadingHTTPServer:
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if outer.mode == "booting":
                    with outer.lock:
                        outer.refused_404 += 1
                    respond(self, 404, BOOT_404.encode(), "text/html; charset=utf-8")
                    return
                time.sleep(outer.delay)
                with outer.lock:
                    outer.paid[body["seq"]] += 1
                respond(self, 200, {"status": "succeeded", "output": {"seq": body["seq"]}})

        return serve_on(Handler, port)

    def down(self) -> None:
        self.mode = "down"
        self.server.shutdown()
        self.server.server_close()

    def boot(self) -> None:
        self.mode = "booting"
        self.server = self._serve(self.port)

    def up(self) -> None:
        self.mode = "ok"

    def close(self) -> None:
        if self.mode != "down":
            self.server.shutdown()
            self.server.server_close()


def committed(client: redis.Redis, ledger, job_id: str) -> int:
    try:
        return int(client.hget(ledger.keys.job(job_id).job, "n_done") or 0)
    except redis.ConnectionError:
        return -1


def wait_for(what, timeout_s: float, message: str, why=lambda: "") -> None:
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, f"{message}\n{why()}"
        time.sleep(0.05)


def state(s, client: redis.Redis, job_id: str, proc, platform: ChaosPlatform, worker_log: Path) -> str:
    """What a stalled run looks like: the worker and its log, the target's breaker and slots, the job and
    the tail of its log."""
    tid = target_id({"url": platform.url})
    k = s.ledger.keys
    tail = [f for _, f in client.xrevrange(k.job(job_id).log, count=15)][::-1]
    lines = worker_log.read_text(errors="replace").splitlines()[-30:] if worker_log.exists() else []
    return (f"worker exit code: {proc.poll()}; platform mode {platform.mode}, "
            f"paid {sum(platform.paid.values())}\nworker log tail:\n" + "\n".join(lines) +
            f"\nbreaker: {client.hgetall(k.target_breaker(tid))}"
            f"\nslots: {client.zrange(k.target_slots(tid), 0, -1, withscores=True)}"
            f"\nsupervisor alive: {s.sup_thread.is_alive()}; redis time {client.time()}; leases: "
            f"{client.zrange(k.job(job_id).leases, 0, -1, withscores=True)}"
            f"\njob: {s.job(job_id)}\nlog tail: {tail}")


def test_redis_restart_platform_outage_boot_404s_and_a_stopped_worker_spend_no_attempt(
        settings, tmp_path):
    batches = 120
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    client = client_for(url)
    own = settings.model_copy(update={"redis_url": SecretStr(url)})
    platform = ChaosPlatform(delay=0.2)
    flow = {"id": "chaos", "version": "1", "batching": {"max_items": 1}, "concurrency": 4,
            "source": {"type": "sequence", "count": batches},
            "stages": [{"name": "score", "lease": 10, "timeout": 5, "idempotent": False,
                        "retry": {"initial_interval": 0.1, "maximum_attempts": 2},
                        "target": {"type": "n8n", "url": platform.url, "mode": "sync", "max_in_flight": 4}}]}
    try:
        with stack(own, client, tmp_path / "data") as s:
            worker_log = tmp_path / "worker.log"
            proc = s.worker(4, log_to=worker_log, BATCHGATE_LOG_LEVEL="INFO")
            assert s.api.post("/v1/flows", json=flow).status_code == 201
            job_id = s.api.post("/v1/jobs", json={"flow_id": "chaos"}).json()["job_id"]

            # 1. Redis killed and restarted with calls in flight
            wait_for(lambda: committed(client, s.ledger, job_id) >= 20, 60, "no progress before the kill")
            server.kill()
            time.sleep(1)
            server = EmbeddedRedis(tmp_path / "redis")
            assert server.start() == url
            why = lambda: state(s, client, job_id, proc, platform, worker_log)  # noqa: E731
            wait_for(lambda: committed(client, s.ledger, job_id) >= 40, 60,
                     "no progress after Redis came back", why)

            # 2. the platform refuses connections for 60 s, 3. then boots with 404s for 10 s
            platform.down()
            time.sleep(60)
            waiting = s.job(job_id)
            platform.boot()
            time.sleep(10)
            platform.up()
            wait_for(lambda: committed(client, s.ledger, job_id) >= 70, 90, "no progress after the outage",
                     why)

            # 4. the worker stopped for a deploy: 3 minutes
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(timeout=30) == 0
            time.sleep(180)
            s.worker(4, log_to=worker_log, BATCHGATE_LOG_LEVEL="INFO")
            done = s.wait_done(job_id, 120)
            records = s.batches(job_id, batches)
            log = s.log(job_id)
    finally:
        platform.close()
        server.stop()
    assert done["status"] == "succeeded", done
    assert done["batches"]["failed"] == 0 and done["batches"]["completed"] == batches
    assert waiting["status"] == "running" and waiting["waiting"] is not None, waiting  # shown, not failed
    assert "unavailable" in waiting["waiting"]["reason"] or "reach" in waiting["waiting"]["reason"]
    assert platform.refused_404 >= 1  # the boot 404s were met
    assert dict(platform.paid) == {seq: 1 for seq in range(batches)}  # each batch paid for once
    spent = {seq: int(r["attempt"]) - int(r.get("unspent") or 0) for seq, r in enumerate(records)}
    assert spent == {seq: 1 for seq in range(batches)}, {k: v for k, v in spent.items() if v != 1}
    # a lease whose call could not begin while Redis was down expires without spending an attempt
    assert not [e for e in log if e["event"] == "batch_failed" or (
        e["event"] == "retry_scheduled" and "no attempt spent" not in e["error"])]
    assert [e for e in log if e["event"] == "target_unavailable"]
