"""The main job: 500 resumes through batchgate; the worker is SIGKILLed midway and restarted.

Starts an embedded Redis (AOF on) unless BATCHGATE_REDIS_URL is set, the API under gunicorn and the
supervisor. Then, by mode:
  push (default): a local stand-in platform (standin_platform.py) and a `batchgate worker` (RQ);
                  batchgate triggers the platform's score (callback) and store (sync) workflows itself.
  pull:           worker.py leases batches from batchgate, as an n8n or Dify loop would.
It kills the worker with SIGKILL when about 40 % is done, restarts it, and at the end proves:
  * every resume has exactly one stored score;
  * the only batches that ran a stage twice are those that were uncommitted at the kill;
  * how many paid model calls the crash cost, against re-running everything.
Leaves nothing running.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import requests
import yaml

from gateway import procs
from gateway.cli_client import Client, progress_line
from gateway.embedded import EmbeddedRedis, free_port
from gateway.settings import Settings

HERE = Path(__file__).resolve().parent
SKILLS = ["python", "sql", "airflow", "spark", "dbt", "kafka", "go", "react", "k8s", "terraform"]
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


class Demo:
    def __init__(self, work: Path, count: int, kill_at: float, mode: str) -> None:
        self.work, self.count, self.kill_at, self.mode = work, count, kill_at, mode
        self.children: list[subprocess.Popen] = []
        self.redis: EmbeddedRedis | None = None
        self.calls_at_kill = 0
        self.platform = ""

    def start_services(self) -> Client:
        settings = Settings()
        url = settings.redis_url.get_secret_value() if settings.redis_url else None
        if url is None:
            self.redis = EmbeddedRedis(self.work / "redis")
            url = self.redis.start()
            print(f"embedded redis-server with AOF in {self.redis.data_dir}")
        token = procs.dev_token(self.work)
        port = free_port()
        settings = settings.model_copy(update={"data_dir": self.work, "public_url": f"http://127.0.0.1:{port}"})
        env = procs.child_env(settings, url, {token: "demo"})
        env["BATCHGATE_SUPERVISOR_INTERVAL"] = "0.2"
        env["BATCHGATE_PUBLIC_URL"] = settings.public_url
        env["BATCHGATE_OUTBOUND_ALLOW"] = '["127.0.0.1/32"]'  # the demo admits its own stand-in
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
            [sys.executable, str(HERE / "standin_platform.py"), "--port", str(port), "--delay", "0.1"],
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

    def stop_all(self) -> None:
        for child in self.children:
            procs.stop(child)
        if self.redis:
            self.redis.stop()

    def run(self) -> int:
        resumes = self.work / "resumes.jsonl"
        make_resumes(resumes, self.count)
        client = self.start_services()
        if self.mode == "push":
            self.platform = self.start_platform()
            text = (HERE / "flow-push.yaml").read_text().replace("${PLATFORM_URL}", self.platform)
            print(f"stand-in platform on {self.platform}; batchgate worker (RQ) drives it")
        else:
            text = (HERE / "flow.yaml").read_text()
        flow = yaml.safe_load(text)
        client.call("POST", "/v1/flows", flow)
        job = client.call("POST", "/v1/jobs", {
            "flow_id": flow["id"], "params": {"profile": PROFILE},
            "source": {"type": "jsonl", "path": str(resumes)}})
        job_id = job["job_id"]
        print(f"job {job_id}: {self.count} resumes in batches of {flow['batching']['max_items']}")
        worker = self.start_worker(job_id)
        self.children.append(worker)
        uncommitted = self.kill_midway(client, job_id, worker)
        print("restarting the worker; " + ("platform callbacks kept committing while it was down"
                                           if self.mode == "push" else
                                           "the supervisor hands expired leases back out"))
        self.children.append(self.start_worker(job_id))
        final = self.watch(client, job_id, until=lambda j: j["status"] in ("succeeded", "failed"))
        return self.report(client, job_id, final, uncommitted)

    def watch(self, client: Client, job_id: str, until) -> dict:
        while True:
            job = client.call("GET", f"/v1/jobs/{job_id}")
            sys.stdout.write("\r" + progress_line(job))
            sys.stdout.flush()
            if until(job):
                sys.stdout.write("\n")
                return job
            time.sleep(0.25)

    def kill_midway(self, client: Client, job_id: str, worker: subprocess.Popen) -> set[int]:
        self.watch(client, job_id, until=lambda j: j["items_done"] >= self.kill_at * self.count)
        time.sleep(0.7)  # let the next batches get some paid calls in before the crash
        os.killpg(worker.pid, signal.SIGKILL)
        worker.wait()
        self.calls_at_kill = self.paid_calls_so_far()
        leased = client.call("GET", f"/v1/jobs/{job_id}/batches?status=leased")["batches"]
        job = client.call("GET", f"/v1/jobs/{job_id}")
        print(f"SIGKILL sent to the worker: committed cursor {job['committed_cursor']}, "
              f"{len(leased)} batches were in flight: {sorted(b['seq'] for b in leased)}")
        batches = client.call("GET", f"/v1/jobs/{job_id}/batches?limit=1000")["batches"]
        return {b["seq"] for b in batches if b["status"] != "completed"}

    def evidence(self, client: Client, job_id: str) -> tuple[Counter, Counter, Counter]:
        """(stage attempts per (seq, stage), paid calls per resume, stored scores per resume)."""
        stored: Counter = Counter()
        if self.mode == "push":
            log = client.call("GET", f"/v1/jobs/{job_id}/log?limit=10000")["entries"]
            attempts = Counter((e["seq"], e["stage"]) for e in log if e["event"] == "stage_started")
            calls = Counter(requests.get(f"{self.platform}/stats", timeout=5).json()["scored"])
            for scores in requests.get(f"{self.platform}/stored", timeout=5).json().values():
                stored.update(scores.keys())
            return attempts, calls, stored
        attempts = Counter((a["seq"], a["stage"]) for a in read_lines(self.work / "attempts.jsonl"))
        calls = Counter(c["resume"] for c in read_lines(self.work / "model_calls.jsonl"))
        for result in (self.work / "results").glob("*.json"):
            stored.update(json.loads(result.read_text()).keys())
        return attempts, calls, stored

    def paid_calls_so_far(self) -> int:
        if self.mode == "push":
            return requests.get(f"{self.platform}/stats", timeout=5).json()["model_calls"]
        return len(read_lines(self.work / "model_calls.jsonl"))

    def report(self, client: Client, job_id: str, job: dict, uncommitted: set[int]) -> int:
        attempts, calls, stored = self.evidence(client, job_id)
        rerun = {int(seq) for (seq, _), n in attempts.items() if n > 1}
        expected = {f"r{i:04d}" for i in range(self.count)}
        checks = {
            "job succeeded": job["status"] == "succeeded",
            "every resume stored exactly once": set(stored) == expected and set(stored.values()) == {1},
            "every resume scored (paid) at least once": set(calls) == expected,
            "only batches uncommitted at the kill ran a stage twice": rerun <= uncommitted,
        }
        total = sum(calls.values())
        print(f"\nbatches that ran a stage again after the kill: {len(rerun)} {sorted(rerun)}")
        print(f"paid model calls: {total} for {self.count} resumes; {total - self.count} repeated "
              f"because of the crash. Restarting from zero would have repeated "
              f"{self.calls_at_kill}.")
        for name, ok in checks.items():
            print(f"  [{'ok' if ok else 'FAILED'}] {name}")
        return 0 if all(checks.values()) else 1


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
