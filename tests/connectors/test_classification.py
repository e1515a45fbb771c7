"""Every classification row of the contracts file, per connector, against `responses` mocks."""

from __future__ import annotations

import http.client
import json

import pytest
import requests
import urllib3

from connectors import get_connector
from connectors.base import Accepted, Done, Retry, Running
from tests.connectors.helpers import COZE_TOKEN, DIFY_KEY, HOOK_SECRET, N8N_API_KEY, call, raises

HOOK = "https://n8n.example/webhook/batch"
N8N_API = "https://n8n.example/api/v1/executions/77?includeData=true"
DIFY = "https://dify.example"
COZE = "https://coze.example"
WORKFLOW_UUID = "5f0c9a2e-3b1d-4c55-9a57-0d7e1f2a3b4c"

R, IDEM, U, F = Retry.RETRYABLE, Retry.IF_IDEMPOTENT, Retry.UNKNOWN, Retry.FATAL


def http_call(**target):
    return call({"type": "http", "url": "https://flow.example/run", **target})


def n8n_call(**target):
    return call({"type": "n8n", "url": HOOK, "api_url": "https://n8n.example", "api_key_secret": "N8N_KEY",
                 "auth_secret": "HOOK", **target},
                {"api_key_secret": N8N_API_KEY, "auth_secret": HOOK_SECRET})


def dify_call(**target):
    return call({"type": "dify", "base_url": DIFY, "api_key_secret": "DIFY_KEY", **target},
                {"api_key_secret": DIFY_KEY})


def coze_call(**target):
    return call({"type": "coze", "base_url": COZE, "token_secret": "COZE", "workflow_id": "73", **target},
                {"token_secret": COZE_TOKEN})


# ---- transport, shared by all ----

CONNECTORS = [  # n8n's own classes: tests/connectors/test_n8n_connector.py
    ("http", http_call, "https://flow.example/run"),
    ("dify", dify_call, f"{DIFY}/v1/workflows/run"),
    ("coze", coze_call, f"{COZE}/v1/workflow/run"),
]


def refused():
    cause = urllib3.exceptions.NewConnectionError(None, "Failed to establish a new connection: refused")
    return requests.ConnectionError(urllib3.exceptions.MaxRetryError(None, "/x", cause))


def no_such_host():
    cause = urllib3.exceptions.NameResolutionError("nowhere.example", None, OSError("Name not known"))
    return requests.ConnectionError(urllib3.exceptions.MaxRetryError(None, "/x", cause))


def tls_handshake_failed():
    cause = urllib3.exceptions.SSLError("certificate verify failed")
    return requests.exceptions.SSLError(urllib3.exceptions.MaxRetryError(None, "/x", cause))


def dropped():
    return requests.ConnectionError(urllib3.exceptions.ProtocolError(
        "Connection aborted.", http.client.RemoteDisconnected("Remote end closed connection")))


@pytest.mark.parametrize("kind, make, url", CONNECTORS)
@pytest.mark.parametrize("exc", [refused, no_such_host, tls_handshake_failed,
                                 lambda: requests.ConnectTimeout("no route")])
def test_a_request_never_sent_is_retryable_and_an_outage(mock, session, kind, make, url, exc):
    mock.post(url, body=exc())
    err = raises(R, lambda: get_connector(kind).trigger(make(), session))
    assert err.outage and "could not reach" in err.message and err.handle is None


@pytest.mark.parametrize("kind, make, url", CONNECTORS)
@pytest.mark.parametrize("exc", [lambda: requests.ReadTimeout("slow"), dropped,
                                 lambda: requests.ConnectionError("no cause given"),
                                 lambda: requests.exceptions.ChunkedEncodingError("broken body"),
                                 lambda: requests.exceptions.SSLError("bad record mac while reading")])
def test_a_request_delivered_without_answer_is_unknown(mock, session, kind, make, url, exc):
    mock.post(url, body=exc())
    err = raises(U, lambda: get_connector(kind).trigger(make(), session))
    assert not err.outage and "may have happened" in err.message


@pytest.mark.parametrize("kind, make, url, handle, ids", [
    ("n8n", n8n_call, N8N_API, {"execution_id": "77"}, {"execution_id": "77"}),
    ("dify", dify_call, f"{DIFY}/v1/workflows/run/r-1", {"run_id": "r-1"}, {"workflow_run_id": "r-1"}),
    ("coze", coze_call, f"{COZE}/v1/workflows/73/run_histories/e-9", {"execute_id": "e-9"},
     {"execute_id": "e-9"}),
])
@pytest.mark.parametrize("exc", [lambda: requests.ReadTimeout("slow"), dropped])
def test_poll_timeouts_are_retryable_and_keep_the_run_id(mock, session, kind, make, url, handle, ids, exc):
    mock.get(url, body=exc())
    err = raises(R, lambda: get_connector(kind).poll(make(), handle, session))
    assert err.platform_ids == ids and not err.outage


