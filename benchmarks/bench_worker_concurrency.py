"""One `batchgate worker` process against a slow platform: --concurrency 1 (the baseline) vs 64.

Run: .venv/bin/python benchmarks/bench_worker_concurrency.py [BATCHES] [DELAY_S]   (defaults 64, 2.0)
A local sync platform answers each call after DELAY_S seconds and counts the calls in flight. A one-stage
push flow (concurrency 64, max_in_flight 64) over BATCHES batches runs twice on a fresh job, each time
with one worker process: first --concurrency 1, then --concurrency 64; each is timed from job creation
to 'succeeded'. Prints both times, the speed-up, the peak calls in flight and the paid calls per batch.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from _common import ledger_on_private_redis
from rq import Worker

from gateway.dispatch import Dispatcher
from gateway.flows import parse_flow
from gateway.jobs import JobRequest


class SlowPlatform:
    def __init__(self, delay: float) -> None:
        self.delay, self.calls, self.in_flight, self.peak = delay, 0, 0, 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.calls += 1
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                time.sleep(outer.delay)
                with outer.lock:
                    outer.in_flight -= 1
                data = json.dumps({"status": "succeeded", "output": {"n": len(body["items"])}}).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        ThreadingHTTPServer.request_queue_size = 512
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}/score"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def reset(self) -> None:
        with self.lock:
            self.calls, self.peak = 0, 0


def run(service, env, platform: SlowPlatform, batches: int, concurrency: int, tag: str) -> float:
    flow = parse_flow({"id": f"slow-{tag}", "version": "1", "concurrency": 64, "batching": {"max_items": 1},
                       "source": {"type": "sequence", "count": batches},
                       "stages": [{"name": "score", "lease": 30, "timeout": 10,
                                   "target": {"type": "http", "url": platform.url, "mode": "sync",
                                              "max_in_flight": 64}}]})
    service.flows.register("bench", flow)
    ledger = service.ledger
    dispatcher = Dispatcher.build(ledger.settings, ledger)
    proc = subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker",
                             "--concurrency", str(concurrency)], env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    boot = time.monotonic() + 60  # let the worker boot: every thread registered with RQ
    while Worker.count(queue=dispatcher.queue) < concurrency and time.monotonic() < boot:
        time.sleep(0.1)
    platform.reset()
    try:
        t0 = time.perf_counter()
        job_id = service.create("bench", JobRequest(flow_id=f"slow-{tag}"))["job_id"]
        dispatcher.pump(job_id)
        while ledger.r.hget(ledger.keys.job(job_id).job, "status") == "running":
            time.sleep(0.02)
        elapsed = time.perf_counter() - t0
        assert ledger.r.hget(ledger.keys.job(job_id).job, "status") == "succeeded"
    finally:
        proc.terminate()
        proc.wait()
    return elapsed


def main() -> None:
    batches = int(sys.argv[1]) if len(sys.argv) > 1 else 64
    delay = float(sys.argv[2]) if len(sys.argv) > 2 else 2.0
    platform = SlowPlatform(delay)
    with ledger_on_private_redis() as (ledger, service):
        settings = ledger.settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"],
                                                      "signing_key": "bench-signing-key"})
        ledger.settings = settings
        env = {**os.environ, "BATCHGATE_REDIS_URL": settings.redis_url.get_secret_value(),
               "BATCHGATE_KEY_PREFIX": settings.key_prefix, "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]',
               "BATCHGATE_SIGNING_KEY": "bench-signing-key", "BATCHGATE_LOG_LEVEL": "WARNING"}
        t1 = run(service, env, platform, batches, 1, "c1")
        calls1, peak1 = platform.calls, platform.peak
        t64 = run(service, env, platform, batches, 64, "c64")
        calls64, peak64 = platform.calls, platform.peak
    platform.server.shutdown()
    print(f"{batches} batches, platform {delay:g} s per call, one worker process")
    for name, t, peak, calls in (("1: ", t1, peak1, calls1), ("64:", t64, peak64, calls64)):
        print(f"--concurrency {name} {t:6.2f} s, peak {peak} calls in flight, "
              f"{calls / batches:.2f} paid calls per batch")
    print(f"speed-up 64 vs 1 = {t1 / t64:.1f}x")


if __name__ == "__main__":
    main()
