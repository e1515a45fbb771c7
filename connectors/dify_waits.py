"""Dify runs paused at a human-input node: the resume handle, and submitting the node's form.

A human-input node pauses the run and announces a form: the stream's ``human_input_required`` frame (and
``workflow_paused``'s ``reasons``) carries ``form_token``, ``form_content`` (the prompt), ``inputs`` (the
form's fields), ``actions`` (its buttons, ``{"id", "title"}``), ``node_id``/``node_title`` and
``expiration_time``. The service API (langgenius/dify ``api/controllers/service_api/app/
human_input_form.py``) submits it: ``POST /v1/form/human_input/<form_token>`` ``{"inputs", "action",
"user"}`` (200 ``{}``; 404 unknown form; 412 "Form already submitted or expired"), and the run resumes in
Dify. ``GET /v1/workflow/<workflow_run_id>/events?user=`` (``workflow_events.py``) streams the resumed run's
events to ``workflow_finished`` (one ``workflow_finished`` frame when it already ended; only for the end
user who started the run, so ``user`` is the target's).

A decision picks the form's action: approving takes the first action whose id or title reads as approval
(approve, ok, yes, submit, confirm, accept, continue), else the first action; rejecting takes one that
reads as rejection (reject, decline, deny, no, cancel), and without one the run is not resumed (FATAL
``rejected``). The form's inputs are filled from the decision's ``output`` (an object by input name, or a
text for a form with one input) and its ``comment`` (an input named ``comment``).

A run seen paused only through its status (blocking answer, poll) names no form: it is answered in Dify.
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import quote

import requests

from connectors.base import Decision, PlatformError, Retry, StageCall
from connectors.transport import ids, not_resumed, send

PLATFORM = "dify"
APPROVE_WORDS = re.compile(r"approv|^ok|yes|submit|confirm|accept|continu|agree", re.IGNORECASE)
REJECT_WORDS = re.compile(r"reject|declin|deny|^no\b|cancel|refus|disagree", re.IGNORECASE)
NO_FORM_HOW = ("answer the human-input form in Dify (its web app, or the link Dify sent): Dify's API names "
               "the form only on the run's event stream; use mode streaming to resume it through batchgate")
HANDLE_FIELDS = ("form_token", "form_id", "node_id", "node_title", "inputs", "actions", "expiration_time")


def resume_handle(form: dict[str, Any], pids: dict[str, str],
                  target: dict[str, Any]) -> tuple[dict[str, Any] | None, str]:
    """The handle that submits ``form`` (a ``human_input_required`` frame's data), or None and how."""
    token = form.get("form_token")
    run_id = pids.get("workflow_run_id")
    if not isinstance(token, str) or not token or not run_id:
        return None, NO_FORM_HOW
    handle = {"platform": PLATFORM, "workflow_run_id": run_id, "task_id": pids.get("task_id"),
              "user": target.get("user", "batchgate"), **{k: form.get(k) for k in HANDLE_FIELDS}}
    titles = ", ".join(str(a.get("title") or a.get("id")) for a in _actions(handle))
    return handle, f"submit the form of node {form.get('node_title')!r} in Dify" + (
        f" (actions: {titles})" if titles else "")


def _actions(handle: dict[str, Any]) -> list[dict[str, Any]]:
    actions = handle.get("actions")
    return [a for a in (actions if isinstance(actions, list) else []) if isinstance(a, dict) and a.get("id")]


def choose_action(handle: dict[str, Any], decision: Decision) -> str:
    """The form action a decision takes (module docstring); raises ``rejected`` when none fits."""
    actions = _actions(handle)
    words = APPROVE_WORDS if decision.approved else REJECT_WORDS
    for action in actions:
        if words.search(str(action["id"])) or words.search(str(action.get("title") or "")):
            return str(action["id"])
    if decision.approved and actions:
        return str(actions[0]["id"])
    if decision.approved:
        raise PlatformError("dify: the human-input form has no action to submit", Retry.FATAL,
                            platform_ids=ids(workflow_run_id=handle.get("workflow_run_id")))
    raise not_resumed(handle, "the form has no action that rejects",
                      ids(workflow_run_id=handle.get("workflow_run_id")))


def form_inputs(handle: dict[str, Any], decision: Decision) -> dict[str, Any]:
    """The form's input values from the decision's output and comment (module docstring)."""
    names = [name for field in (handle.get("inputs") or []) if isinstance(field, dict)
             and isinstance(name := field.get("output_variable_name") or field.get("variable")
                            or field.get("name"), str)]
    values: dict[str, Any] = {}
    if isinstance(decision.output, dict):
        values = {k: v for k, v in decision.output.items() if not names or k in names}
    elif decision.output is not None and len(names) == 1:
        values = {names[0]: decision.output}
    if decision.comment and "comment" in names and "comment" not in values:
        values["comment"] = decision.comment
    return {k: v if isinstance(v, str) else str(v) for k, v in values.items()}


def submit(call: StageCall, session: requests.Session, base_url: str, auth: dict[str, str],
           handle: dict[str, Any], decision: Decision) -> requests.Response | None:
    """Submit the form; the response, or None when it was delivered and its answer did not come.

    Raises:
        PlatformError: ``rejected`` when no action rejects; RETRYABLE (outage) when Dify was not reached.
    """
    token = handle.get("form_token")
    if not isinstance(token, str) or not token:
        raise PlatformError("dify: the resume handle has no form_token", Retry.FATAL)
    payload = {"inputs": form_inputs(handle, decision), "action": choose_action(handle, decision),
               "user": handle.get("user") or "batchgate"}
    pids = ids(workflow_run_id=handle.get("workflow_run_id"))
    try:
        return send(call, session, "POST", f"{base_url}/v1/form/human_input/{quote(token, safe='')}",
                    platform=PLATFORM, payload=payload, auth=auth, platform_ids=pids)
    except PlatformError as err:
        if err.retry is not Retry.UNKNOWN:
            raise
        return None


def events_url(base_url: str, handle: dict[str, Any]) -> str:
    run_id = quote(str(handle["workflow_run_id"]), safe="")
    return f"{base_url}/v1/workflow/{run_id}/events?user={quote(str(handle.get('user') or 'batchgate'))}"