@pytest.mark.parametrize("kind, make, url, handle", [
    ("dify", dify_call, f"{DIFY}/v1/workflows/run/r-1", {"run_id": "r-1"}),
    ("coze", coze_call, f"{COZE}/v1/workflows/73/run_histories/e-9", {"execute_id": "e-9"}),
])
@pytest.mark.parametrize("status, outage", [(500, False), (502, False), (503, True), (504, False)])
def test_poll_5xx_is_retryable(mock, session, kind, make, url, handle, status, outage):
    mock.get(url, status=status, body="upstream trouble")
    err = raises(R, lambda: get_connector(kind).poll(make(), handle, session))
    assert err.outage is outage and err.status == status


# ---- http ----

@pytest.mark.parametrize("status, retry", [(400, F), (401, F), (403, F), (404, F), (422, F), (429, R),
                                           (500, U), (502, U), (503, U), (504, U)])
def test_http_statuses(mock, session, status, retry):
    mock.post("https://flow.example/run", status=status, json={"error": "nope"}, headers={"Retry-After": "7"})
    err = raises(retry, lambda: get_connector("http").trigger(http_call(), session))
    assert err.status == status and err.outage is (status in (429, 503))
    assert err.retry_after_s == (7.0 if status in (429, 503) else None)


def test_http_sync_answer_follows_the_contract(mock, session):
    mock.post("https://flow.example/run",
              json={"status": "succeeded", "output": {"n": 3}, "next_cursor": "c9"})
    out = get_connector("http").trigger(http_call(), session)
    assert isinstance(out, Done) and out.answer.output == {"n": 3} and out.answer.next_cursor == "c9"


def test_http_sync_failed_answer_is_done_with_the_failure(mock, session):
    mock.post("https://flow.example/run", json={"status": "failed", "error": {"message": "bad row",
                                                                                "retryable": False}})
    answer = get_connector("http").trigger(http_call(), session).answer
    assert not answer.succeeded and answer.error_message == "bad row" and answer.error_retryable is False


@pytest.mark.parametrize("body", [json.dumps({"result": 1}), json.dumps([1, 2]), "<html>ok</html>", ""])
def test_http_sync_body_outside_the_contract_is_fatal(mock, session, body):
    mock.post("https://flow.example/run", body=body, content_type="application/json")
    err = raises(F, lambda: get_connector("http").trigger(http_call(), session))
    assert err.message.startswith("answer does not follow the contract")


@pytest.mark.parametrize("status", [200, 202, 204])
def test_http_callback_any_2xx_is_accepted(mock, session, status):
    mock.post("https://flow.example/run", status=status, body="")
    assert isinstance(get_connector("http").trigger(http_call(mode="callback"), session), Accepted)


def test_http_auth_header_and_secret_never_in_messages(mock, session):
    mock.post("https://flow.example/run", status=401, json={"message": f"token {HOOK_SECRET} rejected"})
    stage = call({"type": "http", "url": "https://flow.example/run", "auth_secret": "HOOK",
                  "auth_scheme": "Token", "headers": {"X-Team": "ml", "Idempotency-Key": "forged"}},
                 {"auth_secret": HOOK_SECRET})
    err = raises(F, lambda: get_connector("http").trigger(stage, session), HOOK_SECRET)
    assert "[redacted]" in err.message
    sent = mock.calls[0].request.headers
    assert sent["Authorization"] == f"Token {HOOK_SECRET}" and sent["X-Team"] == "ml"
    assert sent["Idempotency-Key"] == stage.idempotency_key


def test_missing_secret_is_fatal_and_names_only_the_secret(session):
    stage = call({"type": "http", "url": "https://flow.example/run", "auth_secret": "FLOW_TOKEN"})
    err = raises(F, lambda: get_connector("http").trigger(stage, session))
    assert "FLOW_TOKEN" in err.message


def test_http_has_nothing_to_poll(session):
    raises(F, lambda: get_connector("http").poll(http_call(), {}, session))


# ---- n8n webhook ----

@pytest.mark.parametrize("status, body, retry, fragment", [
    (500, {"message": "Error in workflow"}, IDEM, "Error in workflow"),
    (500, {"message": "Internal error"}, U, "Internal error"),
    (404, {"code": 404, "message": 'The requested webhook "POST batch" is not registered.'}, R, "activate"),
    (404, {"code": 404, "message": 'The requested webhook "POST batch" is not registered.',
           "hint": "The workflow must be active for a production URL to run successfully. Did you mean to "
                   "make a GET request?"}, F, "listens for GET"),
    (401, "Authorization is required!", F, "Authorization is required"),
    (403, "Authorization data is wrong!", F, "wrong"),
    (409, {"message": 'The execution "5" is running already.'}, R, "running already"),
    (409, {"message": 'The execution "5" has finished already.'}, F, "finished"),
    (409, {"message": 'The execution "5" has finished with error.'}, F, "finished"),
    (429, {"message": "Too many requests"}, R, "Too many"),
    (502, "Bad Gateway", U, "Bad Gateway"),
    (503, "", U, ""),
])
def test_n8n_webhook_errors(mock, session, status, body, retry, fragment):
    kwargs = {"json": body} if isinstance(body, dict) else {"body": body}
    mock.post(HOOK, status=status, headers={"Retry-After": "3"}, **kwargs)
    err = raises(retry, lambda: get_connector("n8n").trigger(n8n_call(), session), HOOK_SECRET, N8N_API_KEY)
    assert fragment in err.message and err.status == status
    assert err.outage is (status in (404, 429, 503) and retry is not F)
    assert err.retry_after_s == (3.0 if err.retry is R or err.outage else None)


