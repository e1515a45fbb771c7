"""n8n executions that wait for a person: the resume handle, and resuming through n8n's waiting webhooks.

An execution waits at a node that put it to wait (``status: waiting``). n8n resumes it when a request
reaches its waiting webhook, ``<n8n>/webhook-waiting/<executionId>`` (``$execution.resumeUrl``; the path is
``N8N_ENDPOINT_WEBHOOK_WAIT``), which n8n-io/n8n ``packages/cli/src/webhooks/waiting-webhooks.ts`` serves:

- a **Wait node "On Webhook Call"** (``resume: webhook``) listens there, with its ``httpMethod`` (default
  GET) and an optional ``options.webhookSuffix`` path; the request (JSON body, or query for GET) becomes
  the node's output. batchgate sends the decision (``approved``, ``decision``, ``comment``, ``output``).
- a **"send and wait" node** (Slack, Gmail, Telegram... ``operation: sendAndWait``) listens at
  ``<resumeUrl>/<nodeId>`` (packages/nodes-base/utils/sendAndWait/utils.ts ``getSendAndWaitConfig``); an
  approval answers GET ``?approved=true|false`` (false only when the node offers "Approve and Disapprove").
  Newer n8n signs that link (``?signature=``, HMAC with the instance's secret, ``data.validateSignature``):
  batchgate cannot make the signature, so such a wait is answered in the message n8n sent. Free-text and
  custom-form responses are n8n forms a person fills in.
- a **Form** node or a Wait node "On Form Submitted" waits at ``<n8n>/form-waiting/<executionId>``: a person
  submits the form there (not resumed through the API).

n8n answers a waiting webhook of an execution that already resumed with 409 ("is running already", "has
finished already", "has finished with error") and of a deleted one with 404; an execution that waits at no
webhook with that method/path: 404. Whatever the answer, :func:`resume` then reads the execution through
the public API, so a repeated resume (batchgate crashed between resuming and committing) reads the run's
result instead of failing, and a resume whose answer was lost is known by the execution's state.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any
from urllib.parse import quote, urlencode, urlsplit

import requests

from connectors.base import Decision, Done, Outcome, PlatformError, Retry, Running, StageCall, WaitingHuman
from connectors.transport import (
    clip,
    dig,
    http_error,
    ids,
    json_body,
    not_resumed,
    parse_contract,
    platform_message,
    send,
)

PLATFORM = "n8n"
WEBHOOK_PATH = "/webhook/"
"""n8n's production webhook path (``N8N_ENDPOINT_WEBHOOK``): the part of a target URL before it is n8n's
base URL."""
WAITING_PATH = "webhook-waiting"
"""``N8N_ENDPOINT_WEBHOOK_WAIT``'s default: ``$execution.resumeUrl`` is ``<base>/webhook-waiting/<id>``."""
FORM_WAITING_PATH = "form-waiting"
"""``N8N_ENDPOINT_FORM_WAIT``'s default: forms of waiting executions."""
SEND_AND_WAIT = "sendAndWait"
WAIT_NODE = "n8n-nodes-base.wait"
FORM_NODE = "n8n-nodes-base.form"
SIGNED_HOW = ("answer it in the message n8n sent (Slack, e-mail...): this n8n signs its approval links with "
              "a secret only n8n holds")
UNKNOWN_NODE_HOW = ("n8n did not include the workflow in the execution; batchgate resumes it as a Wait node "
                    "'On Webhook Call' with method POST at $execution.resumeUrl")

Poll = Callable[[StageCall, dict[str, Any], requests.Session], Outcome]


def base_url(target: dict[str, Any]) -> str:
    """n8n's base URL: the webhook URL up to ``/webhook/``, else its origin."""
    url = target["url"]
    cut = url.find(WEBHOOK_PATH)
    if cut > 0:
        return url[:cut]
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}"


