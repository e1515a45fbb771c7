"""Pull steps over HTTP against a trivial Flask endpoint pair, both under the same gunicorn settings.

Run: .venv/bin/python benchmarks/bench_http_step.py [SECONDS [CLIENTS]]   (default 5 s, 8 client threads)

batchgate: `batchgate serve`'s gunicorn (procs.start_api: 2 workers x 4 threads, its config file) on
the embedded Redis; each client thread runs a pull loop on one job: POST .../lease, then POST
.../complete (a pair, two requests a step), and the same loop with lease_next (one request a step).
Baseline: a Flask app doing SET on POST /set and GET on GET /get (benchmarks/_setget_app.py) under the
same gunicorn command; each client thread sends the pair. Interleaved rounds, best of each; issue 18's
goal: lease+complete pairs at >= 0.8x the SET+GET pairs.
"""

from __future__ import annotations

import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import requests

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gateway.ledger.embedded import EmbeddedRedis, free_port  # noqa: E402
from gateway.runtime import procs  # noqa: E402
from gateway.settings import Settings  # noqa: E402

TOKEN = "bench-token-0123456789"
HERE = Path(__file__).resolve().parent


def loop(seconds: float, clients: int, step) -> float:
    """``clients`` threads calling ``step(session)`` for ``seconds``: steps per second."""
    done = [0] * clients
    stop = time.monotonic() + seconds

    def run(i: int) -> None:
        with requests.Session() as session:
            while time.monotonic() < stop:
                step(session)
                done[i] += 1

    threads = [threading.Thread(target=run, args=(i,)) for i in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return sum(done) / seconds


def main(seconds: float, clients: int, rounds: int = 3) -> None:
    folder = Path(tempfile.mkdtemp(prefix="bg-http-"))
    server = EmbeddedRedis(folder / "redis")
    url = server.start()
    settings = Settings(data_dir=folder / "data", redis_url=url)
    env = procs.child_env(settings, url, {TOKEN: "bench"})
    api_port, pair_port = free_port(), free_port()
    # the servers' log lines (the API logs each commit at INFO, as it would for a user) go to a file
    saved = os.dup(2)
    with open(folder / "servers.log", "w") as log:
        os.dup2(log.fileno(), 2)
    api = procs.start_api(env, "127.0.0.1", api_port)
    gunicorn = [*procs.python("-m", "gunicorn"), "--config", procs.GUNICORN_CONF, "--bind",
                f"127.0.0.1:{pair_port}", "--workers", "2", "--threads", "4", "--log-level", "warning",
                "--graceful-timeout", "5", "_setget_app:create_app()"]
    pair = procs._spawn(gunicorn, {**env, "BATCHGATE_BENCH_REDIS_URL": url, "PYTHONPATH": str(HERE)}, False)
    os.dup2(saved, 2)
    base, pair_base = f"http://127.0.0.1:{api_port}", f"http://127.0.0.1:{pair_port}"
    auth = {"Authorization": f"Bearer {TOKEN}"}
    try:
        procs.wait_healthy(base, proc=api)
        deadline = time.monotonic() + 20
        while True:
            try:
                requests.get(f"{pair_base}/get", timeout=2)
                break
            except requests.ConnectionError:
                assert time.monotonic() < deadline and pair.poll() is None, "the SET+GET app never started"
                time.sleep(0.1)
        flow = {"id": "http", "version": "1", "concurrency": 10_000, "batching": {"max_items": 10},
                "stages": [{"name": "s", "lease": 600}], "source": {"type": "sequence", "count": 10**8}}
        assert requests.post(f"{base}/v1/flows", json=flow, headers=auth, timeout=30).status_code == 201
        job = requests.post(f"{base}/v1/jobs", json={"flow_id": "http"}, headers=auth, timeout=30).json()["job_id"]
        jobs_url = f"{base}/v1/jobs/{job}"

        def lease_then_complete(s: requests.Session) -> None:
            got = s.post(f"{jobs_url}/lease", headers=auth, timeout=30).json()
            s.post(f"{jobs_url}/batches/{got['seq']}/complete", headers=auth, timeout=30,
                   json={"lease_token": got["lease_token"], "output": {"n": 1}}).raise_for_status()

        held = threading.local()

        def complete_with_lease_next(s: requests.Session) -> None:
            got = getattr(held, "lease", None) or s.post(f"{jobs_url}/lease", headers=auth, timeout=30).json()
            answer = s.post(f"{jobs_url}/batches/{got['seq']}/complete", headers=auth, timeout=30,
                            json={"lease_token": got["lease_token"], "output": {"n": 1}, "lease_next": True})
            answer.raise_for_status()
            held.lease = answer.json()["next"]

        def set_then_get(s: requests.Session) -> None:
            s.post(f"{pair_base}/set", json={"value": "x" * 64}, timeout=30).raise_for_status()
            s.get(f"{pair_base}/get", timeout=30).raise_for_status()

        kinds = {"SET+GET pair": set_then_get, "lease + complete": lease_then_complete,
                 "complete with lease_next": complete_with_lease_next}
        best = {name: 0.0 for name in kinds}
        for _ in range(rounds):
            for name, step in kinds.items():
                best[name] = max(best[name], loop(seconds, clients, step))
    finally:
        procs.stop_all([api, pair])
        server.stop()
    base_rate = best["SET+GET pair"]
    print(f"{rounds} rounds of {seconds:g} s, {clients} client threads, gunicorn 2 workers x 4 threads; best round:")
    print(f"  SET+GET endpoint pairs/s:               {base_rate:7.0f}")
    print(f"  lease + complete pairs/s (a step):      {best['lease + complete']:7.0f}  "
          f"{best['lease + complete'] / base_rate:.2f}x")
    print(f"  complete with lease_next/s (a step):    {best['complete with lease_next']:7.0f}  "
          f"{best['complete with lease_next'] / base_rate:.2f}x")
    print("goal (issue 18): lease + complete pairs >= 0.8x SET+GET pairs")


if __name__ == "__main__":
    args = sys.argv[1:]
    main(float(args[0]) if args else 5.0, int(args[1]) if len(args) > 1 else 8)
