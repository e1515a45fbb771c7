"""A platform run that waits for a person opens an approval; deciding it resumes the run (issue 16).

Against the stand-in n8n whose executions wait at a Wait node "On Webhook Call" and go on when their
resume URL is called (tests/standins_waiting.py), over real sockets:

- in this process (the dispatcher and RQ run here, the API on a socket): the approval shows the
  platform's prompt and holds no lease; approving resumes the execution once and its output is
  committed once (fast path: the resumer the API installs); a decision whose resume never reached n8n is
  carried out by the batch's next attempt (durable path); a rejection is sent to n8n and fails the batch
  as ``rejected``; a Dify form and a Coze question are answered with the decision's ``output`` the same way;
- real processes (gunicorn API, ``batchgate worker``, ``batchgate supervisor``): SIGKILL of all three
  while the approval is open loses nothing: after restart the approval and the waiting execution are
  still there, and approving through the API resumes the execution once and commits its output once.
"""

from __future__ import annotations

import json
import os
import signal
import time

import pytest
import requests

import gateway.push.dispatch
from gateway.ledger.embedded import free_port
from gateway.ledger.ledger import Ledger
from gateway.push import resumer
from gateway.push.dispatch import Dispatcher
from gateway.runtime import procs
from gateway.settings import Settings
from tests.conftest import TOKEN
from tests.standins_waiting import REVIEW_NOTE, WaitingCoze, WaitingDify, WaitingN8n
from tests.test_platform_end_states import batch, log, run_job

N8N_KEY, DIFY_KEY, COZE_TOKEN = "n8n-standin-key", "app-standin-key", "pat_standin-token"


def flow_stage(server: WaitingN8n) -> list[dict]:
    target = {"type": "n8n", "url": server.url, "api_url": server.base_url, "api_key_secret": "n8n"}
    return [{"name": "review", "idempotent": False, "timeout": 2, "lease": 10, "poll_interval": 0.05,
             "max_run": 600, "retry": {"initial_interval": 0.01, "maximum_attempts": 3}, "target": target}]


@pytest.fixture
def push(settings, redis_client, monkeypatch):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "secrets": {"acme": {
        "n8n": N8N_KEY, "dify": DIFY_KEY, "coze": COZE_TOKEN}}})
    ledger = Ledger(redis_client, own)
    d = Dispatcher.build(own, ledger)
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)
    return ledger, d


@pytest.fixture
def n8n():
    with WaitingN8n(api_key=N8N_KEY, run_s=0.2) as server:
        server.plan("wait_webhook")
        yield server


def open_wait(ledger, d, make_job, n8n) -> tuple[str, dict]:
    job_id = make_job(items=[1, 2], max_items=2, stage_defs=flow_stage(n8n))
    job, _ = run_job(ledger, d, job_id)
    assert job["status"] == "waiting_human", job
    approvals, _ = ledger.approvals.list("acme", "pending")
    assert len(approvals) == 1
    return job_id, approvals[0]


def committed(ledger, job_id: str) -> list[dict]:
    return [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log) if f["event"] == "stage_completed"]


def test_approving_resumes_the_execution_once_and_commits_its_output_once(push, make_job, api, n8n):
    ledger, d = push
    resumer.install(d, background=False)  # the fast path, as create_app installs it (in this thread)
    job_id, approval = open_wait(ledger, d, make_job, n8n)
    assert approval["kind"] == "platform" and approval["prompt"] == REVIEW_NOTE
    assert not ledger.r.zcard(ledger.keys.job(job_id).leases)  # no lease while a person decides
    execution_id = next(iter(n8n.executions))
    assert n8n.resumed[execution_id] == 0
    ledger.approvals.decide("acme", approval["id"], "approve", "ana", comment="fine")
    assert n8n.resumed[execution_id] == 1  # resumed at the decision
    job, _ = run_job(ledger, d, job_id)
    assert job["status"] == "succeeded", job
    assert batch(api, job_id)["stages"]["review"]["output"] == {"count": 2, "decision": "approve",
                                                                "comment": "fine"}
    assert len(committed(ledger, job_id)) == 1 and n8n.resumed[execution_id] == 1
    assert list(n8n.billed.values()) == [1]  # the workflow was started once
    assert [e for e in log(api, job_id) if e["event"] == "platform_resumed"]