def resume_handle(body: dict[str, Any], target: dict[str, Any], execution_id: str,
                  node_name: Any, indefinite: bool = True) -> tuple[dict[str, Any] | None, str]:
    """The resume handle of a waiting execution and how a person answers it (module docstring).

    ``body`` is the execution as the public API returns it (``includeData=true``); the waiting node is
    read from its ``workflowData``; without it, a wait with no time limit (``indefinite``) is taken for a
    Wait node "On Webhook Call" (POST), a timed one for a wait that ends by itself. The handle is None
    where n8n's API cannot resume the wait.
    """
    base = base_url(target)
    waiting_url = f"{base}/{WAITING_PATH}/{quote(execution_id, safe='')}"
    runs = dig(body, "data", "resultData", "runData", node_name) if isinstance(node_name, str) else None
    handle: dict[str, Any] = {"platform": PLATFORM, "execution_id": execution_id, "node": node_name,
                              "node_runs": len(runs) if isinstance(runs, list) else 0}
    node = _node(body, node_name)
    if node is None and not indefinite:
        return None, f"it resumes by itself at {body.get('waitTill')} (or answer it in n8n)"
    if node is None:
        return {**handle, "kind": "webhook", "resume_url": waiting_url, "method": "POST",
                "can_reject": True}, UNKNOWN_NODE_HOW
    params = node.get("parameters") if isinstance(node.get("parameters"), dict) else {}
    if params.get("operation") == SEND_AND_WAIT:
        return _send_and_wait(handle, body, node, params, waiting_url)
    if node.get("type") == WAIT_NODE and params.get("resume") == "webhook":
        suffix = dig(params, "options", "webhookSuffix")
        url = waiting_url + (f"/{quote(suffix.strip('/'), safe='/')}" if isinstance(suffix, str)
                             and suffix.strip("/") else "")
        method = str(params.get("httpMethod") or "GET").upper()
        return ({**handle, "kind": "webhook", "resume_url": url, "method": method, "can_reject": True},
                f"call {url} ({method}) to resume it")
    if node.get("type") == FORM_NODE or params.get("resume") == "form":
        return None, (f"a person submits the n8n form at {base}/{FORM_WAITING_PATH}/"
                      f"{quote(execution_id, safe='')}")
    return None, f"the node {node_name!r} ({node.get('type')}) resumes by itself or only inside n8n"


def _node(body: dict[str, Any], name: Any) -> dict[str, Any] | None:
    nodes = dig(body, "workflowData", "nodes")
    return next((n for n in (nodes if isinstance(nodes, list) else [])
                 if isinstance(n, dict) and n.get("name") == name), None)


def _send_and_wait(handle: dict[str, Any], body: dict[str, Any], node: dict[str, Any],
                   params: dict[str, Any], waiting_url: str) -> tuple[dict[str, Any] | None, str]:
    node_id = node.get("id")
    if not isinstance(node_id, str) or not node_id:
        return None, "answer it in the message n8n sent (the node has no id to build its link)"
    url = f"{waiting_url}/{quote(node_id, safe='')}"
    if dig(body, "data", "validateSignature") is True:
        return None, SIGNED_HOW
    if (params.get("responseType") or "approval") != "approval":
        return None, f"a person fills in the n8n form at {url} (a free-text or custom-form answer)"
    double = dig(params, "approvalOptions", "values", "approvalType") == "double"
    return ({**handle, "kind": "send_and_wait", "resume_url": url, "method": "GET", "can_reject": double},
            f"open {url}?approved=true to approve" + (" or ?approved=false to decline" if double else ""))


