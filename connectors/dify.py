"""Dify connector: run a workflow app (blocking or streaming) and poll its run.

Target::

    {"type": "dify", "base_url": "https://api.dify.ai", "api_key_secret": "<secret name>",
     "mode": "blocking" | "streaming", "workflow_id": "<published version uuid>"?,
     "inputs": {"<variable>": "<envelope path>"}?, "user": "batchgate"}

Without ``inputs`` the workflow gets one variable, ``batchgate``: the envelope as a JSON string (declare it as
a paragraph input long enough for a batch). A run is finished only when ``data.status`` says so: a failed run
can come back as HTTP 200.

``streaming`` reads the event stream to ``workflow_finished`` (Dify sends a ping frame about every 10 s, so a
long run keeps the connection alive), calling ``call.on_progress`` as events arrive. It never hangs up
early: a client that closes the stream before ``workflow_finished`` leaves the run ``running`` for ever in
Dify's records (langgenius/dify #12798, #20237, #23654), so a poll would never end. Only when the stream
breaks after ``workflow_started`` does the connector return ``Running({"run_id"})`` to poll. An
``error`` frame ends the run (Dify never finalizes its record either, so it is never polled); a
human-input node (``human_input_required``, ``workflow_paused``, status ``paused``) is ``waiting_human``
with its prompt. ``blocking``
waits for the whole run in one response, which Dify Cloud's gateway cuts at about 60 s while the run goes on
(and is billed): such a cut is ``UNKNOWN`` without a run id, so use streaming for long runs.
docs/connectors-failure-modes.md lists every failure and its class, with the sources.
"""

from __future__ import annotations

import dataclasses
import json
import time
import uuid
from collections.abc import Iterator
from contextlib import closing
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests
import urllib3

from connectors import dify_waits
from connectors.base import (
    Decision,
    Done,
    Outcome,
    PlatformError,
    Retry,
    Running,
    StageCall,
    Usage,
    WaitingHuman,
    map_fields,
)
from connectors.sse import lines as _lines
from connectors.targets import TargetChecker, checked
from connectors.transport import (
    Progress,
    answer_from_value,
    clip,
    delivered_error,
    http_error,
    ids,
    json_body,
    parse_json_text,
    require_secret,
    send,
    waiting_for_person,
)

PLATFORM = "dify"
FIELDS = ("base_url", "api_key_secret", "mode", "workflow_id", "inputs", "user")
FATAL_CODES = frozenset({"invalid_param", "app_unavailable", "model_currently_not_support",
                         "workflow_not_found", "draft_workflow_error", "workflow_id_format_error",
                         # current Dify: a draft or malformed workflow_id is werkzeug's BadRequest, an unknown
                         # one NotFound, a pinned version on a free Cloud plan 403
                         "bad_request", "not_found", "not_workflow_app",
                         "workflow_version_execution_not_allowed"})
FATAL_CODE_PREFIXES = ("provider_",)
# completion_request_error wraps a model call's InvokeError (timeout, connection, server error) raised out
# of a run that had started: the run failed and may have had side effects before it
IF_IDEMPOTENT_CODES = frozenset({"workflow_request_error", "completion_request_error"})
# 429s; Dify sends no Retry-After with them (libs/external_api.py), so retry_after_s stays None.
# internal_server_error is left to its HTTP status: UNKNOWN on a run request, RETRYABLE on a poll.
RETRYABLE_CODES = frozenset({"too_many_requests", "rate_limit_error"})
CODE_HINTS = {
    "workflow_version_execution_not_allowed": (" (pinning workflow_id needs a paid Dify Cloud plan: drop "
                                               "workflow_id to run the published version)"),
    "too_many_requests": " (the app's concurrent-run limit; Dify sends no Retry-After)",
}
WAITING_HINT = (": the run stays paused in Dify until a person answers it there (that answer does not reach "
                "batchgate); remove the human-input node from the app to run it through batchgate")


