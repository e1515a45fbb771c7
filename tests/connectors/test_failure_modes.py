"""Dify and Coze Studio failure modes against stand-ins that model runs and billing (tests/standins.py).

Every test crosses a real socket. The point of each: what the connector reports, and what happened on the
platform meanwhile (runs billed per idempotency key, runs left stuck), so that a class that would make the
gateway pay twice, or wait for ever, fails here.
"""

from __future__ import annotations

import socket
import threading
import time

import pytest
import requests

from connectors import get_connector
from connectors.base import Done, Retry, Running
from tests.connectors.helpers import COZE_TOKEN, DIFY_KEY, call, raises
from tests.standins import StandinCozeStudio, StandinDify

R, IDEM, U, F = Retry.RETRYABLE, Retry.IF_IDEMPOTENT, Retry.UNKNOWN, Retry.FATAL
KEY = "job_1:4:score:2"  # helpers.envelope()'s idempotency key
WORKFLOW_UUID = "5f0c9a2e-3b1d-4c55-9a57-0d7e1f2a3b4c"


def dify_call(server, timeout_s=5.0, on_progress=None, **target):
    return call({"type": "dify", "base_url": server.base_url, "api_key_secret": "DIFY", **target},
                {"api_key_secret": DIFY_KEY}, timeout_s=timeout_s, on_progress=on_progress)


def coze_call(server, timeout_s=5.0, **target):
    return call({"type": "coze", "base_url": server.base_url, "token_secret": "COZE", "workflow_id": "7391",
                 "studio": True, **target}, {"token_secret": COZE_TOKEN}, timeout_s=timeout_s)


def dify(**kwargs):
    return StandinDify(api_key=DIFY_KEY, **kwargs)


def studio(**kwargs):
    return StandinCozeStudio(token=COZE_TOKEN, **kwargs)


# ---- Dify blocking: a gateway that gives up while the run goes on ----

@pytest.mark.parametrize("cut_style", ["504", "drop"])
def test_dify_blocking_cut_by_the_gateway_is_unknown_and_the_run_was_billed(session, cut_style):
    with dify(run_s=0.6, blocking_cut_s=0.2, cut_style=cut_style) as platform:
        err = raises(U, lambda: get_connector("dify").trigger(dify_call(platform), session), DIFY_KEY)
        assert err.handle is None and not err.outage  # blocking gives no run id before its end
        platform.settle()
        (run_id,) = platform.runs
        assert platform.billed == {KEY: 1} and platform.status(run_id) == "succeeded"


def test_dify_blocking_timeout_on_our_side_is_unknown_too(session):
    with dify(run_s=0.8) as platform:
        raises(U, lambda: get_connector("dify").trigger(dify_call(platform, timeout_s=0.3), session))
        platform.settle()
        assert platform.billed == {KEY: 1}


def test_dify_blocking_within_the_cut_is_done(session):
    with dify(run_s=0.05, blocking_cut_s=0.5) as platform:
        out = get_connector("dify").trigger(dify_call(platform), session)
        assert isinstance(out, Done) and out.answer.output == {"count": 3} and platform.billed == {KEY: 1}


# ---- Dify streaming: read to workflow_finished, never leave a run stuck ----

def test_the_standin_leaves_a_run_stuck_when_the_client_hangs_up_early(session):
    """What batchgate used to do (close at workflow_started) leaves the run running for ever, billed."""
    with dify(run_s=0.3) as platform:
        stage = dify_call(platform, mode="streaming")
        resp = session.post(f"{platform.base_url}/v1/workflows/run", stream=True, timeout=5,
                            headers={"Authorization": f"Bearer {DIFY_KEY}", "Idempotency-Key": KEY},
                            json={"inputs": {}, "response_mode": "streaming", "user": "u"})
        for line in resp.iter_lines():
            if b"workflow_started" in line:
                break
        resp.close()
        platform.settle()
        (run_id,) = platform.runs
        assert platform.billed == {KEY: 1} and platform.stuck_runs() == [run_id]
        out = get_connector("dify").poll(stage, {"run_id": run_id}, session)
        assert isinstance(out, Running)  # a poll would never end


