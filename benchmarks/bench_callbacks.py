"""Callback mode at volume: thousands of batches awaiting callbacks at once cost Redis memory only.

Run: .venv/bin/python benchmarks/bench_callbacks.py [BATCHES] [HOLD_S]   (defaults 2000, 5.0)
A local platform takes each trigger at once (202) and posts the answer to the batch's signed callback
URL HOLD_S seconds later (a timer heap and 32 posting threads). batchgate: the API (werkzeug, threaded, in
this process), one `batchgate worker --concurrency 64` process, a one-stage callback-mode flow over
BATCHES one-item batches with flow concurrency BATCHES. Reported: the peak of batches awaiting their
callback at once (leased, triggered, not answered), that every batch committed once (callbacks accepted
vs duplicates), the worker's threads (fixed, whatever waits), and Redis memory per waiting batch:
(used_memory at the peak - used_memory before the job) / batches waiting, which counts the batch hash,
its lease and its log entries.
"""

from __future__ import annotations

import heapq
import json
import logging
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import requests
from _common import ledger_on_private_redis
from pydantic import SecretStr
from werkzeug.serving import make_server

from gateway.api.app import create_app
from gateway.push.dispatch import Dispatcher
from gateway.ledger.flows import parse_flow
from gateway.ledger.jobs import JobRequest

TOKEN = "t-bench-0123456789"


class CallbackPlatform:
    """Answers 202 at once; posts the answer to callback_url after ``hold_s``."""

    def __init__(self, hold_s: float) -> None:
        self.hold_s = hold_s
        self.heap: list[tuple[float, int, str, int]] = []
        self.cond = threading.Condition()
        self.triggers = 0
        self.posted: dict[str, int] = {}
        self.duplicates = 0
        self.n = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.cond:
                    outer.triggers += 1
                    outer.n += 1
                    heapq.heappush(outer.heap, (time.monotonic() + outer.hold_s, outer.n,
                                                body["callback_url"], body["seq"]))
                    outer.cond.notify()
                self.send_response(202)
                self.send_header("Content-Length", "0")
                self.end_headers()

        ThreadingHTTPServer.request_queue_size = 512
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        for _ in range(32):
            threading.Thread(target=self._poster, daemon=True).start()

    def _poster(self) -> None:
        session = requests.Session()
        while True:
            with self.cond:
                while not self.heap or self.heap[0][0] > time.monotonic():
                    self.cond.wait(0.01 if self.heap else 1)
                _, _, url, seq = heapq.heappop(self.heap)
            resp = session.post(url, json={"status": "succeeded", "output": {"seq": seq}}, timeout=30)
            body = resp.json() if resp.ok else {}
            with self.cond:
                self.posted[url] = resp.status_code
                if body.get("duplicate"):
                    self.duplicates += 1


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 2000
    hold = float(sys.argv[2]) if len(sys.argv) > 2 else 5.0
    platform = CallbackPlatform(hold)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # no access log line per callback
    with ledger_on_private_redis() as (ledger, service):
        os.sched_setaffinity(0, set(range(os.cpu_count() or 1)))
        app_holder: dict = {}
        server = make_server("127.0.0.1", 0, lambda e, s: app_holder["app"](e, s), threaded=True)
        base = f"http://127.0.0.1:{server.server_port}"
        settings = ledger.settings.model_copy(update={
            "outbound_allow": ["127.0.0.1/32"], "signing_key": SecretStr("bench-signing-key"),
            "public_url": base})
        ledger.settings = settings
        app_holder["app"] = create_app(settings, ledger.r)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        env = {**os.environ, "BATCHGATE_REDIS_URL": settings.redis_url.get_secret_value(),
               "BATCHGATE_KEY_PREFIX": settings.key_prefix, "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]',
               "BATCHGATE_SIGNING_KEY": "bench-signing-key", "BATCHGATE_LOG_LEVEL": "WARNING",
               "BATCHGATE_PUBLIC_URL": base}
        flow = parse_flow({"id": "cb", "version": "1", "concurrency": batches, "batching": {"max_items": 1},
                           "source": {"type": "sequence", "count": batches},
                           "stages": [{"name": "score", "lease": 600, "timeout": 10,
                                       "target": {"type": "http", "url": platform.url, "mode": "callback",
                                                  "max_in_flight": 64}}]})
        service.flows.register("bench", flow)
        proc = subprocess.Popen([sys.executable, "-m", "gateway.runtime.cli", "worker", "--concurrency", "64"],
                                env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(3)
        threads = len(os.listdir(f"/proc/{proc.pid}/task"))
        mem_before = ledger.r.info("memory")["used_memory"]
        t0 = time.perf_counter()
        job_id = service.create("bench", JobRequest(flow_id="cb"))["job_id"]
        Dispatcher.build(settings, ledger).kick(job_id)
        k = ledger.keys.job(job_id)
        peak_waiting, mem_peak = 0, mem_before
        while ledger.r.hget(k.job, "status") == "running":
            waiting = ledger.r.zcard(k.leases)
            if waiting > peak_waiting:
                peak_waiting, mem_peak = waiting, ledger.r.info("memory")["used_memory"]
            time.sleep(0.05)
        elapsed = time.perf_counter() - t0
        status = ledger.r.hget(k.job, "status")
        done = int(ledger.r.hget(k.job, "n_done"))
        threads_end = len(os.listdir(f"/proc/{proc.pid}/task"))
        proc.terminate()
        proc.wait()
        server.shutdown()
    accepted = sum(1 for code in platform.posted.values() if code == 200)
    print(f"{batches} batches, callbacks held {hold:g} s: job {status} in {elapsed:.1f} s, {done} committed")
    print(f"peak awaiting callbacks at once: {peak_waiting} ({platform.triggers} triggers, "
          f"{accepted} callbacks accepted, {platform.duplicates} duplicates)")
    print(f"worker threads: {threads} before, {threads_end} after (fixed: no thread per waiting batch)")
    print(f"Redis memory per waiting batch: {(mem_peak - mem_before) / max(peak_waiting, 1):,.0f} B "
          f"(used_memory {mem_before:,} -> {mem_peak:,} at the peak)")


if __name__ == "__main__":
    main()
