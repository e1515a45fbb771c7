"""What the stale-connection guard costs per call (gateway/net/keepalive.py).

Sends POSTs to a local no-op platform, one after another, through three sessions in the same run:
a plain ``requests.Session`` with ``trust_env`` off like the guarded one (the baseline), the guarded session with connections reused (the delivery
proof's TCP_INFO reads and the last-moment readability check on every request), and the guarded session
with ``keepalive_idle`` 0 (a new connection for every call, what a limit below the idle time costs).
Rounds interleave the three so that machine noise falls on all of them; the medians are compared.

    .venv/bin/python benchmarks/bench_keepalive.py [--calls 2000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import socket
import statistics
import sys
import threading
import time
from http.server import ThreadingHTTPServer
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import _noop_platform  # noqa: E402

from gateway.net.keepalive import idle_limit  # noqa: E402
from gateway.net.outbound import guarded_session  # noqa: E402
from gateway.net.urlguard import Allowlist  # noqa: E402

BODY = b'{"job_id":"job_bench","seq":1,"stage":"score","items":[1,2,3]}'


class NoDelayHandler(_noop_platform.Handler):
    """The no-op platform with Nagle off, as Node's (so n8n's) HTTP server has it: its separate writes of
    head and body would otherwise wait for the client's delayed ACK (40 ms a call on a kept connection)."""

    def setup(self) -> None:
        super().setup()
        self.request.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def start_platform() -> tuple[str, ThreadingHTTPServer]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), NoDelayHandler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return f"http://127.0.0.1:{server.server_port}/noop", server


def calls_per_s(session: requests.Session, url: str, calls: int, limit: float | None) -> float:
    started = time.perf_counter()
    with idle_limit(limit):
        for _ in range(calls):
            resp = session.post(url, data=BODY, headers={"Content-Type": "application/json"}, timeout=5)
            resp.raise_for_status()
    return calls / (time.perf_counter() - started)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    url, server = start_platform()
    allow = Allowlist.parse(["127.0.0.1/32"])
    plain, guarded, fresh = requests.Session(), guarded_session(allow), guarded_session(allow)
    plain.trust_env = False  # as the guarded session: no proxy or .netrc lookups on every request
    cases = {"plain requests.Session": (plain, None), "guarded, reused": (guarded, None),
             "guarded, keepalive_idle 0": (fresh, 0.0)}
    for session, limit in cases.values():  # warm up: connections, imports
        calls_per_s(session, url, 50, limit)
    rates: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(args.rounds):
        for name, (session, limit) in cases.items():
            rates[name].append(calls_per_s(session, url, args.calls, limit))
    server.shutdown()
    base = statistics.median(rates["plain requests.Session"])
    print(f"{args.calls} sequential POSTs to a local no-op platform, "
          f"median of {args.rounds} interleaved rounds")
    for name, values in rates.items():
        rate = statistics.median(values)
        print(f"  {name:28s} {rate:8.0f} calls/s  {rate / base:5.2f}x the plain session  "
              f"({1e6 / rate:6.0f} us per call)")


if __name__ == "__main__":
    main()