@dataclass(frozen=True)
class DifyAssumptions:
    """Dify behaviour the contracts file marks UNVERIFIED, or no source confirms; change it only here.

    Retry-After on 429 is also unverified: it is honoured when present and never required.
    """

    error_event: str = "error"
    """SSE error frames: ``{"event": "error", "code", "message", "status"}``."""
    error_event_retry: Retry = Retry.IF_IDEMPOTENT
    """Class of an error frame whose code is unknown and which has no status: the run may have started."""
    succeeded_statuses: tuple[str, ...] = ("succeeded", "partial-succeeded")
    """Finished with outputs; ``partial-succeeded``: nodes failed under an error strategy the flow set."""
    running_statuses: tuple[str, ...] = ("running",)
    paused_statuses: tuple[str, ...] = ("paused",)
    """Waiting for a human (human-input node): FATAL ``waiting_human``, batchgate cannot answer."""
    human_input_event: str = "human_input_required"
    """Frame of a human-input node; its ``data`` has ``form_content`` (the prompt) and ``node_title``
    (api/core/workflow/nodes/human_input/pause_reason.py ``HumanInputRequired``)."""
    paused_event: str = "workflow_paused"
    """Frame of a run that paused; the stream ends after it."""


UNVERIFIED = DifyAssumptions()


def validate_target(target: dict[str, Any]) -> dict[str, Any]:
    """Check a Dify target and fill its defaults.

    Defaults: ``base_url`` https://api.dify.ai (a trailing ``/`` or ``/v1`` is dropped), ``mode`` blocking,
    ``user`` batchgate. ``api_key_secret`` is required; ``workflow_id`` must be a UUID when given.

    Raises:
        ValueError: naming the field at fault.
    """
    check = TargetChecker(target, "dify", FIELDS)
    check.api_base("base_url", "https://api.dify.ai")
    check.secret_name("api_key_secret", required=True, what="Dify app API key")
    check.choice("mode", ("blocking", "streaming"), "blocking")
    workflow_id = check.string("workflow_id")
    if workflow_id is not None:
        try:
            uuid.UUID(workflow_id)
        except ValueError:
            raise check.fail("workflow_id must be the UUID of a published workflow version") from None
    check.mapping("inputs")
    check.string("user", "batchgate")
    return check.result


class DifyConnector:
    """Dify workflow apps through the service API."""

    def trigger(self, call: StageCall, session: requests.Session) -> Outcome:
        """Start a run; blocking reads its result, streaming reads events to ``workflow_finished``."""
        target = checked(validate_target, call.target)
        workflow = f"/{quote(target['workflow_id'], safe='')}" if target.get("workflow_id") else ""
        payload = {
            "inputs": map_fields(target.get("inputs"), call.envelope,
                                 default={"batchgate": json.dumps(call.envelope, ensure_ascii=False)}),
            "response_mode": target["mode"],
            "user": target["user"],
        }
        streaming = target["mode"] == "streaming"
        resp = send(call, session, "POST", f"{target['base_url']}/v1/workflows{workflow}/run",
                    platform=PLATFORM, payload=payload, auth=_auth(call), stream=streaming)
        with closing(resp):
            if resp.ok and streaming and "json" not in resp.headers.get("Content-Type", ""):
                return _read_stream(resp, call)
            return _blocking_outcome(resp, call)

    def resume(self, call: StageCall, handle: dict[str, Any], decision: Decision,
               session: requests.Session) -> Outcome:
        """Submit the human-input form of a paused run, then follow the run (``dify_waits``).

        A submission Dify took: the run's event stream to ``workflow_finished``. Refused (412: submitted
        already, or expired), failed (5xx) or unanswered: the run's own state decides; still paused at the
        form after a lost answer or a 5xx is RETRYABLE, after a 4xx FATAL.
        """
        target = checked(validate_target, call.target)
        run_id = str(handle.get("workflow_run_id") or "")
        pids = ids(workflow_run_id=run_id, task_id=handle.get("task_id"))
        resp = dify_waits.submit(call, session, target["base_url"], _auth(call), handle, decision)
        if resp is not None and resp.ok:
            return _follow_events(call, session, target, handle, pids)
        if resp is not None and resp.status_code != 412 and resp.status_code < 500:
            raise _http_error(resp, json_body(resp), call, pids)
        try:
            return self.poll(call, {"run_id": run_id}, session)
        except WaitingHuman:
            if resp is None or resp.status_code >= 500:
                what = "no answer" if resp is None else f"HTTP {resp.status_code}"
                raise PlatformError(f"dify did not confirm the form submission ({what}) and run {run_id} is "
                                    f"still paused: submit it again", Retry.RETRYABLE,
                                    platform_ids=pids) from None
            raise _http_error(resp, json_body(resp), call, pids, retry=Retry.FATAL,
                              hint=f" (run {run_id} stays paused: its form expired)") from None

    def poll(self, call: StageCall, handle: dict[str, Any], session: requests.Session) -> Outcome:
        """Read a run's status: succeeded -> Done, running/paused -> Running, failed/stopped -> error."""
        target = checked(validate_target, call.target)
        run_id = str(handle.get("run_id") or "")
        if not run_id:
            raise PlatformError("dify: the poll handle has no run_id", Retry.FATAL)
        pids = ids(workflow_run_id=run_id)
        resp = send(call, session, "GET", f"{target['base_url']}/v1/workflows/run/{quote(run_id, safe='')}",
                    platform=PLATFORM, auth=_auth(call), platform_ids=pids, poll=True)
        body = json_body(resp)
        if not resp.ok:
            raise _http_error(resp, body, call, pids, poll=True)
        return _run_outcome(body, pids, call)