def test_a_decision_whose_resume_never_reached_n8n_is_carried_out_by_the_next_attempt(push, make_job, api,
                                                                                      n8n):
    ledger, d = push
    resumer.install(d, background=False)
    job_id, approval = open_wait(ledger, d, make_job, n8n)
    n8n.resume_fail = 1  # the fast path's resume gets a 503: nothing resumed
    ledger.approvals.decide("acme", approval["id"], "approve", "ana", comment="fine")
    execution_id = next(iter(n8n.executions))
    assert n8n.resumed[execution_id] == 0
    assert [e for e in log(api, job_id) if e["event"] == "platform_resume_failed"]
    job, _ = run_job(ledger, d, job_id)  # the next attempt finds the approved wait still waiting
    assert job["status"] == "succeeded", job
    assert n8n.resumed[execution_id] == 1 and len(committed(ledger, job_id)) == 1
    assert batch(api, job_id)["stages"]["review"]["output"]["decision"] == "approve"
    assert "resuming_decided_wait" in [e["event"] for e in log(api, job_id)]


def test_without_a_resumer_the_next_attempt_resumes_with_the_recorded_decision(push, make_job, api, n8n):
    ledger, d = push  # no resumer installed: as if the deciding process died right after deciding
    job_id, approval = open_wait(ledger, d, make_job, n8n)
    ledger.approvals.decide("acme", approval["id"], "approve", "ana", comment="late", output={"k": 1})
    job, _ = run_job(ledger, d, job_id)
    assert job["status"] == "succeeded", job
    sent = n8n.resume_calls[-1].json
    assert sent["approved"] is True and sent["comment"] == "late" and sent["output"] == {"k": 1}
    assert n8n.resumed[next(iter(n8n.executions))] == 1 and len(committed(ledger, job_id)) == 1


def test_a_rejection_is_sent_to_n8n_and_fails_the_batch_as_rejected(push, make_job, api, n8n):
    ledger, d = push
    resumer.install(d, background=False)
    job_id, approval = open_wait(ledger, d, make_job, n8n)
    ledger.approvals.decide("acme", approval["id"], "reject", "ana", comment="wrong total")
    assert n8n.resume_calls[-1].json["decision"] == "reject"  # the flow hears it and can clean up
    failed = batch(api, job_id)
    assert failed["status"] == "failed" and failed["error_type"] == "rejected", failed
    assert not committed(ledger, job_id)


# -- Dify and Coze through the gateway ----------------------------------------------------------------

@pytest.mark.parametrize("platform", ["dify", "coze"])
def test_a_dify_form_and_a_coze_question_are_answered_through_their_approval(push, make_job, api, platform):
    ledger, d = push
    resumer.install(d, background=False)
    with (WaitingDify(api_key=DIFY_KEY, run_s=0.1) if platform == "dify"
          else WaitingCoze(token=COZE_TOKEN, run_s=0.1)) as server:
        if platform == "dify":
            target = {"type": "dify", "base_url": server.base_url, "api_key_secret": "dify",
                      "mode": "streaming"}
            answer, prompt = {"comment": "total checked"}, WaitingDify.PROMPT
        else:
            server.plan("question")
            target = {"type": "coze", "base_url": server.base_url, "token_secret": "coze",
                      "workflow_id": "7391", "mode": "stream", "studio": True}
            answer, prompt = "EMEA", WaitingCoze.PROMPT
        stage = {**flow_stage(server)[0], "target": target}
        job_id = make_job(items=[1, 2], max_items=2, stage_defs=[stage])
        job, _ = run_job(ledger, d, job_id)
        assert job["status"] == "waiting_human", job
        (approval,), _ = ledger.approvals.list("acme", "pending")
        assert approval["prompt"] == prompt
        ledger.approvals.decide("acme", approval["id"], "approve", "ana", output=answer)
        job, _ = run_job(ledger, d, job_id)
        billed = dict(server.billed) if platform == "coze" else None
        resumed = server.submitted if platform == "dify" else server.resumed
    assert job["status"] == "succeeded", job
    out = batch(api, job_id)["stages"]["review"]["output"]
    if platform == "dify":
        assert out == {"count": 2, "action": "approve", "inputs": answer}
    else:
        assert out == {"count": 2, "answer": "EMEA"} and list(billed.values()) == [1]
    assert list(resumed.values()) == [1] and len(committed(ledger, job_id)) == 1


