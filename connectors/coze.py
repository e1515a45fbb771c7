"""Coze connector: run a workflow (sync or async) on coze.com / coze.cn or Coze Studio, poll async runs.

Target::

    {"type": "coze", "base_url": "https://api.coze.com", "token_secret": "<secret name>",
     "workflow_id": "<id>", "mode": "sync" | "async", "studio": false,
     "parameters": {"<variable>": "<envelope path>"}?, "bot_id"?, "app_id"?, "workflow_version"?}

Without ``parameters`` the workflow gets one parameter, ``batchgate``: the envelope as a JSON string. Coze
reports business errors as HTTP 200 with ``code != 0``, so ``code`` is read on every answer. A sync run's
``data`` is a JSON string of the end node's variables: the answer contract when it has ``status``, else the
plain output. ``studio`` selects Coze Studio's run-history endpoint for polling.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import requests

from connectors.base import (
    Answer,
    Done,
    Outcome,
    PlatformError,
    Retry,
    Running,
    StageCall,
    classify_http,
    map_fields,
    retry_after_s,
)
from connectors.targets import TargetChecker, checked
from connectors.transport import (
    answer_from_value,
    clip,
    dig,
    ids,
    json_body,
    parse_json_text,
    require_secret,
    send,
)

PLATFORM = "coze"
FIELDS = ("base_url", "token_secret", "workflow_id", "mode", "studio", "parameters", "bot_id", "app_id",
          "workflow_version")
RETRYABLE_CODES = frozenset({4009, 4013, 4020, 5000})
FATAL_CODES = frozenset({4000, 4100, 4101, 4200, 4010, 4011, 4019, 4022, 4008, 4314, 4315, 6003, 700012006})
CODE_HINTS = {
    4008: " (daily limit reached: runs can resume tomorrow)",
    4100: " (the token is invalid or expired)",
    4200: " (is the workflow published?)",
    6003: " (async runs need a paid Coze plan: use mode sync)",
    700012006: " (Coze Studio rejected the token)",
}


@dataclass(frozen=True)
class CozeAssumptions:
    """Coze behaviour the contracts file marks UNVERIFIED, or no source confirms; change it only here.

    The throttle status code is unverified: HTTP 429 and 5xx are retryable by status, and codes 4009/4020
    are retryable whatever the status they come with.
    """

    unknown_code_retry: Retry = Retry.FATAL
    """Class of a nonzero code outside the contracts file's lists, on a 2xx answer."""
    history_output_wrapper: str | None = "Output"
    """A run-history ``output`` of the form ``{"Output": "<json>"}`` is unwrapped to that inner JSON."""
    log_id_header: str = "X-Tt-Logid"


UNVERIFIED = CozeAssumptions()


def validate_target(target: dict[str, Any]) -> dict[str, Any]:
    """Check a Coze target and fill its defaults.

    Defaults: ``base_url`` https://api.coze.com (a trailing ``/`` or ``/v1`` is dropped), ``mode`` sync,
    ``studio`` false. ``token_secret`` and ``workflow_id`` are required (a numeric id is kept as a string);
    ``bot_id`` and ``app_id`` exclude each other.

    Raises:
        ValueError: naming the field at fault.
    """
    check = TargetChecker(target, "coze", FIELDS)
    check.api_base("base_url", "https://api.coze.com")
    check.secret_name("token_secret", required=True, what="Coze access token")
    check.string("workflow_id", required=True)
    check.choice("mode", ("sync", "async"), "sync")
    check.flag("studio", False)
    check.mapping("parameters")
    if check.string("bot_id") and check.string("app_id"):
        raise check.fail("bot_id and app_id exclude each other: give at most one")
    check.string("app_id")
    check.string("workflow_version")
    return check.result


