"""What connectors send (bodies, input mapping, signed headers) and how targets are validated."""

from __future__ import annotations

import json

import pytest

import connectors
from connectors import get_connector, validate_target
from connectors.base import encode
from tests.connectors.helpers import (
    COZE_TOKEN,
    DIFY_KEY,
    N8N_API_KEY,
    assert_signed,
    call,
    envelope,
    sent_json,
)

DIFY = "https://dify.example"
COZE = "https://coze.example"
WORKFLOW_UUID = "5f0c9a2e-3b1d-4c55-9a57-0d7e1f2a3b4c"
COZE_MIN = {"type": "coze", "token_secret": "T", "workflow_id": "1"}


# ---- request bodies and signatures ----

def test_http_sends_the_envelope_signed(mock, session):
    mock.put("https://flow.example/run", json={"status": "succeeded", "output": None})
    stage = call({"type": "http", "url": "https://flow.example/run", "method": "put"})
    get_connector("http").trigger(stage, session)
    request = mock.calls[0].request
    assert request.body == encode(envelope())
    assert_signed(request.headers, request.body, stage)


def test_n8n_sends_the_envelope_and_signs_polls(mock, session):
    mock.post("https://n8n.example/webhook/b", json={"executionId": "8"})
    mock.get("https://n8n.example/api/v1/executions/8?includeData=true",
             json={"id": "8", "status": "running"})
    stage = call({"type": "n8n", "url": "https://n8n.example/webhook/b",
                  "api_url": "https://n8n.example/api/v1/", "api_key_secret": "N8N"},
                 {"api_key_secret": N8N_API_KEY})
    handle = get_connector("n8n").trigger(stage, session).handle
    get_connector("n8n").poll(stage, handle, session)
    trigger, poll = (c.request for c in mock.calls)
    assert sent_json(trigger.body) == envelope()  # a flow reads {{ $json.body.items }}
    assert_signed(trigger.headers, trigger.body, stage)
    assert_signed(poll.headers, poll.body, stage)


def test_dify_default_inputs_carry_the_envelope_as_json(mock, session):
    mock.post(f"{DIFY}/v1/workflows/run", json={"data": {"id": "r", "status": "running"}})
    stage = call({"type": "dify", "base_url": f"{DIFY}/v1/", "api_key_secret": "K"},
                 {"api_key_secret": DIFY_KEY})
    get_connector("dify").trigger(stage, session)
    request = mock.calls[0].request
    body = sent_json(request.body)
    assert json.loads(body["inputs"]["batchgate"]) == envelope()
    assert body["response_mode"] == "blocking" and body["user"] == "batchgate"
    assert request.headers["Authorization"] == f"Bearer {DIFY_KEY}"
    assert_signed(request.headers, request.body, stage)


def test_dify_custom_inputs_and_pinned_version(mock, session):
    mock.post(f"{DIFY}/v1/workflows/{WORKFLOW_UUID}/run", json={"data": {"id": "r", "status": "running"}})
    mock.get(f"{DIFY}/v1/workflows/run/r", json={"id": "r", "status": "running"})
    stage = call({"type": "dify", "base_url": DIFY, "api_key_secret": "K", "workflow_id": WORKFLOW_UUID,
                  "user": "ops", "inputs": {"resumes": "items", "title": "params.title", "all": "$json",
                                            "none": "params.missing"}},
                 {"api_key_secret": DIFY_KEY})
    handle = get_connector("dify").trigger(stage, session).handle
    get_connector("dify").poll(stage, handle, session)
    body = sent_json(mock.calls[0].request.body)
    assert body["inputs"] == {"resumes": envelope()["items"], "title": "Data engineer",
                              "all": json.dumps(envelope(), ensure_ascii=False), "none": None}
    assert body["user"] == "ops"
    assert_signed(mock.calls[1].request.headers, mock.calls[1].request.body, stage)


