"""Every end and waiting state a platform has, through the gateway, against stand-ins built from the
platforms' sources (tests/standins.py; docs/connectors-failure-modes.md, "End and waiting states").

Each stand-in bills its runs per idempotency key. For every state the tests check what a user cares about:
no ``idempotent: false`` batch is billed twice, no wrong or cut output is committed, the platform's message
is kept, and the batch ends within a stated bound:

- a Dify ``error`` frame ends the attempt when the stream ends (the run is never polled);
- a run waiting for a person (n8n WAIT_INDEFINITELY or a ``waitTill`` past max_run, a Dify human-input
  node, a Coze interrupt) is seen at the first answer that shows it (the stream's end, or the first poll,
  ``poll_interval`` after the trigger) and never run again: a wait the platform's API can resume (a
  Dify form on the stream) opens an approval showing the platform's prompt (tests/test_platform_waits.py
  decides it); one it cannot (a signed or id-less n8n "send and wait" link) fails as ``waiting_human``;
- a Coze run history ``Success`` is unwrapped (``Output``) or, trimmed, fails as ``output_trimmed`` at
  that poll;
- polls back off (doubling from ``poll_interval`` to ``poll_cap``) and the log records state changes.
"""

from __future__ import annotations

import time
from datetime import timedelta

import pytest
from rq import SimpleWorker
from rq.serializers import JSONSerializer

import gateway.push.dispatch
from gateway.ledger.flows import Stage
from gateway.ledger.ledger import Ledger
from gateway.push.dispatch import Dispatcher, PollState, poll_cap
from tests.standins import StandinCoze, StandinDify, StandinN8n

DIFY_KEY, COZE_TOKEN, N8N_KEY = "app-standin-key", "pat_standin-token", "n8n-standin-key"
#: Every state below ends within this many seconds of the job's start (stated bound; the stand-ins' runs
#: take at most 0.6 s, polls start at 0.05 s, outages cool down for 1 s first).
BOUND_S = 8.0


@pytest.fixture
def push(settings, redis_client, monkeypatch):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"], "secrets": {"acme": {
        "dify": DIFY_KEY, "coze": COZE_TOKEN, "n8n": N8N_KEY}}})
    ledger = Ledger(redis_client, own)
    d = Dispatcher.build(own, ledger)
    monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)
    return ledger, d


def stage(target: dict, idempotent: bool = False, **extra) -> list[dict]:
    return [{"name": "run", "idempotent": idempotent, "timeout": 2, "lease": 10, "poll_interval": 0.05,
             "retry": {"initial_interval": 0.01, "maximum_attempts": 3}, "target": target, **extra}]


def run_job(ledger: Ledger, d: Dispatcher, job_id: str, timeout_s: float = 20) -> tuple[dict, float]:
    """Run the job's calls and polls (RQ, scheduler included) in this process until it ends."""
    started = time.monotonic()
    while ledger.job_fields(job_id)["status"] == "running":
        assert time.monotonic() - started < timeout_s, ledger.job_fields(job_id)
        d.run_ready(job_id)
        SimpleWorker([d.queue], connection=d.queue.connection, serializer=JSONSerializer).work(
            burst=True, with_scheduler=True, logging_level="WARNING")
        time.sleep(0.02)
    return ledger.job_fields(job_id), time.monotonic() - started


def log(api, job_id: str) -> list[dict]:
    return api.get(f"/v1/jobs/{job_id}/log").json()["entries"]


def batch(api, job_id: str, seq: int = 0) -> dict:
    return api.get(f"/v1/jobs/{job_id}/batches/{seq}").json()


def dify(server: StandinDify) -> dict:
    return {"type": "dify", "base_url": server.base_url, "api_key_secret": "dify", "mode": "streaming"}


def n8n(server: StandinN8n) -> dict:
    return {"type": "n8n", "url": server.url, "api_url": server.base_url, "api_key_secret": "n8n"}


# -- Dify: an error frame ends the run ------------------------------------------------------------

DIFY_ERROR = {"code": "internal_server_error", "status": 500,
              "message": "Internal Server Error, please contact support: model gateway reset"}


