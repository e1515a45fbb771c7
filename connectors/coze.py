"""Coze connector: run a workflow (sync or async) on coze.com / coze.cn or Coze Studio, poll async runs.

Target::

    {"type": "coze", "base_url": "https://api.coze.com", "token_secret": "<secret name>",
     "workflow_id": "<id>", "mode": "sync" | "async" | "stream", "studio": false,
     "parameters": {"<variable>": "<envelope path>"}?, "bot_id"?, "app_id"?, "workflow_version"?}

Without ``parameters`` the workflow gets one parameter, ``batchgate``: the envelope as a JSON string. Coze
reports business errors as HTTP 200 with ``code != 0``, so ``code`` is read on every answer. A sync run's
``data`` is a JSON string of the end node's variables: the answer contract when it has ``status``, else the
plain output. ``studio`` selects Coze Studio's run-history endpoint for polling and its request field
``version`` for ``workflow_version``.

A nonzero code that shows a run was created (an ``execute_id``, or a ``debug_url`` naming a nonzero
``execute_id``; Coze Studio puts ``execute_id=0`` in the debug_url of errors raised before any run) is
``UNKNOWN``, with ``handle={"execute_id"}`` for polling. Coze drops a sync call after about 90 s while the
run goes on: also ``UNKNOWN``. Outputs are unwrapped by Coze's own rules (coze.com run history's
``{"Output": ...}`` whatever other keys ride along; a text-answer End node's ``{"content_type", "data",
"type_for_model"}``); a history record with ``is_output_trimmed`` is ``output_trimmed``, never committed; a
question/input node (6039, ``interrupt_data``, ``<UNSET>``) is ``waiting_human``. ``stream`` runs through
``/v1/workflow/stream_run``: the only mode whose interrupts name the event that a decision resumes
(connectors/coze_stream.py).
docs/connectors-failure-modes.md lists every failure and its class, with the sources.
"""

from __future__ import annotations

import dataclasses
import json
from contextlib import closing
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, urlencode

import requests

from connectors import coze_stream
from connectors.base import (
    WAITING_HUMAN,
    Answer,
    Decision,
    Done,
    Outcome,
    PlatformError,
    Retry,
    Running,
    StageCall,
    classify_http,
    is_outage,
    map_fields,
    never_forwarded,
    retry_after_s,
)
from connectors.coze_codes import FATAL_CODES, run_evidence
from connectors.targets import TargetChecker, checked
from connectors.transport import (
    answer_from_value,
    clip,
    dig,
    ids,
    json_body,
    output_trimmed,
    parse_json_text,
    require_secret,
    send,
    waiting_for_person,
)

PLATFORM = "coze"
FIELDS = ("base_url", "token_secret", "workflow_id", "mode", "studio", "parameters", "bot_id", "app_id",
          "workflow_version")
RETRYABLE_CODES = frozenset({4009, 4013, 4020, 4102, 5000})
OUTAGE_CODES = frozenset({4009, 4020, 4102})
"""Throttles (system cap, RPM, risk control "retry later"): the target refuses calls for a while."""
UNKNOWN_CODES = frozenset({6023, 720701013, 720702085})
"""Coze Studio: the run timed out (6023; 720702085 before its OpenAPI mapping) or failed in a node
(720701013): it ran, possibly with side effects, and may be known by polling its execute_id."""
WAITING_CODES = frozenset({6039})
CODE_HINTS = {
    4008: " (daily limit reached: runs can resume tomorrow)",
    4100: " (the token is invalid or expired)",
    4200: " (is the workflow published?)",
    6003: " (async runs need a paid Coze plan: use mode sync)",
    6031: " (publish the workflow in Coze Studio: the API runs the published version only)",
    700012006: " (Coze Studio rejected the token)",
}
QUESTION_NODE = "a question/input node"
WAITING_HINT = (": the run stays interrupted in Coze (its answer does not reach batchgate); remove the "
                "question/input node from the workflow batchgate calls")
TRIMMED_HINT = (" (Coze keeps at most about 1 MB of an End node's output in run history, and its "
                "execute_nodes API serves output nodes only, not the End node: return a smaller output, e.g. "
                "a reference to where the full result is stored)")