def _auth(call: StageCall) -> dict[str, str]:
    return {"Authorization": f"Bearer {require_secret(call, 'api_key_secret', PLATFORM)}"}


def _blocking_outcome(resp: requests.Response, call: StageCall) -> Outcome:
    body = json_body(resp)
    if not resp.ok:
        raise _http_error(resp, body, call)
    if not isinstance(body, dict):
        raise PlatformError(f"dify answered HTTP {resp.status_code} without a JSON object", Retry.FATAL,
                            status=resp.status_code)
    return _run_outcome(body.get("data"), ids(workflow_run_id=body.get("workflow_run_id"),
                                              task_id=body.get("task_id")), call)


def _run_outcome(data: Any, pids: dict[str, str], call: StageCall) -> Outcome:
    """A run record (blocking ``data``, a poll, or ``workflow_finished``) by its ``status``."""
    if not isinstance(data, dict):
        raise PlatformError("dify answered without run data", Retry.FATAL, platform_ids=pids)
    pids = {**ids(workflow_run_id=data.get("id")), **pids}
    run_id, status = pids.get("workflow_run_id"), data.get("status")
    if status in UNVERIFIED.succeeded_statuses:
        answer = answer_from_value(parse_json_text(data.get("outputs")), pids)
        return Done(dataclasses.replace(answer, usage=run_usage(data) or answer.usage), pids)
    if status == "failed":
        message = clip(data.get("error") or "no error message", call)
        raise PlatformError(f"dify run {run_id} failed: {message}", Retry.IF_IDEMPOTENT, platform_ids=pids,
                            usage=run_usage(data))
    if status == "stopped":
        raise PlatformError(f"dify run {run_id} was stopped", Retry.FATAL, platform_ids=pids)
    if status in UNVERIFIED.paused_statuses:
        raise waiting_for_person(f"dify run {run_id} is {status} at a human-input node", call,
                                 platform_ids=pids, hint=WAITING_HINT, how=dify_waits.NO_FORM_HOW)
    if status in UNVERIFIED.running_statuses:
        if not run_id:
            raise PlatformError(f"dify run is {status} but gave no workflow_run_id to poll", Retry.FATAL,
                                platform_ids=pids)
        return Running({"run_id": run_id}, pids, status=str(status))
    raise PlatformError(f"dify run {run_id} has status {clip(status)!r}, which batchgate does not handle",
                        Retry.FATAL, platform_ids=pids)


def run_usage(data: dict[str, Any]) -> Usage | None:
    """What a run record reports it cost: ``total_tokens`` (blocking ``data``, ``workflow_finished``'s
    ``data``, ``GET /workflows/run/<id>``), with ``total_price`` and ``currency`` where the record carries
    them (at its top or in ``execution_metadata``, as node records do)."""
    meta = data.get("execution_metadata") if isinstance(data.get("execution_metadata"), dict) else {}
    return Usage.parse(data.get("total_tokens", meta.get("total_tokens")),
                       data.get("total_price", meta.get("total_price")),
                       data.get("currency", meta.get("currency")))


