"""The main job: 500 resumes through batchgate; the worker is SIGKILLed midway and restarted.

Starts an embedded Redis (AOF on) unless BATCHGATE_REDIS_URL is set, the API under gunicorn and the
supervisor. Then, by mode:
  push (default): a local stand-in platform (standin_platform.py) and a `batchgate worker` (RQ);
                  batchgate calls the platform's score and store workflows itself, both synchronously,
                  so the worker holds each answer until it commits it.
  pull:           worker.py leases batches from batchgate and scores them itself, as an n8n or Dify
                  loop would.
When about 40 % is done and a scoring call is in flight, it kills the worker with SIGKILL (the answer
of that call is lost, although the platform finishes it and is paid for it), reads which batches were
uncommitted at that moment, and restarts the worker. At the end it reports from the platform's own
records (push: the stand-in's /stats and /stored; pull: worker.py's model_calls.jsonl and results/),
not from batchgate's log: paid calls per resume, the batches scored more than once, the stored scores,
and the paid calls against restarting from zero. Leaves nothing running.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import requests
import yaml

from gateway.runtime import procs
from gateway.client import Client
from gateway.runtime.cli_client import ProgressBar
from gateway.ledger.embedded import EmbeddedRedis, free_port
from gateway.settings import Settings

HERE = Path(__file__).resolve().parent
SKILLS = ["python", "sql", "airflow", "spark", "dbt", "kafka", "go", "react", "k8s", "terraform"]
SECONDS_PER_RESUME = 0.03  # the stand-in platform's model call: 0.3 s per batch of 10
PROFILE = {"title": "data engineer", "skills": ["python", "sql", "airflow", "spark", "dbt"]}


def make_resumes(path: Path, count: int) -> None:
    rng = random.Random(7)
    with path.open("w") as fh:
        for i in range(count):
            fh.write(json.dumps({"id": f"r{i:04d}", "name": f"Candidate {i}",
                                 "years": rng.randint(0, 15),
                                 "skills": rng.sample(SKILLS, rng.randint(2, 6))}) + "\n")


def read_lines(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@dataclass
class AtKill:
    """What was true when the worker was killed."""

    uncommitted: set[int]          # batches whose score was not committed (planned ones only)
    cut_off: list[int]             # batches whose scoring call was in flight
    committed_cursor: dict | None
    paid: int = 0                  # paid calls of the first run, including the calls cut off


class Demo:
    def __init__(self, work: Path, count: int, kill_at: float, mode: str) -> None:
        self.work, self.count, self.kill_at, self.mode = work, count, kill_at, mode
        self.data = work / "batchgate"  # batchgate's data dir: Redis files, dev token
        self.inputs = work / "input"    # the resumes file: a file source may not lie in the data dir
        self.children: list[subprocess.Popen] = []
        self.redis: EmbeddedRedis | None = None
        self.platform = ""

    def start_services(self) -> Client:
        settings = Settings()
        url = settings.redis_url.get_secret_value() if settings.redis_url else None
        if url is None:
            self.redis = EmbeddedRedis(self.data / "redis")
            url = self.redis.start()
            print(f"embedded redis-server with AOF in {self.redis.data_dir}")
        token = procs.dev_token(self.data)
        port = free_port()
        settings = settings.model_copy(update={"data_dir": self.data, "public_url": f"http://127.0.0.1:{port}"})
        env = procs.child_env(settings, url, {token: "demo"})
        env["BATCHGATE_SUPERVISOR_INTERVAL"] = "0.2"
        env["BATCHGATE_PUBLIC_URL"] = settings.public_url
        env["BATCHGATE_OUTBOUND_ALLOW"] = '["127.0.0.1/32"]'  # the demo admits its own stand-in
        env["BATCHGATE_SOURCE_ROOTS"] = json.dumps([str(self.inputs)])  # and its resumes file
        env.setdefault("BATCHGATE_LOG_LEVEL", "WARNING")
        self.env = env
        self.children.append(procs.start_api(env, "127.0.0.1", port))
        self.children.append(procs.start_supervisor(env))
        base = f"http://127.0.0.1:{port}"
        procs.wait_healthy(base)
        print(f"batchgate API on {base}, supervisor running")
        self.base, self.token = base, token
        return Client(base, token)

    def start_worker(self, job_id: str) -> subprocess.Popen:
        if self.mode == "push":
            return procs.start_worker(self.env)
        return subprocess.Popen([sys.executable, str(HERE / "worker.py"), self.base, self.token,
                                 job_id, str(self.work)], start_new_session=True)

    def start_platform(self) -> str:
        port = free_port()
        self.children.append(subprocess.Popen(
            [sys.executable, str(HERE / "standin_platform.py"), "--port", str(port),
             "--delay", str(SECONDS_PER_RESUME)],
            stdout=subprocess.DEVNULL, start_new_session=True))
        url = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 10
        while True:
            try:
                requests.get(f"{url}/stats", timeout=1)
                return url
            except requests.ConnectionError:
                if time.monotonic() > deadline:
                    raise RuntimeError("the stand-in platform did not start") from None
                time.sleep(0.05)

    def platform_stats(self) -> dict:
        return requests.get(f"{self.platform}/stats", timeout=5).json()

    def stop_all(self) -> None:
        for child in self.children:
            procs.stop(child)
        if self.redis:
            self.redis.stop()

    def run(self) -> int:
        self.inputs.mkdir(parents=True, exist_ok=True)
        resumes = self.inputs / "resumes.jsonl"
        make_resumes(resumes, self.count)
        client = self.start_services()
        if self.mode == "push":
            self.platform = self.start_platform()
            text = (HERE / "flow-push.yaml").read_text().replace("${PLATFORM_URL}", self.platform)
            print(f"stand-in platform on {self.platform} ({SECONDS_PER_RESUME * 10:.1f} s per scoring "
                  "call); a batchgate worker (RQ) calls it and waits for each answer")
        else:
            text = (HERE / "flow.yaml").read_text()
        flow = yaml.safe_load(text)
        if self.mode != "push":
            # the shipped flow leases for minutes, as a real loop needs; the demo's worker scores a batch
            # in a fraction of a second, and 3 s leases let the batches of the worker killed below come
            # back in seconds rather than minutes
            for stage in flow["stages"]:
                stage["lease"] = 3
            flow["version"] = f"{flow['version']}-demo"
        client.call("POST", "/v1/flows", flow)
        job = client.call("POST", "/v1/jobs", {
            "flow_id": flow["id"], "params": {"profile": PROFILE},
            "source": {"type": "jsonl", "path": str(resumes)}})
        job_id = job["job_id"]
        print(f"job {job_id}: {self.count} resumes in batches of {flow['batching']['max_items']}")
        worker = self.start_worker(job_id)
        self.children.append(worker)
        at_kill = self.kill_midway(client, job_id, worker)
        lease = flow["stages"][0]["lease"]
        print(f"restarting the worker; batches leased by the dead worker are retried once their "
              f"{lease} s lease runs out")
        self.children.append(self.start_worker(job_id))
        final = self.watch(client, job_id, until=lambda j: j["status"] in ("succeeded", "failed"))
        return self.report(final, at_kill)

    def watch(self, client: Client, job_id: str, until) -> dict:
        bar = ProgressBar("resumes", sys.stdout)
        try:
            while True:
                job = client.call("GET", f"/v1/jobs/{job_id}")
                bar.update(job)
                if until(job):
                    return job
                time.sleep(0.25)
        finally:
            bar.close()

    def scoring_in_flight(self, client: Client, job_id: str) -> bool:
        """A scoring call is under way and will not answer before the kill. Push: the platform has been
        on a call for less than half of its length. Pull: worker.py holds a batch at stage score and
        has logged between 3 and 7 of its 10 model calls."""
        if self.mode == "push":
            runs = self.platform_stats()["in_flight_runs"]
            return any(r["running_s"] < SECONDS_PER_RESUME * 5 for r in runs)
        leased = client.call("GET", f"/v1/jobs/{job_id}/batches?status=leased&limit=1000")["batches"]
        scoring = {b["seq"] for b in leased if b["stage"] == "score"}
        calls = read_lines(self.work / "model_calls.jsonl")
        logged = Counter(c["seq"] for c in calls if c["seq"] in scoring)
        return any(3 <= n <= 7 for n in logged.values())

    def kill_midway(self, client: Client, job_id: str, worker: subprocess.Popen) -> AtKill:
        self.watch(client, job_id, until=lambda j: j["items_done"] >= self.kill_at * self.count)
        deadline = time.monotonic() + 30
        while not self.scoring_in_flight(client, job_id):
            if time.monotonic() > deadline:
                raise RuntimeError("no scoring call in flight to kill the worker on")
            time.sleep(0.01)
        kill_worker(worker)
        # Nothing commits while the worker is down: the batch list now is the batch list at the kill.
        batches = client.call("GET", f"/v1/jobs/{job_id}/batches?limit=1000")["batches"]
        job = client.call("GET", f"/v1/jobs/{job_id}")
        at_kill = AtKill(
            uncommitted={b["seq"] for b in batches if b["status"] != "completed" and b["stage"] == "score"},
            cut_off=self.cut_off(batches), committed_cursor=job["committed_cursor"])
        at_kill.paid = self.paid_by_first_run()
        who = ("the worker (its call threads die with it) while the platform was" if self.mode == "push"
               else "worker.py while it was")
        offset = (at_kill.committed_cursor or {}).get("offset", 0)
        print(f"SIGKILL sent to {who} scoring batches {at_kill.cut_off}; committed cursor at the kill: "
              f"offset {offset}; batches without a committed score: {sorted(at_kill.uncommitted)}")
        return at_kill

    def cut_off(self, batches: list[dict]) -> list[int]:
        if self.mode == "push":  # scoring runs the platform is still on: nobody will take their answer
            return sorted(r["seq"] for r in self.platform_stats()["in_flight_runs"])
        return sorted(b["seq"] for b in batches if b["status"] == "leased" and b["stage"] == "score")

    def paid_by_first_run(self) -> int:
        if self.mode == "push":
            deadline = time.monotonic() + 10
            while (stats := self.platform_stats())["in_flight"] and time.monotonic() < deadline:
                time.sleep(0.05)  # the platform finishes the calls cut off, and is paid for them
            return stats["model_calls"]
        return len(read_lines(self.work / "model_calls.jsonl"))

    def records(self) -> tuple[Counter, dict[str, int], Counter, int]:
        """From the platform's own records: (paid calls per resume, batch seq per resume, stored
        scores per resume, repeated store calls)."""
        stored: Counter = Counter()
        batch_of: dict[str, int] = {}
        if self.mode == "push":
            stats = self.platform_stats()
            paid = Counter(stats["scored"])
            for record in requests.get(f"{self.platform}/stored", timeout=5).json().values():
                stored.update(record["scores"].keys())
                batch_of.update({rid: record["seq"] for rid in record["scores"]})
            return paid, batch_of, stored, stats["store_repeats"]
        calls = read_lines(self.work / "model_calls.jsonl")
        paid = Counter(c["resume"] for c in calls)
        batch_of = {c["resume"]: c["seq"] for c in calls}
        for result in (self.work / "results").glob("*.json"):
            stored.update(json.loads(result.read_text()).keys())
        attempts = read_lines(self.work / "attempts.jsonl")
        stores = Counter(a["seq"] for a in attempts if a["stage"] == "store")
        return paid, batch_of, stored, sum(n - 1 for n in stores.values())

    def report(self, job: dict, at_kill: AtKill) -> int:
        paid, batch_of, stored, store_repeats = self.records()
        expected = {f"r{i:04d}" for i in range(self.count)}
        per_resume = [paid.get(rid, 0) for rid in sorted(expected)]
        twice = sorted({batch_of.get(rid, -1) for rid, n in paid.items() if n > 1})
        total = sum(paid.values())
        source = ("the stand-in platform's /stats and /stored" if self.mode == "push"
                  else "worker.py's model_calls.jsonl and results/")
        print(f"\nfrom the platform side's own records ({source}), not batchgate's log;")
        print("a paid call is one model call for one resume, answered to batchgate or not:")
        print(f"  paid calls per resume: min {min(per_resume)}, max {max(per_resume)}; resumes paid for "
              f"more than once: {sum(1 for n in per_resume if n > 1)}")
        print(f"  batches scored more than once: {len(twice)} {twice}; of these, without a committed "
              f"score at the kill: {[s for s in twice if s in at_kill.uncommitted]}")
        print(f"  resumes stored: {len(stored)} of {self.count}; stored more than once: "
              f"{sum(1 for n in stored.values() if n > 1)}; repeated store calls (stored nothing new): "
              f"{store_repeats}")
        print(f"  paid calls in total: {total} for {self.count} resumes; restarting from zero after the "
              f"kill: {at_kill.paid} paid before it + {self.count} = {at_kill.paid + self.count}")
        checks = {
            "job succeeded": job["status"] == "succeeded",
            "every resume stored exactly once": set(stored) == expected and set(stored.values()) == {1},
            "every resume paid for at least once and at most twice":
                set(paid) <= expected and min(per_resume) >= 1 and max(per_resume) <= 2,
            "at least one batch scored more than once (the kill cut a paid call off)": bool(twice),
            "every batch scored more than once had no committed score at the kill":
                set(twice) <= at_kill.uncommitted,
        }
        for name, ok in checks.items():
            print(f"  [{'ok' if ok else 'FAILED'}] {name}")
        return 0 if all(checks.values()) else 1


def kill_worker(worker: subprocess.Popen) -> None:
    """SIGKILL the worker and every process it started, as when its machine dies. A push worker's calls
    run in its own threads, but RQ's scheduler (for polls) and any forked work horse live in processes
    of their own, possibly in process groups of their own: SIGKILL to the worker's group alone could
    spare one, which would then go on as if nothing had happened."""
    os.killpg(worker.pid, signal.SIGSTOP)  # nothing new forks while we look for the children
    out = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=True)
    children: dict[int, list[int]] = {}
    for line in out.stdout.splitlines():
        pid, ppid = map(int, line.split())
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [worker.pid]
    while todo:
        found.extend(kids := children.get(todo.pop(), []))
        todo.extend(kids)
    for pid in found:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(os.getpgid(pid), signal.SIGKILL)
    os.killpg(worker.pid, signal.SIGKILL)
    worker.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--resumes", type=int, default=500)
    parser.add_argument("--kill-at", type=float, default=0.4, help="fraction done at the SIGKILL")
    parser.add_argument("--work-dir", type=Path, default=Path(".batchgate/demo"))
    parser.add_argument("--mode", choices=("push", "pull"), default="push",
                        help="push: batchgate drives a stand-in platform; pull: a worker leases batches")
    args = parser.parse_args()
    if args.work_dir.exists():
        shutil.rmtree(args.work_dir)
    args.work_dir.mkdir(parents=True)
    demo = Demo(args.work_dir.resolve(), args.resumes, args.kill_at, args.mode)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        return demo.run()
    except (requests.RequestException, RuntimeError) as exc:
        print(f"demo failed: {exc}", file=sys.stderr)
        return 1
    finally:
        demo.stop_all()


if __name__ == "__main__":
    sys.exit(main())