def resume(call: StageCall, handle: dict[str, Any], decision: Decision, session: requests.Session,
           poll: Poll, auth: dict[str, str] | None = None) -> Outcome:
    """Resume a waiting execution with ``decision``, then read it through ``poll``.

    Returns ``Done`` when the resume answer is the contract (a Wait node responding when the last node
    finishes), else what ``poll`` says of the execution: ``Running``, ``Done``, or a raised failure
    (``WaitingHuman`` again at another node). Raises FATAL when the handle cannot be resumed or the
    decision is a rejection the node cannot take, RETRYABLE (outage) when n8n was not reached, RETRYABLE
    when n8n did not confirm and the execution still waits, FATAL when n8n refused it (4xx) and it still
    waits. ``auth``: the target's webhook credential, sent along (a Wait node may check the same header or
    basic auth as the Webhook node).
    """
    execution_id = str(handle.get("execution_id") or "")
    pids = ids(execution_id=execution_id)
    url = handle.get("resume_url")
    if not execution_id or not isinstance(url, str):
        raise PlatformError("n8n: the resume handle has no execution_id or resume_url", Retry.FATAL,
                            platform_ids=pids)
    if not decision.approved and not handle.get("can_reject"):
        raise not_resumed(handle, "its node offers no way to decline", pids)
    method, url, payload = _request(handle, decision, url)
    resp = None
    try:
        resp = send(call, session, method, url, platform=PLATFORM, payload=payload, auth=auth,
                    platform_ids=pids)
    except PlatformError as err:
        if err.retry is not Retry.UNKNOWN:  # not delivered (outage), or refused by the outbound guard
            raise
    if resp is not None and resp.ok:
        body = json_body(resp)
        if isinstance(body, dict) and body.get("status") in ("succeeded", "failed"):
            return Done(parse_contract(body, pids), pids)
    return _after_resume(call, handle, session, poll, resp, pids)


def _request(handle: dict[str, Any], decision: Decision, url: str) -> tuple[str, str, Any]:
    """Method, URL and JSON body of the resume request."""
    if handle.get("kind") == "send_and_wait":
        return "GET", f"{url}?{urlencode({'approved': str(decision.approved).lower()})}", None
    fields = {"approved": decision.approved, "decision": decision.word, "comment": decision.comment,
              "output": decision.output, "decided_by": decision.actor}
    method = str(handle.get("method") or "POST").upper()
    if method in ("GET", "HEAD", "DELETE"):
        query = {k: (json.dumps(v) if isinstance(v, (dict, list, bool)) else v) for k, v in fields.items()
                 if v is not None}
        return method, f"{url}?{urlencode(query)}", None
    return method, url, fields


def _after_resume(call: StageCall, handle: dict[str, Any], session: requests.Session, poll: Poll,
                  resp: requests.Response | None, pids: dict[str, str]) -> Outcome:
    """Read the execution after a resume request, whatever n8n answered (module docstring)."""
    read = {"execution_id": handle["execution_id"]}
    try:
        return poll(call, read, session)
    except WaitingHuman as again:
        if not _same_wait(handle, again.resume):
            raise  # it went on and now waits at another node: a new decision
        if resp is not None and resp.ok:
            return Running(read, pids, status="resuming")  # n8n took it; the execution has not moved yet
        if resp is None or resp.status_code >= 500:
            what = "no answer" if resp is None else f"HTTP {resp.status_code}"
            raise PlatformError(f"n8n did not confirm the resume of execution {handle['execution_id']} "
                                f"({what}) and it still waits: resume it again", Retry.RETRYABLE,
                                status=None if resp is None else resp.status_code,
                                platform_ids=pids) from None
        raise http_error(resp, call, PLATFORM, retry=Retry.FATAL, platform_ids=pids,
                         message=f"refused the resume: {clip(platform_message(resp, json_body(resp)), call)}",
                         hint=f" (execution {handle['execution_id']} still waits at {handle.get('node')!r})"
                         ) from None


def _same_wait(handle: dict[str, Any], other: dict[str, Any] | None) -> bool:
    """Whether a fresh read of the execution waits where ``handle`` did (same node, same run of it)."""
    if other is None:
        return True
    return other.get("node") == handle.get("node") and other.get("node_runs") == handle.get("node_runs")
