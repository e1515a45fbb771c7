"""Each connector against a fake platform on a real socket (tests/platforms.py)."""

from __future__ import annotations

import json
import socket
import time

import pytest

from connectors import get_connector
from connectors.base import Accepted, Done, Retry, Running
from tests.connectors.helpers import (
    COZE_TOKEN,
    DIFY_KEY,
    HOOK_SECRET,
    N8N_API_KEY,
    assert_signed,
    call,
    envelope,
    raises,
)
from tests.platforms import FakeCoze, FakeDify, FakeHttpPlatform, FakeN8n

R, IDEM, U, F = Retry.RETRYABLE, Retry.IF_IDEMPOTENT, Retry.UNKNOWN, Retry.FATAL
SHORT_TIMEOUT_S = 0.5
WORKFLOW_UUID = "5f0c9a2e-3b1d-4c55-9a57-0d7e1f2a3b4c"


@pytest.fixture
def endpoint():
    with FakeHttpPlatform(auth=f"Bearer {HOOK_SECRET}") as server:
        yield server


@pytest.fixture
def n8n():
    with FakeN8n(header_auth=("X-N8N-Auth", HOOK_SECRET), api_key=N8N_API_KEY) as server:
        yield server


@pytest.fixture
def dify():
    with FakeDify(api_key=DIFY_KEY) as server:
        yield server


@pytest.fixture
def coze():
    with FakeCoze(token=COZE_TOKEN) as server:
        yield server


def http_call(server, timeout_s=5.0, **target):
    return call({"type": "http", "url": server.url, "auth_secret": "FLOW", **target},
                {"auth_secret": HOOK_SECRET}, timeout_s=timeout_s)


def n8n_call(server, timeout_s=5.0, secret=HOOK_SECRET, **target):
    return call({"type": "n8n", "url": server.url, "auth_secret": "HOOK", "api_url": server.base_url,
                 "api_key_secret": "N8N", **target}, {"auth_secret": secret, "api_key_secret": N8N_API_KEY},
                timeout_s=timeout_s)


def dify_call(server, timeout_s=5.0, key=DIFY_KEY, **target):
    return call({"type": "dify", "base_url": server.base_url, "api_key_secret": "DIFY", **target},
                {"api_key_secret": key}, timeout_s=timeout_s)


def coze_call(server, timeout_s=5.0, token=COZE_TOKEN, **target):
    return call({"type": "coze", "base_url": server.base_url, "token_secret": "COZE", "workflow_id": "7391",
                 **target}, {"token_secret": token}, timeout_s=timeout_s)


def assert_times_out(connector, stage, session):
    """A call the platform got but did not answer in time: UNKNOWN (the flow may have run)."""
    started = time.monotonic()
    err = raises(U, lambda: get_connector(connector).trigger(stage, session))
    assert time.monotonic() - started < SHORT_TIMEOUT_S + 1.0
    return err


# ---- generic http ----

def test_http_sync_success_signed_and_authenticated(endpoint, session):
    stage = http_call(endpoint)
    out = get_connector("http").trigger(stage, session)
    assert isinstance(out, Done) and out.answer.output == {"count": 3}
    request = endpoint.requests[-1]
    assert request.json == envelope() and request.headers["Authorization"] == f"Bearer {HOOK_SECRET}"
    assert_signed(request.headers, request.body, stage)


@pytest.mark.parametrize("behaviour, retry", [("rate_limited", R), ("server_error", U), ("unauthorized", F),
                                              ("not_contract", F)])
def test_http_failures(endpoint, session, behaviour, retry):
    endpoint.plan(behaviour)
    err = raises(retry, lambda: get_connector("http").trigger(http_call(endpoint), session), HOOK_SECRET)
    assert err.retry_after_s == (2.0 if behaviour == "rate_limited" else None)


def test_http_failed_answer_and_callback(endpoint, session):
    endpoint.plan("failed_answer", "accepted")
    answer = get_connector("http").trigger(http_call(endpoint), session).answer
    assert not answer.succeeded and answer.error_retryable is False
    assert isinstance(get_connector("http").trigger(http_call(endpoint, mode="callback"), session), Accepted)


def test_http_slow_answer_times_out(endpoint, session):
    endpoint.plan("slow")
    assert_times_out("http", http_call(endpoint, timeout_s=SHORT_TIMEOUT_S), session)


def test_nothing_listening_is_retryable_and_an_outage(session):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    stage = call({"type": "http", "url": f"http://127.0.0.1:{port}/x"})
    err = raises(R, lambda: get_connector("http").trigger(stage, session))
    assert "could not reach" in err.message and err.outage


# ---- n8n ----

def test_n8n_sync_success(n8n, session):
    stage = n8n_call(n8n)
    assert get_connector("n8n").trigger(stage, session).answer.output == {"count": 3}
    request = n8n.requests[-1]
    assert request.path == "/webhook/batchgate" and request.json["items"] == envelope()["items"]
    assert_signed(request.headers, request.body, stage)