def test_dify_streaming_reads_to_workflow_finished_and_leaves_no_stuck_run(session):
    beats: list[float] = []
    with dify(run_s=1.3, ping_s=0.05) as platform:
        stage = dify_call(platform, mode="streaming", timeout_s=0.5,  # longer than the pings' gap only
                          on_progress=lambda: beats.append(time.monotonic()))
        started = time.monotonic()
        out = get_connector("dify").trigger(stage, session)
        took = time.monotonic() - started
        assert isinstance(out, Done) and out.answer.output == {"count": 3}
        assert took >= 1.3 and set(out.platform_ids) == {"workflow_run_id", "task_id"}
        platform.settle()
        assert platform.billed == {KEY: 1} and platform.stuck_runs() == []
        assert platform.status(out.platform_ids["workflow_run_id"]) == "succeeded"
    # on_progress: on the first event, then at most once a second while pings come every 50 ms
    assert len(beats) == 2 and beats[1] - beats[0] >= 1.0


def test_dify_on_progress_that_raises_does_not_break_the_stream(session):
    def broken_heartbeat():
        raise RuntimeError("lease lost")

    with dify(run_s=0.2) as platform:
        stage = dify_call(platform, mode="streaming", on_progress=broken_heartbeat)
        out = get_connector("dify").trigger(stage, session)
        assert isinstance(out, Done)
        platform.settle()
        assert platform.stuck_runs() == []


@pytest.mark.parametrize("sticks, final", [(True, Running), (False, Done)])
def test_dify_stream_broken_mid_way_yields_a_pollable_handle(session, sticks, final):
    with dify(run_s=0.6, break_after_s=0.15, sticks_on_hangup=sticks) as platform:
        connector, stage = get_connector("dify"), dify_call(platform, mode="streaming")
        out = connector.trigger(stage, session)
        (run_id,) = platform.runs
        assert isinstance(out, Running) and out.handle == {"run_id": run_id}
        platform.settle()
        time.sleep(0.1)
        # the poll reaches the run by its id: an old Dify still says running (the gateway's lease bounds
        # the wait), one that decouples runs from streams has the outcome
        polled = connector.poll(stage, out.handle, session)
        assert isinstance(polled, final) and platform.billed == {KEY: 1}
        if final is Done:
            assert polled.answer.output == {"count": 3}


def test_dify_stream_broken_before_workflow_started_is_unknown_without_handle(session):
    with dify(run_s=0.2) as platform:
        platform.break_before_started = True
        err = raises(U, lambda: get_connector("dify").trigger(dify_call(platform, mode="streaming"), session))
        assert err.handle is None
        platform.settle()
        assert platform.billed == {KEY: 1}  # why it cannot be RETRYABLE: the run went on


def test_dify_poll_failures_are_retryable(session):
    with dify(run_s=0.05) as platform:
        platform.poll_unavailable = True
        handle = {"run_id": "dify-run-1"}
        err = raises(R, lambda: get_connector("dify").poll(dify_call(platform), handle, session))
        assert err.outage and err.status == 503 and err.platform_ids == {"workflow_run_id": "dify-run-1"}


# ---- Dify: refusals before any run ----

def test_dify_concurrency_429_has_no_retry_after_and_bills_nothing(session):
    with dify(run_s=0.4, max_active=1) as platform:
        first = threading.Thread(target=lambda: get_connector("dify").trigger(dify_call(platform), session))
        first.start()
        time.sleep(0.1)
        with requests.Session() as other:
            err = raises(R, lambda: get_connector("dify").trigger(dify_call(platform), other))
        first.join()
        assert err.outage and err.retry_after_s is None and err.status == 429
        platform.settle()
        assert platform.billed == {KEY: 1}  # the first run only


def test_dify_draft_only_app_is_fatal_with_a_publish_hint(session):
    with dify(published=False) as platform:
        err = raises(F, lambda: get_connector("dify").trigger(dify_call(platform), session))
        assert err.code == "invalid_param" and "publish the app" in err.message and platform.billed == {}