def test_a_dify_error_event_fails_the_run_at_once_never_polled_and_billed_once(push, make_job, api):
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.4, stream_error=DIFY_ERROR) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(dify(server)))
        job, took = run_job(ledger, d, job_id)
        server.settle()
        billed, polls, stuck = dict(server.billed), server.polls(), server.stuck_runs()
    assert job["status"] == "failed" and took < BOUND_S
    assert list(billed.values()) == [1]  # one run, never again
    assert polls == 0 and len(stuck) == 1  # Dify left the run `running`; batchgate did not poll it
    failed = batch(api, job_id)
    assert failed["status"] == "failed" and "model gateway reset" in failed["error"], failed
    assert failed["error_type"] == "internal_server_error" and failed["attempt"] == 1
    assert "platform_running" not in [e["event"] for e in log(api, job_id)]


def test_a_dify_error_event_of_an_idempotent_stage_is_retried_as_a_failed_run(push, make_job, api):
    ledger, d = push
    with StandinDify(api_key=DIFY_KEY, run_s=0.2, stream_error=DIFY_ERROR) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(dify(server), idempotent=True))
        job, took = run_job(ledger, d, job_id)
        server.settle()
        billed, polls = dict(server.billed), server.polls()
    assert job["status"] == "failed" and took < BOUND_S
    assert list(billed.values()) == [3] and polls == 0  # maximum_attempts, same key; nothing polled
    assert batch(api, job_id)["attempts_spent"] == 3


# -- runs waiting for a person ----------------------------------------------------------------------

def assert_waiting_human(api, job_id: str, prompt: str | None, *words: str) -> None:
    failed = batch(api, job_id)
    assert failed["status"] == "failed" and failed["error_type"] == "waiting_human", failed
    assert "waiting for a person" in failed["error"] and all(w in failed["error"] for w in words), failed
    shown = [e for e in log(api, job_id) if e["event"] == "waiting_on_person"]
    assert len(shown) == 1
    if prompt is not None:
        assert prompt in failed["error"] and shown[0]["prompt"] == prompt


def test_a_dify_human_input_node_opens_an_approval_showing_its_prompt(push, make_job, api):
    ledger, d = push
    prompt = "Check the extracted invoice total before it is booked"
    with StandinDify(api_key=DIFY_KEY, run_s=0.1, human_input=prompt) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(dify(server), idempotent=True))
        job, took = run_job(ledger, d, job_id)
        server.settle()
        billed, polls = dict(server.billed), server.polls()
    # its form can be submitted through Dify's API: the batch waits for a person (issue 16), no lease held
    assert job["status"] == "waiting_human" and took < BOUND_S
    assert list(billed.values()) == [1] and polls == 0  # never run again, even when idempotent
    waiting = batch(api, job_id)
    assert waiting["status"] == "waiting_human", waiting
    approvals = api.get("/v1/approvals?status=pending").json()["approvals"]
    assert [a["kind"] for a in approvals] == ["platform"] and approvals[0]["prompt"] == prompt
    shown = [e for e in log(api, job_id) if e["event"] == "waiting_on_person"]
    assert len(shown) == 1 and shown[0]["prompt"] == prompt


@pytest.mark.parametrize("behaviour, prompt, words", [
    ("wait_person", StandinN8n.PROMPT, ("no time limit", "Ask manager")),
    ("wait_long", None, ("after the stage's max_run ends", "'Wait'")),
])
def test_an_n8n_execution_waiting_past_max_run_fails_as_waiting_human(push, make_job, api, behaviour, prompt,
                                                                      words):
    ledger, d = push
    with StandinN8n(api_key=N8N_KEY, wait_long_s=3600) as server:
        server.plan(behaviour)
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(n8n(server), max_run=60))
        job, took = run_job(ledger, d, job_id)
        billed, polls = dict(server.billed), sum(server.polls.values())
    assert job["status"] == "failed" and took < BOUND_S
    assert list(billed.values()) == [1] and polls == 1  # seen at the first poll; not polled on
    assert_waiting_human(api, job_id, prompt, *words)


def test_an_n8n_execution_waiting_briefly_is_polled_to_its_answer(push, make_job, api):
    ledger, d = push
    with StandinN8n(api_key=N8N_KEY, run_s=0.5) as server:
        server.plan("wait_short")
        job_id = make_job(items=[1, 2, 3], max_items=3, stage_defs=stage(n8n(server)))
        job, took = run_job(ledger, d, job_id)
        billed = dict(server.billed)
    assert job["status"] == "succeeded" and took < BOUND_S
    assert list(billed.values()) == [1]
    assert batch(api, job_id)["stages"]["run"]["output"] == {"count": 3}
    running = [e["platform_status"] for e in log(api, job_id) if e["event"] == "platform_running"]
    assert running == ["running", "waiting"]  # the trigger's answer, then the state change only