# -- real processes, SIGKILL while the approval is open -------------------------------------------------

class Processes:
    """The API (gunicorn), a worker and a supervisor, as `batchgate up` runs them; killable, restartable."""

    def __init__(self, redis_url: str, data_dir, secrets: dict) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        own = Settings(secrets=secrets, data_dir=data_dir)
        self.env = {**procs.child_env(own, redis_url, {TOKEN: "acme"}),
                    "BATCHGATE_OUTBOUND_ALLOW": '["127.0.0.1/32"]', "BATCHGATE_DATA_DIR": str(data_dir),
                    "BATCHGATE_PUBLIC_URL": self.base, "BATCHGATE_SUPERVISOR_INTERVAL": "0.2",
                    "BATCHGATE_LOG_LEVEL": "WARNING", "BATCHGATE_WORKER_CONCURRENCY": "4"}
        self.children: list = []

    def start(self) -> None:
        api = procs.start_api(self.env, "127.0.0.1", self.port, workers=2)
        self.children = [api, procs.start_worker(self.env), procs.start_supervisor(self.env)]
        procs.wait_healthy(self.base, proc=api)

    def kill(self) -> None:
        for proc in self.children:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()

    def stop(self) -> None:
        procs.stop_all(self.children)

    def get(self, path: str) -> dict:
        return requests.get(self.base + path, headers={"Authorization": f"Bearer {TOKEN}"}, timeout=10).json()

    def post(self, path: str, body: dict) -> requests.Response:
        return requests.post(self.base + path, json=body, headers={"Authorization": f"Bearer {TOKEN}"},
                             timeout=10)

    def until(self, what, timeout_s: float = 30.0):
        deadline = time.monotonic() + timeout_s
        while not (found := what()):
            assert time.monotonic() < deadline, "timed out"
            time.sleep(0.1)
        return found


@pytest.mark.slow
def test_sigkill_while_the_approval_is_open_loses_nothing(redis_server, redis_client, tmp_path):
    with WaitingN8n(api_key=N8N_KEY, run_s=0.3) as n8n:
        n8n.plan("wait_webhook")
        stack = Processes(redis_server.url, tmp_path / "data", {"acme": {"n8n": N8N_KEY}})
        stack.start()
        try:
            spec = {"id": "waits", "version": "1", "batching": {"max_items": 2},
                    "source": {"type": "sequence", "count": 2}, "stages": flow_stage(n8n)}
            assert stack.post("/v1/flows", spec).status_code == 201
            job_id = stack.post("/v1/jobs", {"flow_id": "waits"}).json()["job_id"]
            pending = stack.until(lambda: stack.get("/v1/approvals?status=pending")["approvals"])
            assert pending[0]["prompt"] == REVIEW_NOTE and pending[0]["job_id"] == job_id
            assert stack.get(f"/v1/jobs/{job_id}")["status"] == "waiting_human"

            stack.kill()  # API, worker and supervisor die with the approval open
            stack.start()
            again = stack.get("/v1/approvals?status=pending")["approvals"]
            assert [a["id"] for a in again] == [pending[0]["id"]]  # the approval is still there
            execution_id = next(iter(n8n.executions))
            assert n8n.resumed[execution_id] == 0  # and the execution still waits on n8n
            decided = stack.post(f"/v1/approvals/{pending[0]['id']}",
                                 {"decision": "approve", "comment": "ok"})
            assert decided.status_code == 200, decided.text
            job = stack.until(lambda: (j := stack.get(f"/v1/jobs/{job_id}"))["status"] == "succeeded" and j)
            out = stack.get(f"/v1/jobs/{job_id}/batches/0")["stages"]["review"]["output"]
        finally:
            stack.stop()
    assert job["status"] == "succeeded"
    assert out == {"count": 2, "decision": "approve", "comment": "ok"}
    assert n8n.resumed[execution_id] == 1  # resumed once
    assert list(n8n.billed.values()) == [1]  # started once
    completed = [f for _, f in redis_client.xrange(f"{Ledger(redis_client, Settings()).keys.job(job_id).log}")
                 if f["event"] == "stage_completed"]
    assert len(completed) == 1  # committed once
    assert json.loads(redis_client.hget(Ledger(redis_client, Settings()).keys.job(job_id).batch(0), "out:0"))