def code_retry(code: Any) -> Retry | None:
    """The class the contracts file gives a Dify error code, or None for codes it does not list."""
    if not isinstance(code, str):
        return None
    if code in RETRYABLE_CODES:
        return Retry.RETRYABLE
    if code in IF_IDEMPOTENT_CODES:
        return Retry.IF_IDEMPOTENT
    if code in FATAL_CODES or code.startswith(FATAL_CODE_PREFIXES):
        return Retry.FATAL
    return None


def _follow_events(call: StageCall, session: requests.Session, target: dict[str, Any],
                   handle: dict[str, Any], pids: dict[str, str]) -> Outcome:
    """Read a resumed run's events to its end; without that endpoint (an older Dify), poll the run."""
    resp = send(call, session, "GET", dify_waits.events_url(target["base_url"], handle), platform=PLATFORM,
                auth=_auth(call), stream=True, platform_ids=pids, poll=True)
    with closing(resp):
        if resp.ok and "json" not in resp.headers.get("Content-Type", ""):
            return _read_stream(resp, call, dict(pids))
    return Running({"run_id": pids["workflow_run_id"]}, pids, status="resumed")


def _http_error(resp: requests.Response, body: Any, call: StageCall,
                pids: dict[str, str] | None = None, poll: bool = False,
                retry: Retry | None = None, hint: str = "") -> PlatformError:
    code = body.get("code") if isinstance(body, dict) else None
    message = body.get("message") if isinstance(body, dict) else None
    text = f"{code}: {message or ''}" if code else (message or resp.text or resp.reason or "")
    retry = retry or (None if resp.status_code in (401, 403) else code_retry(code))
    hint = hint or (CODE_HINTS.get(code, "") if isinstance(code, str) else "")
    if code == "invalid_param" and "not published" in str(message).lower():
        hint = " (publish the app in Dify: the API runs the published version only)"
    return http_error(resp, call, PLATFORM, retry=retry, message=text, code=code, platform_ids=pids,
                      poll=poll, hint=hint)


def _event_error(event: dict[str, Any], call: StageCall, pids: dict[str, str]) -> PlatformError:
    """An ``error`` frame ends the run; it is never polled.

    Dify writes an ``error`` frame when the generation raised (``_error_to_stream_response``) and then
    ends the stream without ever finalizing the run's record, which stays ``running``: a poll would never
    end. After ``workflow_started`` the run ran and failed, possibly after side effects: IF_IDEMPOTENT
    (FATAL for the codes that rule a retry out). Before it, by code, else by status (429 RETRYABLE, 5xx
    UNKNOWN: the run had been requested, other FATAL), with no handle either way.
    """
    code, status = event.get("code"), event.get("status")
    run_id = pids.get("workflow_run_id")
    retry = code_retry(code)
    if run_id:
        retry = Retry.FATAL if retry is Retry.FATAL else Retry.IF_IDEMPOTENT
    elif retry is None and isinstance(status, int):
        retry = (Retry.RETRYABLE if status == 429 else Retry.UNKNOWN if status >= 500 else Retry.FATAL)
    retry = retry or UNVERIFIED.error_event_retry
    message = clip(event.get("message") or "no error message", call)
    where = f"dify run {run_id} ended with" if run_id else "dify answered the run request with"
    return PlatformError(f"{where} an error event {code or '(no code)'}: {message}", retry,
                         status=status if isinstance(status, int) else None,
                         code=str(code) if code else None, platform_ids=pids,
                         outage=status == 429 and not run_id)


def _human_input(event: dict[str, Any]) -> tuple[str, str | None, dict[str, Any]]:
    """Where a paused run waits, its prompt and its form, from a ``human_input_required`` or
    ``workflow_paused`` frame (whose ``data.reasons`` carry the same fields)."""
    data = event.get("data") if isinstance(event.get("data"), dict) else {}
    reasons = data.get("reasons") if isinstance(data.get("reasons"), list) else []
    found = data if "form_content" in data else next(
        (r for r in reasons if isinstance(r, dict) and "form_content" in r), {})
    title = found.get("node_title") or found.get("node_id")
    prompt = found.get("form_content")
    return (f"human-input node {title!r}" if isinstance(title, str) else "a human-input node",
            prompt if isinstance(prompt, str) else None, found)


