"""A local stand-in for a low-code platform, for the push-mode demo and tests.

It plays two workflows the way an n8n or Dify flow would:

POST /score       callback mode: answers 200 "Workflow was started" at once, scores the envelope's
                  resumes in the background (one simulated paid model call each) and POSTs the result
                  to the envelope's ``callback_url``.
POST /score-sync  sync mode: scores the envelope's resumes while the caller waits and answers with the
                  contract ``{"status", "output": {"scores"}}``. A caller that dies meanwhile does not
                  stop the run: the platform finishes it (and pays for it), the answer is lost.
POST /store       sync mode: stores the scores under the request's ``Idempotency-Key`` (a repeat with
                  the same key stores nothing new) and answers with the contract ``{"status", "output"}``.
GET  /stats       what happened, from the platform's own records: calls per path, paid model calls
                  (``model_calls``, ``scored`` per resume), scoring runs per batch idempotency key
                  (``score_runs``), the scoring runs going on right now (``in_flight``,
                  ``in_flight_runs``), stored keys and repeated stores.
GET  /stored      the stored scores by idempotency key: {key: {"seq": batch seq, "scores": {...}}}.

Knobs make it unreliable on purpose: ``fail_rate`` (HTTP 500 "Error in workflow"), ``drop_rate``
(accept, never call back), ``duplicate_rate`` (call back twice), ``delay_s`` per resume.

Run alone: python standin_platform.py [--port 8765] [--fail-rate 0.2] [--drop-rate 0.05]
"""

from __future__ import annotations

import argparse
import hashlib
import itertools
import json
import random
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import requests

PROFILE_SKILLS = {"python", "sql", "airflow", "spark", "dbt"}


def score(resume: dict) -> int:
    """Deterministic stand-in for an LLM scoring call."""
    overlap = len(set(resume.get("skills", [])) & PROFILE_SKILLS)
    noise = int(hashlib.sha1(str(resume.get("id")).encode()).hexdigest(), 16) % 10
    return min(100, overlap * 20 + min(int(resume.get("years", 0)), 10) * 3 + noise)