ANSWER_ENVELOPE = frozenset({"content_type", "data", "type_for_model"})
"""The wrapper of a sync run whose End node answers text rather than variables (coze-studio
``OpenAPIRun``: ``{"content_type": 1, "data": <output>, "type_for_model": 2}``): the answer is ``data``."""


@dataclass(frozen=True)
class CozeAssumptions:
    """Coze behaviour the contracts file marks UNVERIFIED, or no source confirms; change it only here.

    The throttle status code is unverified: HTTP 429 and 5xx are retryable by status, and codes 4009/4020
    are retryable whatever the status they come with.
    """

    unknown_code_retry: Retry = Retry.FATAL
    """Class of a nonzero code outside the contracts file's lists, on a 2xx answer."""
    history_output_wrapper: str | None = "Output"
    """coze.com's run-history ``output`` is an object whose ``Output`` holds the End node's JSON, beside
    other keys (``node_status``...): the answer is that inner JSON (coze-py tests/test_workflow_run_history.py
    ``{"Output":"null"}``). Coze Studio stores the End node's variables as they are (coze-studio
    event_handle.go ``setRootWorkflowSuccess``: ``mustMarshalToString(event.Output)``): not unwrapped."""
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
    check.choice("mode", ("sync", "async", "stream"), "sync")
    check.flag("studio", False)
    check.mapping("parameters")
    if check.string("bot_id") and check.string("app_id"):
        raise check.fail("bot_id and app_id exclude each other: give at most one")
    check.string("app_id")
    check.string("workflow_version")
    return check.result


def _version_field(target: dict[str, Any]) -> str:
    """Coze Studio's run request names the version ``version``; coze.com / coze.cn ``workflow_version``."""
    return "version" if target["studio"] else "workflow_version"


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
        payload.update({k: target[k] for k in ("bot_id", "app_id") if target.get(k)})
        if target.get("workflow_version"):
            payload[_version_field(target)] = target["workflow_version"]
        if target["mode"] == "stream":
            return _stream_run(call, session, target, payload)
        resp = send(call, session, "POST", f"{target['base_url']}/v1/workflow/run", platform=PLATFORM,
                    payload=payload, auth=_auth(call))
        body, pids = _checked_body(resp, call)
        if target["mode"] == "sync":
            return _sync_outcome(body, call, pids)
        if not pids.get("execute_id"):
            raise PlatformError("coze accepted the async run without an execute_id", Retry.FATAL,
                                platform_ids=pids)
        return Running({"execute_id": pids["execute_id"]}, pids)

    def resume(self, call: StageCall, handle: dict[str, Any], decision: Decision,
               session: requests.Session) -> Outcome:
        """Answer an interrupted streaming run's question, then read its stream (``coze_stream.resume``)."""
        target = checked(validate_target, call.target)
        return coze_stream.resume(call, handle, decision, session, target["base_url"], _auth(call),
                                  _stream_answer, _checked_body, self.poll)

    def poll(self, call: StageCall, handle: dict[str, Any], session: requests.Session) -> Outcome:
        """Read an async run's history: Running, Success -> Done, Fail -> IF_IDEMPOTENT error."""
        target = checked(validate_target, call.target)
        execute_id = str(handle.get("execute_id") or "")
        if not execute_id:
            raise PlatformError("coze: the poll handle has no execute_id", Retry.FATAL)
        resp = send(call, session, "GET", _history_url(target, execute_id), platform=PLATFORM,
                    auth=_auth(call), platform_ids=ids(execute_id=execute_id), poll=True)
        body, pids = _checked_body(resp, call, execute_id, poll=True)
        record = dig(body, "data", 0)
        if not isinstance(record, dict):
            raise PlatformError(f"coze run history has no record of execute_id {execute_id}", Retry.FATAL,
                                platform_ids=pids)
        pids.update(ids(debug_url=record.get("debug_url")))
        return _record_outcome(record, handle, call, pids, studio=target["studio"])


