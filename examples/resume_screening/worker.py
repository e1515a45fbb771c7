"""A pull-mode worker for the resume-screening flow: what an n8n or Dify loop does, in Python.

Each thread loops: lease a batch, do its stage, heartbeat while working, complete it and lease the next
in the same request (`lease_next`: one request a step; a plain lease only when that answered none).
  score: one (simulated) paid model call per resume, logged to model_calls.jsonl as it starts (a call
         cut off by a kill is paid for all the same); these lines are the demo's paid calls
  store: writes the batch's scores to results/<idempotency_key>.json (overwrite = idempotent)
Every stage attempt started is logged to attempts.jsonl (the demo counts repeated stores from it).

Usage: python worker.py JOB_ID [WORK_DIR [THREADS]]      the gateway found as the CLI finds it
       python worker.py BASE_URL TOKEN JOB_ID WORK_DIR [THREADS]
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
import time
from pathlib import Path

import requests

SECONDS_PER_RESUME = 0.12


def append_line(path: Path, record: dict) -> None:
    """One O_APPEND write per line: safe across threads and processes."""
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, (json.dumps(record) + "\n").encode())
    finally:
        os.close(fd)


def score(resume: dict, profile: dict) -> int:
    """Stand-in for an LLM scoring call: deterministic, slow, and logged as a paid call."""
    time.sleep(SECONDS_PER_RESUME)
    skills = resume["skills"]
    if isinstance(skills, str):  # a CSV row: "python;sql;spark", and every field a string
        skills = [s for s in skills.split(";") if s]
    overlap = len(set(skills) & set(profile["skills"]))
    noise = int(hashlib.sha1(resume["id"].encode()).hexdigest(), 16) % 10
    return min(100, overlap * 20 + min(int(resume["years"]), 10) * 3 + noise)


class Worker:
    def __init__(self, base: str, token: str, job_id: str, work: Path) -> None:
        self.base, self.job_id, self.work = base.rstrip("/"), job_id, work
        self.http = requests.Session()
        self.http.headers["Authorization"] = f"Bearer {token}"

    def post(self, path: str, body: dict | None = None) -> requests.Response:
        return self.http.post(f"{self.base}/v1/jobs/{self.job_id}{path}", json=body or {}, timeout=30)

    def loop(self) -> None:
        env = None
        while True:
            if env is None:
                resp = self.post("/lease")
                if resp.status_code == 204:
                    if resp.headers.get("Batchgate-Job-Status") != "running":
                        return
                    time.sleep(0.2)
                    continue
                resp.raise_for_status()
                env = resp.json()
            env = self.run(env)

    def run(self, env: dict) -> dict | None:
        """Do the leased stage and commit it; the next batch the commit leased us, if any."""
        append_line(self.work / "attempts.jsonl",
                    {"seq": env["seq"], "stage": env["stage"], "attempt": env["attempt"]})
        if env["stage"] == "score":
            output = self.score_batch(env)
        else:
            output = self.store_batch(env)
        if output is None:
            return None
        resp = self.post(f"/batches/{env['seq']}/complete",
                         {"lease_token": env["lease_token"], "output": output, "lease_next": True})
        if resp.status_code == 409:  # our lease expired and someone else owns the batch now
            return None
        resp.raise_for_status()
        return resp.json().get("next")

    def score_batch(self, env: dict) -> dict | None:
        scores = {}
        for resume in env["items"]:
            append_line(self.work / "model_calls.jsonl",
                        {"resume": resume["id"], "seq": env["seq"], "attempt": env["attempt"]})
            scores[resume["id"]] = score(resume, env["params"]["profile"])
            beat = self.post(f"/batches/{env['seq']}/heartbeat",
                             {"lease_token": env["lease_token"], "progress": {"scored": len(scores)}})
            if beat.status_code == 409:
                return None
        return {"scores": scores}

    def store_batch(self, env: dict) -> dict:
        results = self.work / "results"
        target = results / f"{env['idempotency_key'].replace(':', '_')}.json"
        tmp = target.with_suffix(f".tmp{threading.get_ident()}")
        tmp.write_text(json.dumps(env["input"]["scores"]))
        os.replace(tmp, target)
        return {"stored": len(env["input"]["scores"]), "at": target.name}


def main() -> int:
    args = sys.argv[1:]
    if args and args[0].startswith(("http://", "https://")):
        base, token, job_id, work = args[:4]
        threads = int(args[4]) if len(args) > 4 else 4
    elif args:  # the gateway and token as the CLI finds them (BATCHGATE_URL/TOKEN, or the running up)
        from gateway.client import Client

        found = Client.discover()
        base, token = found.base, found.session.headers.get("Authorization", "").removeprefix("Bearer ")
        job_id = args[0]
        work = args[1] if len(args) > 1 else os.path.join(os.environ.get("BATCHGATE_DATA_DIR", ".batchgate"),
                                                            "resume-screening")
        threads = int(args[2]) if len(args) > 2 else 4
    else:
        print(__doc__, file=sys.stderr)
        return 2
    work_dir = Path(work)
    (work_dir / "results").mkdir(parents=True, exist_ok=True)
    pool = [threading.Thread(target=Worker(base, token, job_id, work_dir).loop) for _ in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        t.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