class StandInPlatform:
    """The server and its bookkeeping; use as a context manager or call start()/stop()."""

    def __init__(self, port: int = 0, fail_rate: float = 0.0, drop_rate: float = 0.0,
                 duplicate_rate: float = 0.0, delay_s: float = 0.0, seed: int = 1) -> None:
        self.fail_rate, self.drop_rate, self.duplicate_rate = fail_rate, drop_rate, duplicate_rate
        self.delay_s = delay_s
        self.rng = random.Random(seed)
        self.lock = threading.Lock()
        self.calls: Counter = Counter()
        self.model_calls = 0
        self.scored: Counter = Counter()
        self.score_runs: Counter = Counter()
        self.running: dict[int, tuple[str, Any, float]] = {}
        self.run_ids = itertools.count()
        self.stored: dict[str, Any] = {}
        self.store_repeats = 0
        self.http = requests.Session()
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler())
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"

    def __enter__(self) -> StandInPlatform:
        self.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    def start(self) -> None:
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05},
                         daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    def stats(self) -> dict[str, Any]:
        with self.lock:
            now = time.monotonic()
            runs = [{"idempotency_key": key, "seq": seq, "running_s": round(now - started, 3)}
                    for key, seq, started in self.running.values()]
            return {"calls": dict(self.calls), "model_calls": self.model_calls, "scored": dict(self.scored),
                    "score_runs": dict(self.score_runs), "in_flight": len(runs), "in_flight_runs": runs,
                    "stored_keys": len(self.stored), "store_repeats": self.store_repeats}

    def _roll(self, rate: float) -> bool:
        with self.lock:
            return self.rng.random() < rate

    # -- workflows ---------------------------------------------------------------------------

    def handle_score(self, env: dict) -> tuple[int, dict]:
        if self._roll(self.fail_rate):
            return 500, {"message": "Error in workflow"}
        drop, dup = self._roll(self.drop_rate), self._roll(self.duplicate_rate)
        threading.Thread(target=self._score_and_call_back, args=(env, drop, dup), daemon=True).start()
        return 200, {"message": "Workflow was started"}

    def begin_run(self, env: dict) -> int:
        """A scoring run starts: it is in flight until its answer is sent (or dropped)."""
        with self.lock:
            run_id = next(self.run_ids)
            key = str(env.get("idempotency_key", ""))
            self.running[run_id] = (key, env.get("seq"), time.monotonic())
            self.score_runs[key] += 1
            return run_id

    def end_run(self, run_id: int) -> None:
        with self.lock:
            self.running.pop(run_id, None)

    def _score_items(self, env: dict) -> dict[str, int]:
        scores = {}
        for resume in env.get("items") or []:
            time.sleep(self.delay_s)
            rid = str(resume["id"]) if isinstance(resume, dict) else str(resume)
            scores[rid] = score(resume) if isinstance(resume, dict) else int(resume) % 100
            with self.lock:
                self.model_calls += 1
                self.scored[rid] += 1
        return scores

    def _score_and_call_back(self, env: dict, drop: bool, duplicate: bool) -> None:
        run_id = self.begin_run(env)
        try:
            scores = self._score_items(env)
            if drop:
                return
            body = {"status": "succeeded", "output": {"scores": scores}}
            for _ in range(2 if duplicate else 1):
                try:
                    self.http.post(env["callback_url"], json=body, timeout=10)
                except requests.RequestException:
                    pass
        finally:
            self.end_run(run_id)

    def handle_score_sync(self, env: dict) -> tuple[int, dict]:
        if self._roll(self.fail_rate):
            return 500, {"message": "Error in workflow"}
        return 200, {"status": "succeeded", "output": {"scores": self._score_items(env)}}

    def handle_store(self, env: dict, key: str) -> tuple[int, dict]:
        if self._roll(self.fail_rate):
            return 500, {"message": "Error in workflow"}
        scores = (env.get("input") or {}).get("scores", {})
        with self.lock:
            repeat = key in self.stored
            if repeat:
                self.store_repeats += 1
            else:
                self.stored[key] = {"seq": env.get("seq"), "scores": scores}
        return 200, {"status": "succeeded", "output": {"stored": len(scores), "repeat": repeat}}

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        platform = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, status: int, body: dict) -> None:
                data = json.dumps(body).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the caller is gone (a killed worker): its answer is lost
                    self.close_connection = True

            def do_GET(self) -> None:
                if self.path == "/stats":
                    self._send(200, platform.stats())
                elif self.path == "/stored":
                    with platform.lock:
                        self._send(200, dict(platform.stored))
                else:
                    self._send(404, {"message": "not found"})

            def do_POST(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(length)
                if len(body) < length:  # the caller died mid-send (a SIGKILLed worker): no request
                    self.close_connection = True
                    return
                try:
                    env = json.loads(body or b"{}")
                except ValueError:
                    self._send(400, {"message": "the body is not JSON"})
                    return
                with platform.lock:
                    platform.calls[self.path] += 1
                if self.path == "/score":
                    self._send(*platform.handle_score(env))
                elif self.path == "/score-sync":
                    run_id = platform.begin_run(env)
                    try:
                        self._send(*platform.handle_score_sync(env))
                    finally:
                        platform.end_run(run_id)
                elif self.path == "/store":
                    self._send(*platform.handle_store(env, self.headers.get("Idempotency-Key", "")))
                else:
                    self._send(404, {"code": 404, "message": f'The requested webhook "POST {self.path}" '
                                                            "is not registered."})

        return Handler


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--fail-rate", type=float, default=0.0)
    parser.add_argument("--drop-rate", type=float, default=0.0)
    parser.add_argument("--duplicate-rate", type=float, default=0.0)
    parser.add_argument("--delay", type=float, default=0.0, help="seconds per resume")
    args = parser.parse_args()
    platform = StandInPlatform(args.port, args.fail_rate, args.drop_rate, args.duplicate_rate, args.delay)
    print(f"stand-in platform on {platform.url}")
    platform.server.serve_forever()


if __name__ == "__main__":
    main()