class CozeConnector:
    """Coze workflows through the OpenAPI (``/v1/workflow/run``)."""

    def trigger(self, call: StageCall, session: requests.Session) -> Outcome:
        """Run the workflow: sync answers are parsed, async ones give an execute_id to poll."""
        target = checked(validate_target, call.target)
        payload = {
            "workflow_id": target["workflow_id"],
            "parameters": map_fields(target.get("parameters"), call.envelope,
                                     default={"batchgate": json.dumps(call.envelope, ensure_ascii=False)}),
            "is_async": target["mode"] == "async",
        }
        payload.update({k: target[k] for k in ("bot_id", "app_id", "workflow_version") if target.get(k)})
        resp = send(call, session, "POST", f"{target['base_url']}/v1/workflow/run", platform=PLATFORM,
                    payload=payload, auth=_auth(call))
        body, pids = _checked_body(resp, call)
        if target["mode"] == "sync":
            return Done(_answer(body.get("data"), pids), pids)
        if not pids.get("execute_id"):
            raise PlatformError("coze accepted the async run without an execute_id", Retry.FATAL,
                                platform_ids=pids)
        return Running({"execute_id": pids["execute_id"]}, pids)

    def poll(self, call: StageCall, handle: dict[str, Any], session: requests.Session) -> Outcome:
        """Read an async run's history: Running, Success -> Done, Fail -> IF_IDEMPOTENT error."""
        target = checked(validate_target, call.target)
        execute_id = str(handle.get("execute_id") or "")
        if not execute_id:
            raise PlatformError("coze: the poll handle has no execute_id", Retry.FATAL)
        resp = send(call, session, "GET", _history_url(target, execute_id), platform=PLATFORM,
                    auth=_auth(call), platform_ids=ids(execute_id=execute_id))
        body, pids = _checked_body(resp, call, execute_id)
        record = dig(body, "data", 0)
        if not isinstance(record, dict):
            raise PlatformError(f"coze run history has no record of execute_id {execute_id}", Retry.FATAL,
                                platform_ids=pids)
        pids.update(ids(debug_url=record.get("debug_url")))
        return _record_outcome(record, handle, call, pids)


def _auth(call: StageCall) -> dict[str, str]:
    return {"Authorization": f"Bearer {require_secret(call, 'token_secret', PLATFORM)}"}


def _history_url(target: dict[str, Any], execute_id: str) -> str:
    base, workflow_id = target["base_url"], target["workflow_id"]
    if target["studio"]:
        query = urlencode({"workflow_id": workflow_id, "execute_id": execute_id})
        return f"{base}/v1/workflow/get_run_history?{query}"
    return f"{base}/v1/workflows/{quote(workflow_id, safe='')}/run_histories/{quote(execute_id, safe='')}"


def _checked_body(resp: requests.Response, call: StageCall,
                  execute_id: str | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """The answer's JSON object and platform ids; an HTTP error or a nonzero ``code`` raises."""
    body = json_body(resp)
    body = body if isinstance(body, dict) else {}
    pids = ids(execute_id=body.get("execute_id") or execute_id, debug_url=body.get("debug_url"),
               log_id=resp.headers.get(UNVERIFIED.log_id_header) or dig(body, "detail", "logid"))
    code = _code(body.get("code"))
    if resp.ok and code == 0:
        return body, pids
    raise _code_error(resp, body, code, call, pids)


def _code(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _code_error(resp: requests.Response, body: dict[str, Any], code: int | None, call: StageCall,
                pids: dict[str, str]) -> PlatformError:
    """Classify a failed answer: listed codes first, then the HTTP status, then unknown codes."""
    if code in RETRYABLE_CODES:
        retry = Retry.RETRYABLE
    elif code in FATAL_CODES:
        retry = Retry.FATAL
    elif not resp.ok:
        retry = classify_http(resp)
    else:
        retry = UNVERIFIED.unknown_code_retry
    message = clip(body.get("msg") or body.get("message") or (resp.text if not body else "") or "no message",
                   call)
    if code is None:
        text = f"coze answered HTTP {resp.status_code} without a code: {message}"
    else:
        where = "" if resp.ok else f" (HTTP {resp.status_code})"
        text = f"coze code {code}{where}: {message}{CODE_HINTS.get(code, '')}"
    return PlatformError(text, retry,
                         retry_after_s=retry_after_s(resp) if retry is Retry.RETRYABLE else None,
                         status=resp.status_code, code=None if code is None else str(code), platform_ids=pids)


def _record_outcome(record: dict[str, Any], handle: dict[str, Any], call: StageCall,
                    pids: dict[str, str]) -> Outcome:
    status = str(record.get("execute_status") or "")
    name = f"coze run {pids.get('execute_id')}"
    if status.lower() == "running":
        return Running(dict(handle), pids)
    if status.lower() == "success":
        return Done(_answer(record.get("output"), pids, history=True), pids)
    if status.lower() == "fail":
        code = record.get("error_code")
        detail = clip(record.get("error_message") or "no error message", call)
        raise PlatformError(f"{name} failed{f' (error code {code})' if code else ''}: {detail}",
                            Retry.IF_IDEMPOTENT, code=str(code) if code else None, platform_ids=pids)
    raise PlatformError(f"{name} has execute_status {clip(status)!r}, which batchgate does not handle",
                        Retry.FATAL, platform_ids=pids)


def _answer(output: Any, pids: dict[str, str], history: bool = False) -> Answer:
    """An answer from Coze's JSON-string output: the contract when it has ``status``, else plain output."""
    value = parse_json_text(output)
    wrapper = UNVERIFIED.history_output_wrapper
    if history and wrapper and isinstance(value, dict) and set(value) == {wrapper}:
        value = parse_json_text(value[wrapper])
    return answer_from_value(value, pids)