def test_coze_default_and_custom_parameters(mock, session):
    mock.post(f"{COZE}/v1/workflow/run", json={"code": 0, "data": "{}"})
    mock.post(f"{COZE}/v1/workflow/run", json={"code": 0, "data": "{}"})
    base = {"type": "coze", "base_url": COZE, "token_secret": "T", "workflow_id": 7391}
    default = call(base, {"token_secret": COZE_TOKEN})
    custom = call({**base, "parameters": {"rows": "items", "job": "job_id"}, "app_id": "a1",
                   "workflow_version": "v0.0.3"}, {"token_secret": COZE_TOKEN})
    get_connector("coze").trigger(default, session)
    get_connector("coze").trigger(custom, session)
    first, second = (sent_json(c.request.body) for c in mock.calls)
    assert first == {"workflow_id": "7391", "is_async": False,
                     "parameters": {"batchgate": json.dumps(envelope(), ensure_ascii=False)}}
    assert second == {"workflow_id": "7391", "is_async": False, "app_id": "a1", "workflow_version": "v0.0.3",
                      "parameters": {"rows": envelope()["items"], "job": "job_1"}}
    assert mock.calls[0].request.headers["Authorization"] == f"Bearer {COZE_TOKEN}"
    assert_signed(mock.calls[1].request.headers, mock.calls[1].request.body, custom)