def test_dify_pinned_version_on_a_free_plan_is_fatal(session):
    with dify(free_plan=True) as platform:
        stage = dify_call(platform, workflow_id=WORKFLOW_UUID)
        err = raises(F, lambda: get_connector("dify").trigger(stage, session))
        assert err.status == 403 and "paid Dify Cloud plan" in err.message


def test_dify_down_is_an_outage(session):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stage = call({"type": "dify", "base_url": f"http://127.0.0.1:{port}", "api_key_secret": "DIFY"},
                 {"api_key_secret": DIFY_KEY})
    err = raises(R, lambda: get_connector("dify").trigger(stage, session))
    assert err.outage and err.handle is None


# ---- Coze Studio ----

def test_coze_unpublished_workflow_is_fatal(session):
    with studio(published=False) as platform:
        err = raises(F, lambda: get_connector("coze").trigger(coze_call(platform), session), COZE_TOKEN)
        assert err.code == "6031" and "publish the workflow" in err.message and err.handle is None
        assert platform.billed == {}


@pytest.mark.parametrize("behaviour, code, fragment", [
    ("timeout", "6023", "timed out"),
    ("node_fail", "720701013", "division by zero"),
])
def test_coze_run_that_ran_is_unknown_and_its_handle_polls_the_outcome(session, behaviour, code, fragment):
    with studio() as platform:
        platform.plan(behaviour)
        connector, stage = get_connector("coze"), coze_call(platform)
        err = raises(U, lambda: connector.trigger(stage, session))
        (execute_id,) = platform.runs
        assert err.code == code and err.handle == {"execute_id": execute_id}
        assert err.platform_ids["execute_id"] == execute_id
        failed = raises(IDEM, lambda: connector.poll(stage, err.handle, session))
        assert fragment in failed.message  # Studio's error_msg
        platform.settle()
        assert platform.billed == {KEY: 1}


def test_coze_risk_control_is_retryable_and_ran_nothing(session):
    with studio() as platform:
        platform.plan("risk")
        err = raises(R, lambda: get_connector("coze").trigger(coze_call(platform), session))
        assert err.code == "4102" and err.outage and err.handle is None and platform.billed == {}


def test_coze_question_node_in_a_sync_run_is_fatal(session):
    with studio() as platform:
        platform.plan("question")
        err = raises(F, lambda: get_connector("coze").trigger(coze_call(platform), session))
        assert "waiting for a person" in err.message and err.handle is None
        assert err.code == "waiting_human"


def test_coze_sync_call_cut_while_the_run_goes_on_is_unknown(session):
    with studio(sync_cut_s=0.2, slow_run_s=0.6) as platform:
        platform.plan("slow")
        connector, stage = get_connector("coze"), coze_call(platform)
        raises(U, lambda: connector.trigger(stage, session))
        platform.settle()
        (execute_id,) = platform.runs
        assert platform.billed == {KEY: 1}
        # the run finished on Coze: a poll by its execute_id (from the Coze UI or logs) has the answer
        assert connector.poll(stage, {"execute_id": execute_id}, session).answer.output == {"count": 3}


def test_coze_async_cancelled_run_is_fatal(session):
    with studio() as platform:
        platform.plan("cancel")
        connector, stage = get_connector("coze"), coze_call(platform, mode="async")
        handle = connector.trigger(stage, session).handle
        platform.settle()
        assert "cancelled on Coze" in raises(F, lambda: connector.poll(stage, handle, session)).message


def test_coze_studio_sync_success_and_version_field(session):
    with studio() as platform:
        out = get_connector("coze").trigger(coze_call(platform, workflow_version="v0.0.2"), session)
        assert out.answer.output == {"count": 3} and platform.versions == ["v0.0.2"]
        assert platform.requests[-1].json.get("workflow_version") is None


def test_coze_async_success_polls_studio_history(session):
    with studio() as platform:
        connector, stage = get_connector("coze"), coze_call(platform, mode="async")
        out = connector.trigger(stage, session)
        assert isinstance(out, Running)
        platform.settle()
        assert connector.poll(stage, out.handle, session).answer.output == {"count": 3}