@pytest.mark.parametrize("behaviour, retry", [
    ("fail_in_workflow", IDEM), ("not_registered", R), ("running_already", R), ("finished_already", F),
    ("unauthorized", F), ("rate_limited", R), ("started", F),
])
def test_n8n_failures(n8n, session, behaviour, retry):
    n8n.plan(behaviour)
    raises(retry, lambda: get_connector("n8n").trigger(n8n_call(n8n), session), HOOK_SECRET, N8N_API_KEY)


def test_n8n_wrong_credential_and_unknown_path(n8n, session):
    raises(F, lambda: get_connector("n8n").trigger(n8n_call(n8n, secret="wrong"), session), "wrong")
    stage = n8n_call(n8n)
    stage = call({**stage.target, "url": n8n.base_url + "/webhook/other"}, stage.secrets)
    err = raises(R, lambda: get_connector("n8n").trigger(stage, session))
    assert "activate/publish" in err.message and err.outage


def test_n8n_callback_mode_is_accepted(n8n, session):
    n8n.plan("started")
    assert get_connector("n8n").trigger(n8n_call(n8n, mode="callback"), session) == Accepted({})


def test_n8n_execution_polled_to_success(n8n, session):
    n8n.plan("async")
    connector, stage = get_connector("n8n"), n8n_call(n8n)
    out = connector.trigger(stage, session)
    assert isinstance(out, Running) and out.platform_ids["execution_id"] == out.handle["execution_id"]
    assert isinstance(connector.poll(stage, out.handle, session), Running)
    done = connector.poll(stage, out.handle, session)
    assert done.answer.output == {"count": 3} and done.platform_ids == out.platform_ids
    assert n8n.requests[-1].query == {"includeData": "true"}


def test_n8n_execution_polled_to_error(n8n, session):
    n8n.plan("async_error")
    connector, stage = get_connector("n8n"), n8n_call(n8n)
    handle = connector.trigger(stage, session).handle
    connector.poll(stage, handle, session)
    err = raises(IDEM, lambda: connector.poll(stage, handle, session))
    assert "Code" in err.message and err.platform_ids == {"execution_id": handle["execution_id"]}


def test_n8n_slow_answer_times_out(n8n, session):  # delivered: the workflow may have run
    n8n.plan("slow")
    stage = n8n_call(n8n, timeout_s=SHORT_TIMEOUT_S)
    started = time.monotonic()
    raises(Retry.UNKNOWN, lambda: get_connector("n8n").trigger(stage, session))
    assert time.monotonic() - started < SHORT_TIMEOUT_S + 1.0


# ---- dify ----

def test_dify_blocking_success(dify, session):
    stage = dify_call(dify)
    out = get_connector("dify").trigger(stage, session)
    assert out.answer.output == {"count": 3} and set(out.platform_ids) == {"workflow_run_id", "task_id"}
    request = dify.requests[-1]
    assert json.loads(request.json["inputs"]["batchgate"]) == envelope()
    assert_signed(request.headers, request.body, stage)


def test_dify_contract_outputs_with_custom_inputs(dify, session):
    dify.plan("contract")
    answer = get_connector("dify").trigger(dify_call(dify, inputs={"items": "items"}), session).answer
    assert answer.output == {"count": 3} and answer.has_next_cursor
    assert dify.requests[-1].json["inputs"] == {"items": envelope()["items"]}


@pytest.mark.parametrize("behaviour, retry", [
    ("status_failed_200", IDEM), ("stopped_200", F), ("rate_limited", R), ("invalid_param", F),
    ("workflow_request_error", IDEM), ("internal_error", U),
])
def test_dify_failures(dify, session, behaviour, retry):
    dify.plan(behaviour)
    err = raises(retry, lambda: get_connector("dify").trigger(dify_call(dify), session), DIFY_KEY)
    assert err.retry_after_s == (2.0 if behaviour == "rate_limited" else None)
    if behaviour.endswith("_200"):
        assert err.platform_ids["workflow_run_id"]


def test_dify_wrong_key_is_fatal(dify, session):
    raises(F, lambda: get_connector("dify").trigger(dify_call(dify, key="app-wrong-key"), session),
           "app-wrong-key")


def test_dify_streaming_reads_until_the_server_ends_then_polls(dify, session):
    dify.plan("async")
    dify.stream_s = 0.4  # FakeDify pings after workflow_started, then ends without workflow_finished
    connector, stage = get_connector("dify"), dify_call(dify, mode="streaming")
    beats = []
    stage = call(stage.target, stage.secrets, on_progress=lambda: beats.append(time.monotonic()))
    started = time.monotonic()
    out = connector.trigger(stage, session)
    assert time.monotonic() - started >= 0.4  # read to the end of the stream: never hung up first
    assert isinstance(out, Running) and out.platform_ids["task_id"] == f"task-{out.handle['run_id']}"
    assert len(beats) == 1  # pings every 50 ms, on_progress at most once a second
    assert isinstance(connector.poll(stage, out.handle, session), Running)
    assert connector.poll(stage, out.handle, session).answer.output == {"count": 3}
    assert dify.requests[-1].path == f"/v1/workflows/run/{out.handle['run_id']}"