def test_timeout_is_the_calls(mock, session, monkeypatch):
    seen = {}
    original = session.request

    def spy(*args, **kwargs):
        seen.update(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(session, "request", spy)
    mock.post("https://flow.example/run", json={"status": "succeeded"})
    get_connector("http").trigger(call({"type": "http", "url": "https://flow.example/run"}, timeout_s=12.5),
                                  session)
    assert seen["timeout"] == 12.5 and isinstance(seen["data"], bytes)


# ---- targets ----

def test_defaults_are_filled_without_touching_the_input():
    target = {"type": "n8n", "url": "https://n8n.example/webhook/b", "auth_secret": "HOOK"}
    checked = validate_target(target)
    assert target == {"type": "n8n", "url": "https://n8n.example/webhook/b", "auth_secret": "HOOK"}
    assert checked == {**target, "method": "POST", "mode": "sync", "auth": "header",
                       "auth_header": "X-N8N-Auth"}
    assert validate_target({"type": "http", "url": "https://x.example/a"}) == {
        "type": "http", "url": "https://x.example/a", "method": "POST", "mode": "sync", "headers": {},
        "auth_header": "Authorization", "auth_scheme": "Bearer"}
    assert validate_target({"type": "dify", "api_key_secret": "K"}) == {
        "type": "dify", "base_url": "https://api.dify.ai", "api_key_secret": "K", "mode": "blocking",
        "user": "batchgate"}
    assert validate_target({"type": "coze", "token_secret": "T", "workflow_id": "1"}) == {
        "type": "coze", "base_url": "https://api.coze.com", "token_secret": "T", "workflow_id": "1",
        "mode": "sync", "studio": False}


def test_gateway_fields_are_kept():
    target = {"type": "http", "url": "https://x.example/a", "mode": "callback", "max_in_flight": 4}
    assert validate_target(target)["max_in_flight"] == 4


def test_validated_targets_validate_again_unchanged():
    for target in ({"type": "n8n", "url": "https://n/webhook/b", "api_url": "https://n/api/v1",
                    "api_key_secret": "K"},
                   {"type": "dify", "base_url": "https://d.example/v1/", "api_key_secret": "K"}):
        once = validate_target(target)
        assert validate_target(once) == once


@pytest.mark.parametrize("target, fragment", [
    ("nope", "target must be an object"),
    ({"url": "https://x"}, "known types: coze, dify, http, n8n"),
    ({"type": "zapier"}, "unknown target type 'zapier'; known types: coze, dify, http, n8n"),
    ({"type": "http"}, "http target: url is required"),
    ({"type": "http", "url": "ftp://x/y"}, "url must be an absolute http(s) URL"),
    ({"type": "http", "url": "https://u:p@x/y"}, "url must not carry credentials"),
    ({"type": "http", "url": "https://x/y", "method": "GET"}, "method must be one of POST, PUT, PATCH"),
    ({"type": "http", "url": "https://x/y", "mode": "async"}, "mode must be one of sync, callback"),
    ({"type": "http", "url": "https://x/y", "headers": {"X": 1}}, "headers must be an object"),
    ({"type": "http", "url": "https://x/y", "token": "abc"}, "unknown field(s) token; known fields:"),
    ({"type": "http", "url": "https://x/y", "max_in_flight": 0}, "max_in_flight must be a whole number"),
    ({"type": "http", "url": "https://x/y", "max_in_flight": "4"}, "max_in_flight must be a whole number"),
    ({"type": "http", "url": "https://x/y", "auth_secret": "has space"}, "auth_secret must be a secret name"),
    ({"type": "n8n", "url": "https://x/y", "auth": "basic"}, "auth basic needs auth_secret"),
    ({"type": "n8n", "url": "https://x/y", "auth": "none", "auth_secret": "S"}, "auth_secret is set but"),
    ({"type": "n8n", "url": "https://x/y", "auth": "jwt", "auth_secret": "S"}, "auth must be one of"),
    ({"type": "n8n", "url": "https://x/y", "api_url": "https://x"}, "api_url needs api_key_secret"),
    ({"type": "n8n", "url": "https://x/y", "api_key_secret": "K"}, "api_key_secret needs api_url"),
    ({"type": "dify"}, "dify target: api_key_secret is required"),
    ({"type": "dify", "api_key_secret": "K", "mode": "sync"}, "mode must be one of blocking, streaming"),
    ({"type": "dify", "api_key_secret": "K", "workflow_id": "v2"}, "workflow_id must be the UUID"),
    ({"type": "dify", "api_key_secret": "K", "inputs": ["items"]}, "inputs must be a non-empty object"),
    ({"type": "dify", "api_key_secret": "K", "inputs": {"a": ""}}, "inputs.a must be a non-empty"),
    ({"type": "dify", "api_key_secret": "K", "user": 5.5}, "user must be a string"),
    ({"type": "coze", "workflow_id": "1"}, "coze target: token_secret is required"),
    ({"type": "coze", "token_secret": "T"}, "coze target: workflow_id is required"),
    ({**COZE_MIN, "bot_id": "b", "app_id": "a"}, "bot_id and app_id exclude each other"),
    ({**COZE_MIN, "studio": "yes"}, "studio must be true or false"),
    ({**COZE_MIN, "mode": "streaming"}, "mode must be one of sync, async, stream"),
])
def test_invalid_targets(target, fragment):
    with pytest.raises(ValueError) as info:
        validate_target(target)
    assert fragment in str(info.value)


@pytest.mark.parametrize("target", [
    {"type": "dify", "api_key_secret": DIFY_KEY},
    {"type": "coze", "token_secret": COZE_TOKEN, "workflow_id": "1"},
    {"type": "n8n", "url": "https://x/y", "api_url": "https://x", "api_key_secret": "eyJhbGciOiJIUzI1.x.y"},
])
def test_a_secret_value_in_a_secret_name_field_is_refused_without_echo(target):
    with pytest.raises(ValueError) as info:
        validate_target(target)
    assert "looks like" in str(info.value)
    for value in (DIFY_KEY, COZE_TOKEN, "eyJ"):
        assert value not in str(info.value)


def test_an_invalid_target_at_call_time_is_fatal(session):
    from connectors.base import PlatformError, Retry

    with pytest.raises(PlatformError) as info:
        get_connector("dify").trigger(call({"type": "dify"}), session)
    assert info.value.retry is Retry.FATAL and "api_key_secret is required" in info.value.message


def test_registry():
    assert set(connectors.CONNECTORS) == {"http", "n8n", "dify", "coze"}
    assert get_connector("coze") is connectors.CONNECTORS["coze"]
    with pytest.raises(ValueError, match="known types: coze, dify, http, n8n"):
        get_connector("zapier")