def _auth(call: StageCall) -> dict[str, str]:
    return {"Authorization": f"Bearer {require_secret(call, 'token_secret', PLATFORM)}"}


def _stream_run(call: StageCall, session: requests.Session, target: dict[str, Any],
                payload: dict[str, Any]) -> Outcome:
    """Run the workflow streaming its events (``coze_stream.read``); an error answers as JSON."""
    payload = {k: v for k, v in payload.items() if k != "is_async"}
    resp = send(call, session, "POST", f"{target['base_url']}/v1/workflow/stream_run", platform=PLATFORM,
                payload=payload, auth=_auth(call), stream=True)
    with closing(resp):
        if resp.ok and "json" not in resp.headers.get("Content-Type", ""):
            return coze_stream.read(resp, call, _stream_answer)
        _, pids = _checked_body(resp, call)
    raise PlatformError("coze answered a stream_run without an event stream", Retry.FATAL, platform_ids=pids)


def _stream_answer(content: Any, pids: dict[str, str]) -> Answer:
    return _answer(content, pids, envelope=True)


def _history_url(target: dict[str, Any], execute_id: str) -> str:
    base, workflow_id = target["base_url"], target["workflow_id"]
    if target["studio"]:
        query = urlencode({"workflow_id": workflow_id, "execute_id": execute_id})
        return f"{base}/v1/workflow/get_run_history?{query}"
    return f"{base}/v1/workflows/{quote(workflow_id, safe='')}/run_histories/{quote(execute_id, safe='')}"


def _sync_outcome(body: dict[str, Any], call: StageCall, pids: dict[str, str]) -> Outcome:
    """A sync answer with code 0: the output, unless the run stopped at a question/input node."""
    data = body.get("data")
    if body.get("interrupt_data") or data in (None, ""):
        run = f"coze run {pids['execute_id']}" if pids.get("execute_id") else "the coze run"
        raise waiting_for_person(f"{run} stopped at {QUESTION_NODE}", call, platform_ids=pids,
                                 hint=WAITING_HINT, how=coze_stream.NO_EVENT_HOW)
    return Done(with_usage(_answer(data, pids, envelope=True), body.get("usage")), pids)


def _checked_body(resp: requests.Response, call: StageCall, execute_id: str | None = None,
                  poll: bool = False) -> tuple[dict[str, Any], dict[str, str]]:
    """The answer's JSON object and platform ids; an HTTP error or a nonzero ``code`` raises."""
    body = json_body(resp)
    body = body if isinstance(body, dict) else {}
    pids = ids(execute_id=body.get("execute_id") or execute_id, debug_url=body.get("debug_url"),
               log_id=resp.headers.get(UNVERIFIED.log_id_header) or dig(body, "detail", "logid"))
    code = _code(body.get("code"))
    if resp.ok and code == 0:
        return body, pids
    raise _code_error(resp, body, code, call, pids, poll=poll)


def _code(value: Any) -> int | None:
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