def _read_stream(resp: requests.Response, call: StageCall, pids: dict[str, str] | None = None) -> Outcome:
    """Read events to ``workflow_finished`` (the run's outcome), calling ``on_progress`` on each frame.

    The stream is never closed early (that leaves the run ``running`` in Dify for ever). An ``error``
    frame ends the run (:func:`_event_error`); a human-input node is read on to ``workflow_paused`` and
    raised as ``waiting_human`` with its ``form_content``. If the stream breaks or ends before
    ``workflow_finished``: ``Running`` with the run id when ``workflow_started`` gave one, else ``UNKNOWN``
    (the run may have started). Without ``workflow_started`` within ``call.timeout_s`` (pings only):
    ``UNKNOWN``.
    """
    pids = pids or {}
    asked = NOT_ASKED
    progress = Progress(call)
    started_by = time.monotonic() + call.timeout_s
    try:
        for event in _sse_events(resp):
            progress()
            if event is None:  # a ping or another frame without data
                if "workflow_run_id" not in pids and time.monotonic() > started_by:
                    raise PlatformError(f"dify sent no workflow_started within {call.timeout_s:g} s; the "
                                        f"request was delivered, so a run may have started", Retry.UNKNOWN,
                                        platform_ids=pids)
                continue
            pids.update(ids(workflow_run_id=event.get("workflow_run_id"), task_id=event.get("task_id")))
            kind = event.get("event")
            if kind == "workflow_started":
                pids = {**ids(workflow_run_id=(event.get("data") or {}).get("id")), **pids}
            elif kind == "workflow_finished":
                return _run_outcome(event.get("data"), pids, call)
            elif kind == UNVERIFIED.error_event:
                raise _event_error(event, call, pids)
            elif kind == UNVERIFIED.human_input_event:
                asked = _human_input(event)  # read on to workflow_paused, as Dify's own clients do
            elif kind == UNVERIFIED.paused_event:
                raise _paused(call, pids, asked if asked[1] else _human_input(event))
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        if asked != NOT_ASKED:  # the run paused; the stream broke before workflow_paused
            raise _paused(call, pids, asked) from exc
        return _stream_broke(call, pids, exc)
    if asked != NOT_ASKED:
        raise _paused(call, pids, asked)
    return _stream_broke(call, pids, None)


NOT_ASKED: tuple[str, str | None, dict[str, Any]] = ("", None, {})


def _paused(call: StageCall, pids: dict[str, str],
            asked: tuple[str, str | None, dict[str, Any]]) -> PlatformError:
    where, prompt, form = asked
    run = f"dify run {pids.get('workflow_run_id')}"
    handle, how = dify_waits.resume_handle(form, pids, call.target)
    return waiting_for_person(f"{run} paused at {where or 'a human-input node'}", call, prompt, pids,
                              hint=WAITING_HINT, resume=handle, how=how)


def _stream_broke(call: StageCall, pids: dict[str, str], exc: BaseException | None) -> Outcome:
    """The stream stopped before ``workflow_finished``: poll the run if its id is known, else UNKNOWN."""
    run_id = pids.get("workflow_run_id")
    if run_id:
        return Running({"run_id": run_id}, pids)
    if exc is None:
        raise PlatformError("dify event stream ended before workflow_started; the request was delivered, so "
                            "a run may have started", Retry.UNKNOWN, platform_ids=pids)
    raise delivered_error(call, PLATFORM, exc, platform_ids=pids)


def _sse_events(resp: requests.Response) -> Iterator[dict[str, Any] | None]:
    """One item per server-sent event frame, as it arrives: its JSON ``data:`` object, or None (a ping, a
    frame without data or whose data is not a JSON object)."""
    data: list[bytes] = []
    fields = False
    for line in _lines(resp):
        if not line:
            if fields:
                yield _json_object(b"\n".join(data)) if data else None
            data, fields = [], False
            continue
        fields = True
        if line.startswith(b"data:"):
            data.append(line[5:].removeprefix(b" "))
    if fields:
        yield _json_object(b"\n".join(data)) if data else None


def _json_object(raw: bytes) -> dict[str, Any] | None:
    try:
        value = json.loads(raw)
    except ValueError:
        return None
    return value if isinstance(value, dict) else None
