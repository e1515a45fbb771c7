"""Approvals under SIGKILL: the gateway (gunicorn, 2 workers) is killed while approvals are open and again
in the middle of a burst of decisions (some answers cut off, retried by the caller).

Afterwards: every approval is still there; every decision that was acknowledged is the one recorded, and
no approval was decided twice (one approval.decided event each); the score stage of no batch ran again
(one lease and one commit each, the committing token unchanged); store ran once for each approved batch
and never for a rejected one; the failure budget decided the job from the rejections.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections import Counter

import pytest
import requests

from gateway.ledger.ledger import Ledger
from tests.conftest import TOKEN
from tests.test_crash import GatewayProcess

pytestmark = pytest.mark.slow

BATCHES, PER_BATCH = 40, 2
FLOW = {"id": "gated", "version": "1", "batching": {"max_items": PER_BATCH}, "concurrency": 8,
        "tolerated_failure_percentage": 50,
        "stages": [{"name": "score", "lease": 30},
                   {"name": "review", "approval": {"timeout": "PT1H"}},
                   {"name": "store", "lease": 30}]}


def session() -> requests.Session:
    s = requests.Session()
    s.headers["Authorization"] = f"Bearer {TOKEN}"
    return s


def call(method: str, url: str, stop: threading.Event | None = None, **kwargs) -> requests.Response:
    """One request, retried while the gateway is down or cut the answer off (the same body each time)."""
    s = session()
    while True:
        try:
            return s.request(method, url, timeout=5, **kwargs)
        except requests.RequestException:
            if stop is not None and stop.is_set():
                raise
            time.sleep(0.05)


def work(base: str, job_id: str, stage: str, until) -> None:
    """Lease and complete ``stage`` until ``until()``; a lost answer is retried with the same token."""
    while not until():
        r = call("POST", f"{base}/v1/jobs/{job_id}/lease", json={"stage": stage})
        if r.status_code != 200:
            time.sleep(0.05)
            continue
        env = r.json()
        body = {"lease_token": env["lease_token"], "output": {"seq": env["seq"], "stage": stage}}
        res = call("POST", f"{base}/v1/jobs/{job_id}/batches/{env['seq']}/complete", json=body)
        assert res.status_code == 200, res.text


def pending(base: str) -> list[str]:
    ids, path = [], "/v1/approvals?status=pending&limit=50"
    while path:
        page = call("GET", base + path).json()
        ids += [a["id"] for a in page["approvals"]]
        path = page["next"]
    return ids


def test_gateway_sigkill_with_approvals_open_and_mid_decision(redis_server, redis_client, settings):
    ledger = Ledger(redis_client, settings)
    gw = GatewayProcess(redis_server.url)
    gw.start()
    try:
        assert call("POST", f"{gw.base}/v1/flows", json=FLOW).status_code == 201
        source = {"type": "sequence", "count": BATCHES * PER_BATCH}
        job = call("POST", f"{gw.base}/v1/jobs", json={"flow_id": "gated", "source": source})
        job_id = job.json()["job_id"]
        k = ledger.keys.job(job_id)
        work(gw.base, job_id, "score", lambda: redis_client.hget(k.job, "status") == "waiting_human")
        scored = {s: redis_client.hget(k.batch(s), "c:0") for s in range(BATCHES)}
        assert all(scored.values())

        gw.kill()  # approvals are open: nothing of them lives in the process
        gw.start()
        ids = pending(gw.base)
        assert len(ids) == BATCHES

        rng = random.Random(4)
        decisions = {aid: ("reject" if rng.random() < 0.25 else "approve") for aid in ids}
        acked: dict[str, str] = {}
        lock = threading.Lock()

        def decide(chunk: list[str]) -> None:
            for aid in chunk:
                body = {"decision": decisions[aid]}
                if decisions[aid] == "approve" and aid.endswith(".1.1") and int(aid.split(".")[1]) % 3 == 0:
                    body["output"] = {"edited": aid}
                res = call("POST", f"{gw.base}/v1/approvals/{aid}", json=body)  # retried: same decision
                assert res.status_code == 200, res.text
                with lock:
                    acked[aid] = res.json()["decision"]["decision"]

        threads = [threading.Thread(target=decide, args=(ids[i::4],)) for i in range(4)]
        for t in threads:
            t.start()
        for threshold in (8, 24):
            while len(acked) < threshold:
                time.sleep(0.005)
            gw.kill()  # mid-decision: some answers are cut off and retried after the restart
            time.sleep(0.2)
            gw.start()
        for t in threads:
            t.join(60)
        assert len(acked) == BATCHES

        def ended() -> bool:
            return redis_client.hget(k.job, "status") in ("succeeded", "failed")

        work(gw.base, job_id, "store", ended)
    finally:
        gw.stop()

    for aid, decision in acked.items():
        view = ledger.approvals.get("acme", aid)
        assert view["decision"]["decision"] == decision == decisions[aid]
    log = redis_client.xrange(k.log)
    started = Counter((f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_started")
    committed = Counter((f["seq"], f["stage"]) for _, f in log if f["event"] == "stage_completed")
    assert all(started[(str(s), "0")] == 1 for s in range(BATCHES)), "a score stage ran again"
    assert {s: redis_client.hget(k.batch(s), "c:0") for s in range(BATCHES)} == scored
    assert set(committed.values()) == {1}, "a stage was committed twice"
    approved = {int(a.split(".")[1]) for a, d in decisions.items() if d == "approve"}
    assert {int(s) for (s, st) in committed if st == "2"} == approved
    for s in approved:
        expected_input = {"edited": f"{job_id}.{s}.1.1"} if s % 3 == 0 else {"seq": s, "stage": "score"}
        assert json.loads(redis_client.hget(k.batch(s), "out:1")) == expected_input
    events = Counter(f["type"] for _, f in redis_client.xrange(k.events))
    assert events["approval.requested"] == events["approval.decided"] == BATCHES
    rejected = BATCHES - len(approved)
    assert events["batch.failed"] == rejected
    job = redis_client.hgetall(k.job)
    assert int(job["n_failed"]) == rejected and job["n_waiting"] == "0"
    assert job["status"] == ("succeeded" if rejected * 100 <= 50 * BATCHES else "failed")