def test_n8n_sync_contract_answer(mock, session):
    mock.post(HOOK, json={"status": "succeeded", "output": {"n": 3}})
    out = get_connector("n8n").trigger(n8n_call(), session)
    assert isinstance(out, Done) and out.answer.output == {"n": 3}
    assert mock.calls[0].request.headers["X-N8N-Auth"] == HOOK_SECRET


@pytest.mark.parametrize("key", ["executionId", "execution_id"])
def test_n8n_sync_execution_id_means_running(mock, session, key):
    mock.post(HOOK, json={key: 77})
    out = get_connector("n8n").trigger(n8n_call(), session)
    assert out == Running({"execution_id": "77"}, {"execution_id": "77"})


def test_n8n_sync_execution_id_without_api_url_is_fatal(mock, session):
    mock.post(HOOK, json={"executionId": "77"})
    stage = call({"type": "n8n", "url": HOOK})
    err = raises(F, lambda: get_connector("n8n").trigger(stage, session))
    assert "api_url" in err.message and err.platform_ids == {"execution_id": "77"}


def test_n8n_sync_but_webhook_responds_immediately_is_fatal(mock, session):
    mock.post(HOOK, json={"message": "Workflow was started"})
    err = raises(F, lambda: get_connector("n8n").trigger(n8n_call(), session))
    assert "callback" in err.message


def test_n8n_callback_started_is_accepted(mock, session):
    mock.post(HOOK, json={"message": "Workflow was started"})
    assert get_connector("n8n").trigger(n8n_call(mode="callback"), session) == Accepted({})


def test_n8n_basic_auth(mock, session):
    mock.post(HOOK, json={"status": "succeeded", "output": 1})
    stage = call({"type": "n8n", "url": HOOK, "auth": "basic", "auth_secret": "HOOK"},
                 {"auth_secret": "bob:pa55word"})
    get_connector("n8n").trigger(stage, session)
    assert mock.calls[0].request.headers["Authorization"] == "Basic Ym9iOnBhNTV3b3Jk"


def test_n8n_basic_auth_secret_without_colon_is_fatal_without_echo(session):
    stage = call({"type": "n8n", "url": HOOK, "auth": "basic", "auth_secret": "HOOK"},
                 {"auth_secret": "s3cr3tpw"})
    raises(F, lambda: get_connector("n8n").trigger(stage, session), "s3cr3tpw")


# ---- n8n executions API ----

def execution(status, last=None, json_item=None, error=None):
    result = {"runData": {}}
    if last:
        result = {"lastNodeExecuted": last, "runData": {last: [{"data": {"main": [[{"json": {"old": 1}}]]}},
                                                               {"data": {"main": [[{"json": json_item}]]}}]}}
    if error:
        result["error"] = error
    return {"id": "77", "finished": status == "success", "status": status, "data": {"resultData": result}}


def n8n_poll(session):
    return get_connector("n8n").poll(n8n_call(), {"execution_id": "77"}, session)


def test_n8n_poll_success_reads_the_last_nodes_first_item(mock, session):
    mock.get(N8N_API, json=execution("success", "Answer", {"status": "succeeded", "output": [1, 2]}))
    out = n8n_poll(session)
    assert out == Done(out.answer, {"execution_id": "77"}) and out.answer.output == [1, 2]
    assert mock.calls[0].request.headers["X-N8N-API-KEY"] == N8N_API_KEY


def test_n8n_poll_success_plain_json_is_the_output(mock, session):
    mock.get(N8N_API, json=execution("success", "Set", {"count": 3, "next_cursor": 10}))
    answer = n8n_poll(session).answer
    assert answer.output == {"count": 3, "next_cursor": 10} and answer.next_cursor == 10


def test_n8n_poll_success_without_saved_data_is_fatal(mock, session):
    mock.get(N8N_API, json={"id": "77", "status": "success", "data": {}})
    assert "save data of successful executions" in raises(F, lambda: n8n_poll(session)).message


@pytest.mark.parametrize("status", ["new", "running", "waiting"])
def test_n8n_poll_running(mock, session, status):
    mock.get(N8N_API, json=execution(status))
    assert n8n_poll(session) == Running({"execution_id": "77"}, {"execution_id": "77"})


@pytest.mark.parametrize("status, retry", [("error", IDEM), ("crashed", IDEM), ("canceled", F),
                                           ("unknown", F)])
