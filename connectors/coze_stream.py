"""Coze streaming runs (target ``mode: stream``), their interrupts, and resuming them.

Only a streaming run names its interrupt: coze-dev/coze-studio ``OpenAPIStreamRunFlow``
(``POST /v1/workflow/stream_run``) writes server-sent events ``Message`` (``content``, ``node_title``,
``node_is_finish``...), ``Error`` (``error_code``, ``error_message``), ``Interrupt`` (``interrupt_data:
{event_id, type, data}``, ``node_title``) and ``Done`` (``debug_url``); Studio's ``event_id`` is
``<execute_id>/<event>`` (application/workflow ``convertStreamRunEvent``). A question node (type 2) or an
input node (type 5) is resumed by ``POST /v1/workflow/stream_resume`` ``{workflow_id, event_id,
resume_data, interrupt_type}``, which streams the rest of the run the same way (coze-py
``workflows.runs.resume``). A sync run that reaches a question node fails with 6039 and an async run's
history shows it ``<UNSET>`` with no event id: those are answered in Coze.

The answer is the content of the last node that finished before ``Done`` (the End node), unwrapped like a
sync answer. The person's answer is ``resume_data``: the decision's ``output`` (text as it is, JSON
otherwise), else its comment, else "approve". Coze's question nodes have no rejection: a rejection is not
resumed (FATAL ``rejected``). Resuming an event that was resumed already gets a nonzero code (Studio:
"workflow execution ... is not interrupted ... cannot resume"); like a lost or failed answer, it is then
settled by the run's history, so a repeated resume reads the result instead of failing.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable
from contextlib import closing
from typing import Any

import requests
import urllib3

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
)
from connectors.coze_codes import FATAL_CODES, run_evidence
from connectors.sse import frames
from connectors.transport import (
    Progress,
    clip,
    delivered_error,
    ids,
    not_resumed,
    parse_json_text,
    send,
    waiting_for_person,
)

PLATFORM = "coze"
PROMPT_KEYS = ("question", "content", "message", "prompt", "title")
NO_EVENT_HOW = ("answer the question in Coze: only a streaming run (target mode stream) names the "
                "interrupt that batchgate resumes")

Checked = Callable[[requests.Response, StageCall], tuple[dict[str, Any], dict[str, str]]]
AnswerOf = Callable[[Any, dict[str, str]], Any]
Poll = Callable[[StageCall, dict[str, Any], requests.Session], Outcome]


def read(resp: requests.Response, call: StageCall, answer_of: AnswerOf,
         pids: dict[str, str] | None = None) -> Outcome:
    """Read a run's event stream to ``Done`` (the End node's answer), ``Interrupt`` or ``Error``.

    A stream that breaks or ends without one of them: ``Running`` to poll when the execute_id is known,
    else ``UNKNOWN`` (the run may have started).
    """
    pids = dict(pids or {})
    nodes: dict[str, list[str]] = {}
    last_done: str | None = None
    usage: Any = None
    progress = Progress(call)
    try:
        for frame in frames(resp):
            progress()
            kind, data = frame.get("event"), parse_json_text(frame.get("data"))
            data = data if isinstance(data, dict) else {}
            if kind == "Message":
                title = str(data.get("node_title") or "")
                nodes.setdefault(title, []).append(str(data.get("content") or ""))
                if data.get("node_is_finish"):
                    last_done = title
                usage = data.get("usage") or usage  # Coze puts the run's usage on its last message
            elif kind == "Done":
                pids.update(_execute_id(data.get("debug_url")))
                content = "".join(nodes.get(last_done, [])) if last_done is not None else None
                answer = answer_of(content, pids)
                found = usage_of(usage)
                return Done(answer if found is None else dataclasses.replace(answer, usage=found), pids)
            elif kind == "Interrupt":
                raise interrupted(call, data, nodes, pids)
            elif kind == "Error":
                raise _error(data, call, pids)
    except (requests.RequestException, urllib3.exceptions.HTTPError, OSError) as exc:
        return _broke(call, pids, exc)
    return _broke(call, pids, None)


def usage_of(raw: Any) -> Usage | None:
    """Coze's ``usage`` (a sync answer, a run history record, a stream message): ``token_count``, else
    ``input_count`` + ``output_count``; Coze reports no price."""
    if not isinstance(raw, dict):
        return None
    tokens = raw.get("token_count")
    counts = raw.get("input_count"), raw.get("output_count")
    if tokens is None and all(isinstance(n, int) for n in counts):
        tokens = counts[0] + counts[1]
    return Usage.parse(tokens)


def _execute_id(debug_url: Any) -> dict[str, str]:
    _, execute_id = run_evidence({"debug_url": debug_url})
    return ids(execute_id=execute_id, debug_url=debug_url)


def interrupted(call: StageCall, data: dict[str, Any], nodes: dict[str, list[str]],
                pids: dict[str, str]) -> WaitingHuman:
    """``WaitingHuman`` for an ``Interrupt`` event, its handle the event to resume."""
    target = call.target
    inner = data.get("interrupt_data") if isinstance(data.get("interrupt_data"), dict) else {}
    event_id, title = str(inner.get("event_id") or ""), data.get("node_title")
    if "/" in event_id and not pids.get("execute_id"):
        pids = {**pids, "execute_id": event_id.split("/", 1)[0]}
    prompt = _prompt(inner.get("data"), nodes.get(str(title or ""), []))
    handle = {"platform": PLATFORM, "workflow_id": target.get("workflow_id"), "event_id": event_id,
              "interrupt_type": inner.get("type"), "node_title": title,
              "execute_id": pids.get("execute_id")} if event_id else None
    where = f"node {title!r}" if isinstance(title, str) and title else "a question/input node"
    run = f"coze run {pids['execute_id']}" if pids.get("execute_id") else "the coze run"
    return waiting_for_person(f"{run} is interrupted at {where}", call, prompt, pids, resume=handle,
                              how=f"answer {where} in Coze" if handle else NO_EVENT_HOW)


def _prompt(data: Any, messages: list[str]) -> str | None:
    """The question: from the interrupt's data (a JSON text), else the node's own messages."""
    value = parse_json_text(data)
    if isinstance(value, dict):
        for key in PROMPT_KEYS:
            if isinstance(value.get(key), str) and value[key].strip():
                return value[key]
        listed = value.get("messages")
        if isinstance(listed, list):
            texts = [m["content"] for m in listed
                     if isinstance(m, dict) and isinstance(m.get("content"), str)]
            if texts:
                return "\n".join(texts)
    if "".join(messages).strip():
        return "".join(messages)
    return value if isinstance(value, str) and value.strip() else None


def _error(data: dict[str, Any], call: StageCall, pids: dict[str, str]) -> PlatformError:
    """An ``Error`` event: the run ran and failed (FATAL for codes that rule a retry out)."""
    code = data.get("error_code")
    retry = Retry.FATAL if code in FATAL_CODES else Retry.IF_IDEMPOTENT
    message = clip(data.get("error_message") or "no error message", call)
    run = f"coze run {pids['execute_id']}" if pids.get("execute_id") else "the coze run"
    return PlatformError(f"{run} ended with an error event {code}: {message}", retry,
                         code=str(code) if code else None, platform_ids=pids)


def _broke(call: StageCall, pids: dict[str, str], exc: BaseException | None) -> Outcome:
    if pids.get("execute_id"):
        return Running({"execute_id": pids["execute_id"]}, pids)
    if exc is None:
        raise PlatformError("coze event stream ended before the run ended; the request was delivered, so the "
                            "run may have happened", Retry.UNKNOWN, platform_ids=pids)
    raise delivered_error(call, PLATFORM, exc, platform_ids=pids)


def resume_data(decision: Decision) -> str:
    """What the person answers the question with (module docstring)."""
    if isinstance(decision.output, str):
        return decision.output
    if decision.output is not None:
        return json.dumps(decision.output, ensure_ascii=False)
    return decision.comment or "approve"


def resume(call: StageCall, handle: dict[str, Any], decision: Decision, session: requests.Session,
           base_url: str, auth: dict[str, str], answer_of: AnswerOf, checked: Checked, poll: Poll) -> Outcome:
    """Resume an interrupted streaming run, then read its stream; a refusal or a lost answer is settled
    by the run's history (module docstring)."""
    event_id = str(handle.get("event_id") or "")
    pids = ids(execute_id=handle.get("execute_id"))
    if not event_id or not handle.get("workflow_id"):
        raise PlatformError("coze: the resume handle has no event_id or workflow_id", Retry.FATAL,
                            platform_ids=pids)
    if not decision.approved:
        raise not_resumed(handle, "a Coze question has no rejection", pids)
    payload = {"workflow_id": str(handle["workflow_id"]), "event_id": event_id,
               "resume_data": resume_data(decision), "interrupt_type": handle.get("interrupt_type")}
    refusal: PlatformError | None = None
    try:
        resp = send(call, session, "POST", f"{base_url}/v1/workflow/stream_resume", platform=PLATFORM,
                    payload=payload, auth=auth, stream=True, platform_ids=pids)
        with closing(resp):
            if resp.ok and "json" not in resp.headers.get("Content-Type", ""):
                return read(resp, call, answer_of, pids)
            try:
                checked(resp, call)
                refusal = PlatformError("coze answered the resume without an event stream", Retry.FATAL,
                                        platform_ids=pids)
            except PlatformError as err:
                refusal = err
    except PlatformError as err:
        if err.retry is not Retry.UNKNOWN:
            raise
    return _settle(call, handle, session, poll, refusal, pids)


def _settle(call: StageCall, handle: dict[str, Any], session: requests.Session, poll: Poll,
            refusal: PlatformError | None, pids: dict[str, str]) -> Outcome:
    """The run's history decides after a refused or unanswered resume."""
    if not pids.get("execute_id"):
        if refusal is not None:
            raise refusal
        raise PlatformError("coze did not answer the resume and the handle names no execute_id to ask "
                            "about", Retry.UNKNOWN, platform_ids=pids)
    try:
        return poll(call, {"execute_id": pids["execute_id"]}, session)
    except WaitingHuman:  # still interrupted: the resume did not take
        if refusal is None or refusal.retry is not Retry.FATAL:
            raise PlatformError(f"coze did not confirm the resume of run {pids['execute_id']} and it is "
                                f"still interrupted: resume it again", Retry.RETRYABLE,
                                platform_ids=pids) from None
        raise refusal from None