def test_dify_streaming_failed_run_is_seen_by_polling(dify, session):
    dify.plan("status_failed_200")
    dify.stream_s = 0.1
    connector, stage = get_connector("dify"), dify_call(dify, mode="streaming")
    handle = connector.trigger(stage, session).handle
    assert "Node LLM" in raises(IDEM, lambda: connector.poll(stage, handle, session)).message


def test_dify_streaming_error_frame(dify, session):
    dify.plan("stream_error")
    err = raises(F, lambda: get_connector("dify").trigger(dify_call(dify, mode="streaming"), session))
    assert err.code == "provider_quota_exceeded"


def test_dify_stream_without_workflow_started_stops_at_the_timeout(dify, session):
    dify.plan("pings_only")
    err = assert_times_out("dify", dify_call(dify, mode="streaming", timeout_s=SHORT_TIMEOUT_S), session)
    assert "no workflow_started within 0.5 s" in err.message and err.handle is None


def test_dify_blocking_running_then_poll(dify, session):
    dify.plan("async")
    connector, stage = get_connector("dify"), dify_call(dify, workflow_id=WORKFLOW_UUID)
    out = connector.trigger(stage, session)
    assert dify.requests[-1].path == f"/v1/workflows/{WORKFLOW_UUID}/run"
    assert isinstance(connector.poll(stage, out.handle, session), Done)


def test_dify_slow_answer_times_out(dify, session):
    dify.plan("slow")
    assert_times_out("dify", dify_call(dify, timeout_s=SHORT_TIMEOUT_S), session)


# ---- coze ----

def test_coze_sync_success(coze, session):
    stage = coze_call(coze)
    out = get_connector("coze").trigger(stage, session)
    assert out.answer.output == {"count": 3}
    assert out.platform_ids["log_id"].startswith("log-") and out.platform_ids["debug_url"]
    assert_signed(coze.requests[-1].headers, coze.requests[-1].body, stage)


def test_coze_contract_answer(coze, session):
    coze.plan("contract")
    assert get_connector("coze").trigger(coze_call(coze), session).answer.has_next_cursor


@pytest.mark.parametrize("behaviour, retry", [("code_nonzero_200", R), ("not_published", F),
                                              ("rate_limited", R), ("studio_500", U)])
def test_coze_failures(coze, session, behaviour, retry):
    coze.plan(behaviour)
    err = raises(retry, lambda: get_connector("coze").trigger(coze_call(coze), session), COZE_TOKEN)
    assert err.platform_ids["log_id"].startswith("log-")
    assert err.retry_after_s == (2.0 if behaviour == "rate_limited" else None)


def test_coze_wrong_token_is_fatal(coze, session):
    raises(F, lambda: get_connector("coze").trigger(coze_call(coze, token="pat_wrong"), session), "pat_wrong")


def test_coze_async_running_then_success(coze, session):
    connector, stage = get_connector("coze"), coze_call(coze, mode="async")
    out = connector.trigger(stage, session)
    assert isinstance(out, Running) and out.platform_ids["execute_id"] == out.handle["execute_id"]
    assert isinstance(connector.poll(stage, out.handle, session), Running)
    done = connector.poll(stage, out.handle, session)
    assert done.answer.output == {"count": 3} and done.platform_ids["debug_url"]
    assert coze.requests[-1].path == f"/v1/workflows/7391/run_histories/{out.handle['execute_id']}"


def test_coze_async_fail(coze, session):
    coze.plan("async_fail")
    connector, stage = get_connector("coze"), coze_call(coze, mode="async")
    handle = connector.trigger(stage, session).handle
    connector.poll(stage, handle, session)
    assert "node LLM failed" in raises(IDEM, lambda: connector.poll(stage, handle, session)).message


def test_coze_studio(session):
    with FakeCoze(token=COZE_TOKEN, studio=True) as studio:
        studio.plan("studio_auth")
        connector, stage = get_connector("coze"), coze_call(studio, mode="async", studio=True)
        assert "Coze Studio rejected" in raises(F, lambda: connector.trigger(stage, session)).message
        handle = connector.trigger(stage, session).handle
        assert isinstance(connector.poll(stage, handle, session), Running)
        assert isinstance(connector.poll(stage, handle, session), Done)
        assert studio.requests[-1].path == "/v1/workflow/get_run_history"
        assert studio.requests[-1].query == {"workflow_id": "7391", "execute_id": handle["execute_id"]}


def test_coze_slow_answer_times_out(coze, session):
    coze.plan("slow")
    assert_times_out("coze", coze_call(coze, timeout_s=SHORT_TIMEOUT_S), session)