def test_n8n_poll_failures(mock, session, status, retry):
    error = {"message": f"boom with key {N8N_API_KEY}", "node": {"name": "Code"}}
    mock.get(N8N_API, json=execution(status, error=error))
    err = raises(retry, lambda: n8n_poll(session), N8N_API_KEY)
    assert err.platform_ids == {"execution_id": "77"} and status in err.message


@pytest.mark.parametrize("status, retry", [(401, F), (404, U), (429, R), (503, R)])
def test_n8n_poll_http_errors(mock, session, status, retry):
    mock.get(N8N_API, status=status, json={"message": "x"})
    assert raises(retry, lambda: n8n_poll(session)).platform_ids == {"execution_id": "77"}


# ---- dify ----

def dify_run(status, outputs=None, error=None, run_id="r-1"):
    return {"workflow_run_id": run_id, "task_id": "t-1",
            "data": {"id": run_id, "workflow_id": "w", "status": status, "outputs": outputs, "error": error}}


DIFY_IDS = {"workflow_run_id": "r-1", "task_id": "t-1"}


def dify_trigger(session, **target):
    return get_connector("dify").trigger(dify_call(**target), session)


def test_dify_succeeded_plain_outputs(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", json=dify_run("succeeded", {"count": 3, "next_cursor": "n"}))
    out = dify_trigger(session)
    assert out.platform_ids == DIFY_IDS
    assert out.answer.output == {"count": 3, "next_cursor": "n"} and out.answer.next_cursor == "n"


def test_dify_succeeded_contract_outputs(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", json=dify_run("succeeded", {"status": "failed",
                                                                        "error": {"message": "row 2"}}))
    answer = dify_trigger(session).answer
    assert not answer.succeeded and answer.error_message == "row 2"