def _code_error(resp: requests.Response, body: dict[str, Any], code: int | None, call: StageCall,
                pids: dict[str, str], poll: bool = False) -> PlatformError:
    """Classify a failed answer.

    Order: codes that rule a run out or need a person (FATAL), codes of a run that ran (UNKNOWN), any other
    failure that shows a run was created (UNKNOWN, on a run request), throttles and "retry later" codes
    (RETRYABLE), the HTTP status, and unknown codes (FATAL).
    """
    ran, execute_id = (False, None) if poll else run_evidence(body)
    if execute_id:
        pids = {**pids, "execute_id": execute_id}
    if code in FATAL_CODES:
        retry = Retry.FATAL
    elif code in UNKNOWN_CODES and not poll:
        retry = Retry.UNKNOWN
    elif ran:
        retry = Retry.UNKNOWN
    elif code in RETRYABLE_CODES:
        retry = Retry.RETRYABLE
    elif not resp.ok:
        retry = classify_http(resp, poll=poll)
    else:
        retry = UNVERIFIED.unknown_code_retry
    message = clip(body.get("msg") or body.get("message") or (resp.text if not body else "") or "no message",
                   call)
    waiting = code in WAITING_CODES
    hint = CODE_HINTS.get(code, "")
    if waiting:
        hint = f": stopped at {QUESTION_NODE}, waiting for a person{WAITING_HINT}"
    if retry is Retry.UNKNOWN:
        hint += " (a run was created: it may have run)"
    elif code is None and never_forwarded(resp):
        hint += " (a proxy in front refused the call without passing it on: nothing ran)"
    if code is None:
        text = f"coze answered HTTP {resp.status_code} without a code: {message}{hint}"
    else:
        where = "" if resp.ok else f" (HTTP {resp.status_code})"
        text = f"coze code {code}{where}: {message}{hint}"
    outage = is_outage(resp.status_code) or (code in OUTAGE_CODES and retry is Retry.RETRYABLE)
    return PlatformError(text, retry,
                         retry_after_s=retry_after_s(resp) if retry is Retry.RETRYABLE or outage else None,
                         status=resp.status_code, platform_ids=pids,
                         code=WAITING_HUMAN if waiting else None if code is None else str(code),
                         outage=outage,
                         handle={"execute_id": execute_id} if execute_id and retry is Retry.UNKNOWN else None)


def _record_outcome(record: dict[str, Any], handle: dict[str, Any], call: StageCall,
                    pids: dict[str, str], studio: bool = False) -> Outcome:
    status = str(record.get("execute_status") or "")
    name = f"coze run {pids.get('execute_id')}"
    if status.lower() == "running":
        return Running(dict(handle), pids, status=status)
    if status.lower() == "success":
        if record.get("is_output_trimmed") is True:  # coze.com: the End node's output was cut
            raise output_trimmed(name, pids, TRIMMED_HINT)
        return Done(with_usage(_answer(record.get("output"), pids, wrapped=not studio), record.get("usage")),
                    pids)
    if status.lower() == "fail":
        code = record.get("error_code")
        # coze.com / coze-py: error_message; Coze Studio's WorkflowExecuteHistory: error_msg
        detail = clip(record.get("error_message") or record.get("error_msg") or "no error message", call)
        raise PlatformError(f"{name} failed{f' (error code {code})' if code else ''}: {detail}",
                            Retry.IF_IDEMPOTENT, code=str(code) if code else None, platform_ids=pids)
    if status.lower() == "cancel":
        raise PlatformError(f"{name} was cancelled on Coze", Retry.FATAL, platform_ids=pids)
    if status == "<UNSET>":
        # Coze Studio prints an interrupted run's status 5, outside its thrift enum, as "<UNSET>"
        raise waiting_for_person(f"{name} is interrupted (execute_status <UNSET>) at {QUESTION_NODE}",
                                 call, platform_ids=pids, hint=WAITING_HINT, how=coze_stream.NO_EVENT_HOW)
    raise PlatformError(f"{name} has execute_status {clip(status)!r}, which batchgate does not handle",
                        Retry.FATAL, platform_ids=pids)


def with_usage(answer: Answer, raw: Any) -> Answer:
    """``answer`` with the usage Coze reported, when it reported one."""
    usage = coze_stream.usage_of(raw)
    return answer if usage is None else dataclasses.replace(answer, usage=usage)


def _answer(output: Any, pids: dict[str, str], *, wrapped: bool = False, envelope: bool = False) -> Answer:
    """An answer from Coze's JSON-string output, unwrapped by Coze's own rules, then the contract when it
    has ``status``, else plain output.

    ``wrapped`` (coze.com's run history): the ``Output`` of the record's wrapper, whatever other keys it
    has. ``envelope`` (a sync answer): ``data`` of the text-answer envelope (:data:`ANSWER_ENVELOPE`).
    """
    value = parse_json_text(output)
    wrapper = UNVERIFIED.history_output_wrapper
    if wrapped and wrapper and isinstance(value, dict) and wrapper in value:
        value = parse_json_text(value[wrapper])
    elif envelope and isinstance(value, dict) and set(value) == ANSWER_ENVELOPE:
        value = parse_json_text(value["data"])
    return answer_from_value(value, pids)