# -- Coze output envelopes and trimmed outputs -------------------------------------------------------

def coze(server: StandinCoze) -> dict:
    return {"type": "coze", "base_url": server.base_url, "token_secret": "coze", "workflow_id": "7391",
            "mode": "async"}


def test_coze_run_history_output_is_unwrapped_to_the_end_nodes_answer(push, make_job, api):
    ledger, d = push
    with StandinCoze(token=COZE_TOKEN) as server:
        job_id = make_job(items=[1, 2, 3, 4], max_items=2, stage_defs=stage(coze(server)))
        job, took = run_job(ledger, d, job_id)
        server.settle()
        billed = dict(server.billed)
    assert job["status"] == "succeeded" and took < BOUND_S
    assert sorted(billed.values()) == [1, 1]
    for seq in (0, 1):  # the End node's JSON, not {"Output": ..., "node_status": ...}
        assert batch(api, job_id, seq)["stages"]["run"]["output"] == {"count": 2}


def test_a_trimmed_coze_output_is_never_committed(push, make_job, api):
    ledger, d = push
    with StandinCoze(token=COZE_TOKEN) as server:
        server.plan("trimmed")
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(coze(server), idempotent=True))
        job, took = run_job(ledger, d, job_id)
        server.settle()
        billed = dict(server.billed)
    assert job["status"] == "failed" and took < BOUND_S
    assert list(billed.values()) == [1]  # fatal: running it again would be cut again
    failed = batch(api, job_id)
    assert failed["error_type"] == "output_trimmed" and "trimmed its output" in failed["error"], failed
    assert failed["stages"]["run"].get("output") is None


# -- 503: delivered or not ----------------------------------------------------------------------------

@pytest.mark.parametrize("first, status, billed, attempts_spent, error_type", [
    ("db_not_ready", "succeeded", 1, 1, None),  # n8n's health check answered: nothing ran
    ("proxy_503", "succeeded", 1, 1, None),  # an Envoy in front had no upstream: nothing ran
    ("bare_503", "failed", 1, 1, "outcome_unknown"),  # the workflow started behind it: may have run
])
def test_a_503_is_waited_out_only_when_the_call_provably_did_not_run(push, make_job, api, first, status,
                                                                     billed, attempts_spent, error_type):
    ledger, d = push
    with StandinN8n(api_key=N8N_KEY, run_s=0.05) as server:
        server.plan(first)
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(n8n(server)))
        job, took = run_job(ledger, d, job_id)
        total = sum(server.billed.values())
    assert job["status"] == status and took < BOUND_S
    assert total == billed  # never billed twice for a stage that is not idempotent
    result = batch(api, job_id)
    assert result["attempts_spent"] == attempts_spent and result.get("error_type") == error_type, result
    if first == "bare_503":
        assert "Service Unavailable" in result["error"]


# -- polls back off, the log records changes ---------------------------------------------------------

def test_polls_back_off_and_the_log_records_state_changes_not_polls(push, make_job, api):
    ledger, d = push
    with StandinN8n(api_key=N8N_KEY, run_s=2.5) as server:
        job_id = make_job(items=[1], max_items=1, stage_defs=stage(n8n(server), lease=2))
        job, took = run_job(ledger, d, job_id)
        polls = sum(server.polls.values())
    assert job["status"] == "succeeded" and took < BOUND_S
    # 0.05, 0.1, 0.2, 0.4, 0.8, then the cap (half the 2 s lease): about 7 polls in 2.5 s, not 50
    assert 4 <= polls <= 10, polls
    events = [e["event"] for e in log(api, job_id)]
    assert events.count("platform_running") == 1 and events.count("poll_failed") == 0


def test_poll_waits_double_from_poll_interval_to_the_cap():
    one = Stage.model_validate({"name": "s", "poll_interval": 2, "lease": 600})
    state, waits = PollState(), []
    for _ in range(8):
        state = state.after(one)
        waits.append(state.wait_ms)
    assert waits == [2000, 4000, 8000, 16000, 32000, 60000, 60000, 60000]
    short = Stage.model_validate({"name": "s", "poll_interval": 2, "lease": 10})
    assert poll_cap(short) == timedelta(seconds=5)  # half the lease: each poll heartbeats it
    slow = Stage.model_validate({"name": "s", "poll_interval": 90, "lease": 120})
    assert poll_cap(slow) == timedelta(seconds=90)  # never below the stage's own interval