def test_dify_contract_outputs_that_break_it_are_fatal(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", json=dify_run("succeeded", {"status": "done"}))
    err = raises(F, lambda: dify_trigger(session))
    assert err.message.startswith("answer does not follow the contract") and err.platform_ids == DIFY_IDS


@pytest.mark.parametrize("status, retry", [("failed", IDEM), ("stopped", F), ("weird", F)])
def test_dify_http_200_with_a_failed_status(mock, session, status, retry):
    mock.post(f"{DIFY}/v1/workflows/run", json=dify_run(status, error=f"LLM failed; key {DIFY_KEY}"))
    err = raises(retry, lambda: dify_trigger(session), DIFY_KEY)
    assert err.platform_ids == DIFY_IDS
    if status == "failed":
        assert "LLM failed" in err.message


def test_dify_running_status(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", json=dify_run("running"))
    assert dify_trigger(session) == Running({"run_id": "r-1"}, DIFY_IDS)


def test_dify_paused_run_waits_for_a_human_and_is_fatal(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", json=dify_run("paused"))
    mock.get(f"{DIFY}/v1/workflows/run/r-1", json={"id": "r-1", "status": "paused"})
    err = raises(F, lambda: dify_trigger(session))
    assert "waiting for a person" in err.message and err.code == "waiting_human"
    err = raises(F, lambda: get_connector("dify").poll(dify_call(), {"run_id": "r-1"}, session))
    assert "human-input" in err.message and err.platform_ids == {"workflow_run_id": "r-1"}
    assert err.code == "waiting_human"


@pytest.mark.parametrize("status, code, retry", [
    (400, "invalid_param", F), (400, "app_unavailable", F), (400, "provider_not_initialize", F),
    (400, "provider_quota_exceeded", F), (400, "model_currently_not_support", F),
    (404, "workflow_not_found", F), (400, "draft_workflow_error", F), (400, "workflow_id_format_error", F),
    (400, "bad_request", F), (404, "not_found", F), (403, "workflow_version_execution_not_allowed", F),
    (400, "completion_request_error", IDEM),
    (400, "workflow_request_error", IDEM), (429, "too_many_requests", R), (429, "rate_limit_error", R),
    (500, "internal_server_error", U), (401, "unauthorized", F), (403, "forbidden", F), (502, None, U),
    (503, None, U), (504, None, U),
])
def test_dify_error_codes(mock, session, status, code, retry):
    body = {"code": code, "message": f"msg with {DIFY_KEY}", "status": status} if code else None
    mock.post(f"{DIFY}/v1/workflows/run", status=status, json=body, headers={"Retry-After": "4"})
    err = raises(retry, lambda: dify_trigger(session), DIFY_KEY)
    assert err.status == status and err.code == code and err.outage is (status in (429, 503))
    assert err.retry_after_s == (4.0 if status in (429, 503) else None)
    assert err.handle is None  # a blocking call gives no run id before its end


@pytest.mark.parametrize("code, message, fragment", [
    ("invalid_param", "Workflow not published", "publish the app"),
    ("workflow_version_execution_not_allowed", "Workflow version execution is unavailable",
     "paid Dify Cloud plan"),
])
def test_dify_configuration_errors_say_what_to_do(mock, session, code, message, fragment):
    status = 403 if code.startswith("workflow_version") else 400
    mock.post(f"{DIFY}/v1/workflows/{WORKFLOW_UUID}/run", status=status,
              json={"code": code, "message": message, "status": status})
    assert fragment in raises(F, lambda: dify_trigger(session, workflow_id=WORKFLOW_UUID)).message


def test_dify_429_without_retry_after_leaves_the_wait_to_the_gateway(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", status=429,
              json={"code": "too_many_requests", "message": "Too many requests", "status": 429})
    err = raises(R, lambda: dify_trigger(session))
    assert err.outage and err.retry_after_s is None and "no Retry-After" in err.message


def sse(*events):
    return "".join(f"data: {json.dumps(e)}\n\n" if isinstance(e, dict) else e for e in events)


STARTED = {"event": "workflow_started", "task_id": "t-1", "workflow_run_id": "r-1", "data": {"id": "r-1"}}


def test_dify_stream_that_ends_after_workflow_started_without_finishing_is_polled(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", body=sse("event: ping\n\n", STARTED, {"event": "node_started"}),
              content_type="text/event-stream")
    assert dify_trigger(session, mode="streaming") == Running({"run_id": "r-1"}, DIFY_IDS)
    assert json.loads(mock.calls[0].request.body)["response_mode"] == "streaming"


def test_dify_streaming_finished_first_is_done(mock, session):
    finished = {"event": "workflow_finished", "task_id": "t-1", "workflow_run_id": "r-1",
                "data": {"id": "r-1", "status": "succeeded", "outputs": {"count": 2}}}
    mock.post(f"{DIFY}/v1/workflows/run", body=sse(finished), content_type="text/event-stream")
    out = dify_trigger(session, mode="streaming")
    assert out.answer.output == {"count": 2} and out.platform_ids == DIFY_IDS


def test_dify_streaming_reads_crlf_frames_split_over_reads(mock, session):
    finished = {"event": "workflow_finished", "workflow_run_id": "r-1",
                "data": {"id": "r-1", "status": "succeeded", "outputs": {"text": "x" * 50_000}}}
    body = "event: ping\r\n\r\n" + sse(finished).replace("\n", "\r\n")
    mock.post(f"{DIFY}/v1/workflows/run", body=body, content_type="text/event-stream")
    assert dify_trigger(session, mode="streaming").answer.output == {"text": "x" * 50_000}


@pytest.mark.parametrize("code, status, retry", [
    ("rate_limit_error", 429, R), ("workflow_request_error", 400, IDEM), ("invalid_param", 400, F),
    ("mystery", None, IDEM), ("mystery", 503, U), ("completion_request_error", 400, IDEM),
])
def test_dify_streaming_error_frame_is_classified_by_code(mock, session, code, status, retry):
    frame = {"event": "error", "task_id": "t-1", "code": code, "status": status, "message": "bad"}
    mock.post(f"{DIFY}/v1/workflows/run", body=sse(frame), content_type="text/event-stream")
    err = raises(retry, lambda: dify_trigger(session, mode="streaming"))
    assert err.code == code and err.platform_ids == {"task_id": "t-1"}


def test_dify_streaming_that_ends_before_workflow_started_is_unknown(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", body="event: ping\n\n", content_type="text/event-stream")
    err = raises(U, lambda: dify_trigger(session, mode="streaming"))
    assert err.handle is None and "before workflow_started" in err.message


@pytest.mark.parametrize("code, status, retry", [
    ("internal_server_error", 500, IDEM), ("completion_request_error", 400, IDEM),
    ("too_many_requests", 429, IDEM), (None, None, IDEM), ("provider_not_initialize", 400, F)])
def test_dify_streaming_error_frame_after_workflow_started_ends_the_run(mock, session, code, status, retry):
    """Dify never finalizes a run that sent an error frame (its record stays running): no handle, no poll;
    the run ran and failed, so it is retried only for an idempotent stage."""
    frame = {"event": "error", "task_id": "t-1", "workflow_run_id": "r-1", "code": code,
             "status": status, "message": "boom"}
    mock.post(f"{DIFY}/v1/workflows/run", body=sse(STARTED, frame), content_type="text/event-stream")
    err = raises(retry, lambda: dify_trigger(session, mode="streaming"))
    assert err.handle is None and err.outage is False and err.platform_ids == DIFY_IDS
    assert "boom" in err.message and "r-1" in err.message


@pytest.mark.parametrize("event", ["workflow_paused", "human_input_required"])
def test_dify_streaming_pause_for_a_human_is_fatal(mock, session, event):
    mock.post(f"{DIFY}/v1/workflows/run", body=sse(STARTED, {"event": event, "workflow_run_id": "r-1"}),
              content_type="text/event-stream")
    err = raises(F, lambda: dify_trigger(session, mode="streaming"))
    assert "waiting for a person" in err.message and err.code == "waiting_human"


def test_dify_streaming_http_error_is_classified(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", status=400, json={"code": "invalid_param", "message": "x"})
    raises(F, lambda: dify_trigger(session, mode="streaming"))


def test_dify_poll(mock, session):
    mock.get(f"{DIFY}/v1/workflows/run/r-1", json={"id": "r-1", "status": "succeeded", "outputs": {"n": 1}})
    mock.get(f"{DIFY}/v1/workflows/run/r-1", json={"id": "r-1", "status": "failed", "error": "node X"})
    mock.get(f"{DIFY}/v1/workflows/run/r-1", status=404, json={"code": "not_found", "message": "gone"})
    connector = get_connector("dify")
    assert connector.poll(dify_call(), {"run_id": "r-1"}, session).answer.output == {"n": 1}
    assert "node X" in raises(IDEM, lambda: connector.poll(dify_call(), {"run_id": "r-1"}, session)).message
    err = raises(F, lambda: connector.poll(dify_call(), {"run_id": "r-1"}, session))
    assert err.platform_ids == {"workflow_run_id": "r-1"}
    assert mock.calls[0].request.headers["Authorization"] == f"Bearer {DIFY_KEY}"


# ---- coze ----

COZE_RUN = f"{COZE}/v1/workflow/run"
LOG = {"X-Tt-Logid": "log-123"}


def coze_trigger(session, **target):
    return get_connector("coze").trigger(coze_call(**target), session)


@pytest.mark.parametrize("data, output, cursor", [
    (json.dumps({"status": "succeeded", "output": {"n": 1}, "next_cursor": 5}), {"n": 1}, 5),
    (json.dumps({"count": 3, "next_cursor": "c"}), {"count": 3, "next_cursor": "c"}, "c"),
    (json.dumps({"count": 3}), {"count": 3}, None),
    ("plain text answer", "plain text answer", None),
])
def test_coze_sync_data_is_a_json_string(mock, session, data, output, cursor):
    mock.post(COZE_RUN, json={"code": 0, "msg": "", "data": data, "debug_url": "https://dbg/1"}, headers=LOG)
    out = coze_trigger(session)
    assert out.answer.output == output and out.answer.next_cursor == cursor
    assert out.platform_ids == {"debug_url": "https://dbg/1", "log_id": "log-123"}


def test_coze_sync_contract_that_breaks_it_is_fatal(mock, session):
    mock.post(COZE_RUN, json={"code": 0, "data": json.dumps({"status": "ok"})}, headers=LOG)
    assert raises(F, lambda: coze_trigger(session)).platform_ids == {"log_id": "log-123"}


def test_coze_async_gives_an_execute_id(mock, session):
    mock.post(COZE_RUN, json={"code": 0, "execute_id": "e-9", "debug_url": "https://dbg/9"}, headers=LOG)
    out = coze_trigger(session, mode="async")
    assert out == Running({"execute_id": "e-9"}, {"execute_id": "e-9", "debug_url": "https://dbg/9",
                                                   "log_id": "log-123"})
    assert json.loads(mock.calls[0].request.body)["is_async"] is True


@pytest.mark.parametrize("http_status, code, retry", [
    (200, 4009, R), (200, 4013, R), (200, 4020, R), (200, 4102, R), (200, 5000, R),
    *[(200, code, F) for code in (4000, 4100, 4101, 4200, 4010, 4011, 4019, 4022, 4008, 4314, 4315, 6003,
                                  700012006, 6031, 6039)],
    (200, 6023, U), (200, 720701013, U),
    (200, 4999, F), (401, 4100, F), (429, 4020, R), (429, None, R), (500, 500, U), (502, None, U),
    (503, None, U),
])
def test_coze_codes(mock, session, http_status, code, retry):
    body = {"code": code, "msg": f"error about {COZE_TOKEN}", "detail": {"logid": "log-b"}} if code else None
    mock.post(COZE_RUN, status=http_status, json=body, headers={**LOG, "Retry-After": "6"})
    err = raises(retry, lambda: coze_trigger(session), COZE_TOKEN)
    assert err.platform_ids["log_id"] == "log-123"
    outage = http_status in (429, 503) or code in (4009, 4020, 4102)
    assert err.outage is outage
    assert err.retry_after_s == (6.0 if outage or retry is R else None)
    assert err.handle is None  # no execute_id, no debug_url
    if code:
        assert err.code == ("waiting_human" if code == 6039 else str(code)) and str(code) in err.message


STUDIO_DEBUG = "https://studio.example/work_flow?execute_id={}&space_id={}&workflow_id={}&execute_mode=2"


@pytest.mark.parametrize("code, debug_url, execute_id, retry, handle", [
    # Coze Studio builds a debug_url for every error; execute_id=0 when no run was created
    (6031, STUDIO_DEBUG.format(0, 0, 0), None, F, None),
    (4000, STUDIO_DEBUG.format(0, 0, 0), None, F, None),
    (4102, STUDIO_DEBUG.format(0, 0, 0), None, R, None),
    # a run was created: UNKNOWN, with the handle poll() takes
    (720701013, STUDIO_DEBUG.format(7551, 1, 73), None, U, {"execute_id": "7551"}),
    (6023, STUDIO_DEBUG.format(7552, 1, 73), None, U, {"execute_id": "7552"}),
    (777777776, STUDIO_DEBUG.format(7553, 1, 73), None, U, {"execute_id": "7553"}),
    (4013, STUDIO_DEBUG.format(7554, 1, 73), None, U, {"execute_id": "7554"}),
    (4013, None, "7555", U, {"execute_id": "7555"}),
    (5000, "https://www.coze.com/work_flow?space_id=1", None, U, None),
    # codes that rule a run out stay fatal whatever else the answer says
    (6039, STUDIO_DEBUG.format(7556, 1, 73), None, F, None),
])
def test_coze_run_evidence(mock, session, code, debug_url, execute_id, retry, handle):
    body = {"code": code, "msg": "failed", **({"debug_url": debug_url} if debug_url else {}),
            **({"execute_id": execute_id} if execute_id else {})}
    mock.post(COZE_RUN, json=body, headers=LOG)
    err = raises(retry, lambda: coze_trigger(session, studio=True))
    assert err.handle == handle
    if handle:
        assert err.platform_ids["execute_id"] == handle["execute_id"]


@pytest.mark.parametrize("body", [
    {"code": 0, "msg": "", "data": "", "debug_url": "https://dbg/1"},
    {"code": 0, "msg": "", "debug_url": "https://dbg/1"},
    {"code": 0, "msg": "", "data": "{}", "interrupt_data": {"event_id": "e/1", "type": 2}},
])
def test_coze_sync_run_waiting_for_input_is_fatal(mock, session, body):
    mock.post(COZE_RUN, json=body, headers=LOG)
    err = raises(F, lambda: coze_trigger(session))
    assert "waiting for a person" in err.message and err.code == "waiting_human"


def test_coze_6039_says_the_workflow_waits_for_input(mock, session):
    mock.post(COZE_RUN, json={"code": 6039, "msg": "Synchronous requests do not support interruption."})
    assert "question/input node" in raises(F, lambda: coze_trigger(session, studio=True)).message


@pytest.mark.parametrize("studio, field", [(False, "workflow_version"), (True, "version")])
def test_coze_version_field(mock, session, studio, field):
    mock.post(COZE_RUN, json={"code": 0, "data": json.dumps({"n": 1})})
    coze_trigger(session, studio=studio, workflow_version="v0.0.3")
    sent = json.loads(mock.calls[0].request.body)
    assert sent[field] == "v0.0.3" and ({"version", "workflow_version"} - {field}).isdisjoint(sent)


def test_coze_log_id_from_the_body_when_the_header_is_missing(mock, session):
    mock.post(COZE_RUN, json={"code": 4200, "msg": "x", "detail": {"logid": "log-b"}})
    assert raises(F, lambda: coze_trigger(session)).platform_ids == {"log_id": "log-b"}


def history(status, **record):
    return {"code": 0, "msg": "", "data": [{"execute_id": "e-9", "execute_status": status,
                                             "debug_url": "https://dbg/9", **record}]}


@pytest.mark.parametrize("studio, url", [
    (False, f"{COZE}/v1/workflows/73/run_histories/e-9"),
    (True, f"{COZE}/v1/workflow/get_run_history?workflow_id=73&execute_id=e-9"),
])
def test_coze_poll(mock, session, studio, url):
    # coze.com wraps the End node's JSON in {"Output": ...}; Coze Studio stores the variables as they are
    output = json.dumps({"count": 3})
    mock.get(url, json=history("Running"))
    mock.get(url, json=history("Success", output=output if studio else json.dumps({"Output": output})))
    mock.get(url, json=history("Fail", error_code="5000", error_message="node LLM failed"))
    mock.get(url, json={"code": 4314, "msg": "record not found"})
    stage, handle, connector = coze_call(studio=studio), {"execute_id": "e-9"}, get_connector("coze")
    ids = {"execute_id": "e-9", "debug_url": "https://dbg/9"}
    assert connector.poll(stage, handle, session) == Running(handle, ids)
    assert connector.poll(stage, handle, session).answer.output == {"count": 3}
    err = raises(IDEM, lambda: connector.poll(stage, handle, session))
    assert "node LLM failed" in err.message and err.platform_ids == ids
    raises(F, lambda: connector.poll(stage, handle, session))


def test_coze_studio_history_record(mock, session):
    url = f"{COZE}/v1/workflow/get_run_history?workflow_id=73&execute_id=e-9"
    mock.get(url, json=history("Fail", error_code="720701013", error_msg="Code node: division by zero"))
    mock.get(url, json=history("Cancel", error_code="777777777", error_msg="workflow cancel by user"))
    mock.get(url, json=history("<UNSET>"))
    stage, handle, connector = coze_call(studio=True), {"execute_id": "e-9"}, get_connector("coze")
    assert "division by zero" in raises(IDEM, lambda: connector.poll(stage, handle, session)).message
    assert "cancelled on Coze" in raises(F, lambda: connector.poll(stage, handle, session)).message
    err = raises(F, lambda: connector.poll(stage, handle, session))
    assert "waiting for a person" in err.message and err.code == "waiting_human"


# ---- end and waiting states (issue 15; docs/connectors-failure-modes.md "End and waiting states") ----

@pytest.mark.parametrize("kind, make, url", CONNECTORS + [("n8n", n8n_call, HOOK)])
@pytest.mark.parametrize("body, retry", [
    ("no healthy upstream", R),
    ("upstream connect error or disconnect/reset before headers. reset reason: connection failure", R),
    ("<html><head><title>503 Service Temporarily Unavailable</title></head><body><center><h1>503 Service "
     "Temporarily Unavailable</h1></center><hr><center>nginx</center></body></html>", R),
    ("upstream connect error or disconnect/reset before headers. reset reason: connection termination", U),
    ("Service Unavailable", U),
])
def test_a_503_is_not_delivered_only_when_a_proxy_says_it_never_passed_the_call_on(mock, session, kind, make,
                                                                                  url, body, retry):
    mock.post(url, status=503, body=body)
    err = raises(retry, lambda: get_connector(kind).trigger(make(), session))
    assert err.outage and err.status == 503
    if retry is R:
        assert "nothing ran" in err.message


def test_coze_sync_text_answer_envelope_is_unwrapped(mock, session):
    """coze-studio OpenAPIRun: an End node that answers text sends {"content_type", "data",
    "type_for_model"}; the answer is data."""
    envelope = {"content_type": 1, "data": json.dumps({"status": "succeeded", "output": {"n": 2}}),
                "type_for_model": 2}
    mock.post(f"{COZE}/v1/workflow/run", json={"code": 0, "msg": "", "data": json.dumps(envelope)})
    assert coze_trigger(session).answer.output == {"n": 2}


def test_coze_cloud_history_wrapper_with_other_keys_is_unwrapped_and_trimmed_output_refused(mock, session):
    url = f"{COZE}/v1/workflows/73/run_histories/e-9"
    wrapped = json.dumps({"Output": json.dumps({"count": 3}), "node_status": "{}"})
    mock.get(url, json=history("Success", output=wrapped, is_output_trimmed=False))
    mock.get(url, json=history("Success", output=json.dumps({"Output": '{"count": 3, "ro'}),
                               is_output_trimmed=True))
    stage, handle, connector = coze_call(), {"execute_id": "e-9"}, get_connector("coze")
    assert connector.poll(stage, handle, session).answer.output == {"count": 3}
    err = raises(F, lambda: connector.poll(stage, handle, session))
    assert err.code == "output_trimmed" and "e-9" in err.message


def waiting(wait_till, **extra):
    return {**execution("waiting", **extra), "waitTill": wait_till}


@pytest.mark.parametrize("wait_till, deadline, waits_for_person", [
    ("3000-01-01T00:00:00.000Z", None, True),  # WAIT_INDEFINITELY
    ("2999-12-31T00:00:00.000Z", 1e9, False),  # WAIT_FOR_SUB_EXECUTION: resumes when the child ends
    ("2030-01-01T00:00:00.000Z", 1.9e9, False),  # resumes before max_run ends
    ("2030-01-01T00:00:00.000Z", 1.8e9, True),  # resumes only after max_run
    ("2030-01-01T00:00:00.000Z", None, False),  # no deadline known: polled until max_run
    (None, 1e9, False),
])
def test_n8n_waiting_execution_is_running_unless_it_waits_past_max_run(mock, session, wait_till, deadline,
                                                                      waits_for_person):
    mock.get(N8N_API, json=waiting(wait_till))
    stage = n8n_call()
    stage = type(stage)(**{**stage.__dict__, "run_deadline_s": deadline})
    connector = get_connector("n8n")
    if not waits_for_person:
        assert connector.poll(stage, {"execution_id": "77"}, session).status == "waiting"
        return
    err = raises(F, lambda: connector.poll(stage, {"execution_id": "77"}, session))
    assert err.code == "waiting_human" and "execution 77" in err.message


def test_dify_workflow_paused_alone_carries_the_prompt_in_its_reasons(mock, session):
    paused = {"event": "workflow_paused", "workflow_run_id": "r-1", "data": {"reasons": [
        {"TYPE": "human_input_required", "form_content": "Is this invoice correct?", "node_title": "Check"}]}}
    mock.post(f"{DIFY}/v1/workflows/run", body=sse(STARTED, paused), content_type="text/event-stream")
    err = raises(F, lambda: dify_trigger(session, mode="streaming"))
    assert err.code == "waiting_human" and err.prompt == "Is this invoice correct?"
    assert "'Check'" in err.message and err.platform_ids["workflow_run_id"] == "r-1"
