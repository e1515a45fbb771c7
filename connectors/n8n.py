"""n8n connector: trigger a workflow through its webhook, read the answer or poll the execution.

Target::

    {"type": "n8n", "url": "<webhook url>", "method": "POST", "mode": "sync" | "callback",
     "auth": "header" | "basic" | "none", "auth_secret": "<secret name>"?, "auth_header": "X-N8N-Auth",
     "api_url": "<n8n base url>"?, "api_key_secret": "<secret name>"?}

The body is the envelope as JSON, so a flow reads ``{{ $json.body.items }}``. ``sync``: the Webhook node
responds when the last node finishes (or through Respond to Webhook) with the answer contract, or with an
execution id to poll through the public API (``api_url``). ``callback``: the Webhook node responds
immediately and the flow posts its answer to the envelope's ``callback_url``.

Failure classes (observed on n8n 1.82.3 and 2.41.1; docs/n8n-notes.md has the bodies):

- Not delivered (connection refused, DNS, connect timeout, TLS handshake): ``RETRYABLE``, ``outage``.
- Delivered, no answer (read timeout, connection dropped after the request was sent), and 5xx other than
  500 "Error in workflow": ``UNKNOWN``, the workflow may have run; 503 also sets ``outage``.
- 404 "webhook ... is not registered" or "Cannot POST /webhook/...": n8n is booting, or the workflow is
  not active (published): ``RETRYABLE``, ``outage``; the gateway waits without spending attempts and
  pauses the job when it lasts. A 404 that names another method ("Did you mean to make a GET request?")
  is ``FATAL``: the target's method is wrong.
- While n8n boots: 200 "n8n is starting up. Please wait" (text/html, its migrations are running) and
  503 "Database is not ready!": nothing ran, ``RETRYABLE``, ``outage`` (webhook and API alike). These
  and the 404s above are ``booting``: the gateway probes again within 2 s instead of backing off to 30 s.
- 429: ``RETRYABLE``, ``outage``. 500 "Error in workflow": ``IF_IDEMPOTENT``. 401/403/409: ``FATAL``
  (409 "is running already": ``RETRYABLE``).
- A poll 404 on an execution id n8n gave: n8n deleted the execution (the instance or workflow does not
  save successful executions): ``UNKNOWN``.
- A 503 that a proxy in front wrote without forwarding the call (``base.never_forwarded``: Envoy's "no
  healthy upstream" or connect failure, nginx's own page): nothing ran, ``RETRYABLE``, ``outage``.
- A polled execution ``waiting`` with ``waitTill`` WAIT_INDEFINITELY (a Wait, Form or "send and wait"
  node with no limit) or past the attempt's max_run (``StageCall.run_deadline_s``): ``FATAL``
  ``waiting_human`` with the node and, when n8n includes ``workflowData``, its prompt. A shorter wait, or
  a parent parked on a sub-execution, is running.
"""

from __future__ import annotations

import base64
import re
import time
from dataclasses import dataclass
from datetime import datetime
from typing import Any
from urllib.parse import quote, urlsplit

import requests

from connectors import n8n_waits
from connectors.base import (
    Accepted,
    Answer,
    Decision,
    Done,
    Outcome,
    PlatformError,
    Retry,
    Running,
    StageCall,
    never_forwarded,
)
from connectors.targets import TargetChecker, checked
from connectors.transport import (
    answer_from_value,
    clip,
    contract_error,
    dig,
    http_error,
    ids,
    json_body,
    never_sent,
    parse_contract,
    platform_message,
    require_secret,
    retry_after_s,
    send,
    waiting_for_person,
)

PLATFORM = "n8n"
FIELDS = ("url", "method", "mode", "auth", "auth_secret", "auth_header", "api_url", "api_key_secret")
RUNNING_STATUSES = ("new", "running", "waiting")
FAILED_STATUSES = ("error", "crashed")
STARTED_MESSAGE = "Workflow was started"
NOT_REGISTERED = re.compile(r"is not registered|Cannot POST|Cannot [A-Z]+ /webhook", re.IGNORECASE)
"""A webhook 404 while n8n boots or before the workflow is active (JSON ``message`` or Express's HTML)."""
OTHER_METHOD = re.compile(r"Did you mean to make an? ([A-Z]+) request", re.IGNORECASE)
"""The hint of a webhook 404 when the path is registered for another method."""
STARTING_UP = "n8n is starting up. Please wait"
"""n8n's answer (HTTP 200, text/html) to any request while its database migrations run (abstract-server)."""
DB_NOT_READY = "Database is not ready"
"""n8n's 503 message while its database is not connected: no workflow ran."""
WAIT_INDEFINITELY = datetime.fromisoformat("3000-01-01T00:00:00+00:00").timestamp()
"""n8n's ``waitTill`` of a Wait / Form / "send and wait" node with no time limit (n8n-workflow
``constants.ts`` WAIT_INDEFINITELY): the execution waits for a person (or a webhook call) for ever."""
WAIT_FOR_SUB_EXECUTION = datetime.fromisoformat("2999-12-31T00:00:00+00:00").timestamp()
"""n8n's ``waitTill`` of a parent parked on a sub-execution (constants.ts WAIT_FOR_SUB_EXECUTION): it
resumes when the child ends, so it is running."""
PROMPT_PARAMETERS = ("message", "subject", "formTitle", "formDescription")
"""Parameters of the waiting node that hold what it asks the person (send-and-wait ``message``/``subject``,
Form ``formTitle``/``formDescription``; else the node's ``notes``); read when the execution comes with its
``workflowData``."""
WAITING_HINT = (": the execution stays waiting in n8n until a person answers it there (its result does "
                "not reach this batch); give the node a time limit within the stage's max_run, or remove "
                "it from the workflow batchgate calls")
DELETED_HINT = ("save successful executions for polled flows (EXECUTIONS_DATA_SAVE_ON_SUCCESS=all or the "
                "workflow setting)")


@dataclass(frozen=True)
class N8nAssumptions:
    """n8n behaviour no source confirms; change it here and nowhere else."""

    execution_id_keys: tuple[str, ...] = ("executionId", "execution_id")
    """Keys of a sync answer that carry an execution id to poll (a Respond to Webhook node convention)."""
    other_status_retry: Retry = Retry.FATAL
    """Class of a polled status outside success/new/running/waiting/error/crashed/canceled (e.g. unknown)."""


UNVERIFIED = N8nAssumptions()


def validate_target(target: dict[str, Any]) -> dict[str, Any]:
    """Check an n8n target and fill its defaults.

    Defaults: ``method`` POST, ``mode`` sync, ``auth`` header when ``auth_secret`` is set (else none),
    ``auth_header`` X-N8N-Auth. ``api_url`` loses a trailing ``/`` or ``/api/v1``; it needs
    ``api_key_secret`` and the reverse. Basic auth reads its secret as ``user:password``.

    Raises:
        ValueError: naming the field at fault.
    """
    check = TargetChecker(target, "n8n", FIELDS)
    check.url("url", required=True)
    check.method()
    check.choice("mode", ("sync", "callback"), "sync")
    auth_secret = check.secret_name("auth_secret", what="webhook credential")
    auth = check.choice("auth", ("header", "basic", "none"), "header" if auth_secret else "none")
    if auth != "none" and not auth_secret:
        raise check.fail(f"auth {auth} needs auth_secret (the name of the secret holding the credential)")
    if auth == "none" and auth_secret:
        raise check.fail("auth_secret is set but auth is none")
    check.string("auth_header", "X-N8N-Auth")
    _api_fields(check)
    return check.result


def _api_fields(check: TargetChecker) -> None:
    api_url = check.url("api_url", base=True)
    if api_url and api_url.endswith("/api/v1"):
        check.result["api_url"] = api_url[:-len("/api/v1")]
    api_key = check.secret_name("api_key_secret", what="n8n API key")
    if api_url and not api_key:
        raise check.fail("api_url needs api_key_secret (the name of the secret holding the n8n API key)")
    if api_key and not api_url:
        raise check.fail("api_key_secret needs api_url (the n8n base URL, e.g. https://n8n.example.com)")


class N8nConnector:
    """n8n workflows behind a Webhook node."""

    def trigger(self, call: StageCall, session: requests.Session) -> Outcome:
        """Call the webhook with the envelope; read the answer, an execution id or an acceptance."""
        target = checked(validate_target, call.target)
        auth = _webhook_auth(call, target)
        try:
            resp = send(call, session, target["method"], target["url"], platform=PLATFORM,
                        payload=call.envelope, auth=auth)
        except PlatformError as err:
            raise _transport_error(err, call, target["url"], sent_means_unknown=True) from err.__cause__
        body = json_body(resp)
        _raise_if_starting_up(resp, body, call, target["url"], {})
        if not resp.ok:
            raise _webhook_error(resp, body, call, target)
        pids = ids(execution_id=_execution_id(body))
        if target["mode"] == "callback":
            # an execution id (a Respond to Webhook node may answer one) can be asked about if the
            # callback is lost, where the public API is configured
            can_ask = bool(pids.get("execution_id") and target.get("api_url"))
            return Accepted(pids, handle={"execution_id": pids["execution_id"]} if can_ask else None)
        return _sync_outcome(body, target, pids)

    def resume(self, call: StageCall, handle: dict[str, Any], decision: Decision,
               session: requests.Session) -> Outcome:
        """Resume an execution waiting for a person, then read it (``n8n_waits.resume``)."""
        target = checked(validate_target, call.target)
        return n8n_waits.resume(call, handle, decision, session, self.poll, auth=_webhook_auth(call, target))

    def poll(self, call: StageCall, handle: dict[str, Any], session: requests.Session) -> Outcome:
        """Read an execution through the public API: done, still running, or failed."""
        target = checked(validate_target, call.target)
        execution_id = str(handle.get("execution_id") or "")
        pids = ids(execution_id=execution_id)
        if not target.get("api_url") or not execution_id:
            raise PlatformError("n8n: polling needs the target's api_url and an execution_id in the handle",
                                Retry.FATAL, platform_ids=pids)
        url = f"{target['api_url']}/api/v1/executions/{quote(execution_id, safe='')}?includeData=true"
        key = require_secret(call, "api_key_secret", PLATFORM)
        try:
            resp = send(call, session, "GET", url, platform=PLATFORM, auth={"X-N8N-API-KEY": key},
                        platform_ids=pids, poll=True)
        except PlatformError as err:  # a GET changes nothing: a lost answer is only retried
            raise _transport_error(err, call, url, sent_means_unknown=False) from err.__cause__
        body = json_body(resp)
        _raise_if_starting_up(resp, body, call, url, pids)
        if not resp.ok:
            raise _api_error(resp, body, call, pids)
        if not isinstance(body, dict):
            raise PlatformError("n8n API answered without a JSON object", Retry.FATAL, platform_ids=pids)
        return _execution_outcome(body, handle, call, pids)


def _webhook_auth(call: StageCall, target: dict[str, Any]) -> dict[str, str]:
    if target["auth"] == "none":
        return {}
    secret = require_secret(call, "auth_secret", PLATFORM)
    if target["auth"] == "header":
        return {target["auth_header"]: secret}
    if ":" not in secret:
        raise PlatformError(f"n8n: the secret {target['auth_secret']!r} must read user:password for basic "
                            f"auth", Retry.FATAL)
    return {"Authorization": "Basic " + base64.b64encode(secret.encode()).decode()}


def _transport_error(err: PlatformError, call: StageCall, url: str, *,
                     sent_means_unknown: bool) -> PlatformError:
    """Reclassify a transport failure: not delivered is an outage; delivered without an answer is UNKNOWN.

    ``send`` raises RETRYABLE for every connection error and timeout; a webhook call that reached n8n
    may have started the workflow, so a read timeout or a dropped connection there is ``UNKNOWN``.
    A refusal of the outbound guard (FATAL) and failures without a cause stay as they are.
    """
    cause = err.__cause__
    if err.retry is Retry.FATAL or cause is None:
        return err
    pids = err.platform_ids
    if never_sent(cause):
        return PlatformError(f"could not reach n8n at {urlsplit(url).netloc}: {type(cause).__name__} "
                             f"(the call was not delivered)", Retry.RETRYABLE, platform_ids=pids, outage=True)
    if not sent_means_unknown:
        return err
    if isinstance(cause, requests.Timeout):
        what = f"n8n did not answer within {call.timeout_s:g} s"
    else:
        what = f"n8n closed the connection without an answer ({type(cause).__name__})"
    return PlatformError(f"{what} after the call was sent: the workflow may have run", Retry.UNKNOWN,
                         platform_ids=pids)


def _raise_if_starting_up(resp: requests.Response, body: Any, call: StageCall, url: str,
                          pids: dict[str, str]) -> None:
    """n8n answers before any workflow can run while it boots: an outage, whatever the status says."""
    text = resp.text.strip() if body is None else platform_message(resp, body)
    if (resp.status_code == 200 and body is None and text == STARTING_UP) or (
            resp.status_code == 503 and DB_NOT_READY in text):
        raise PlatformError(f"n8n at {urlsplit(url).netloc} is starting up (HTTP {resp.status_code}: "
                            f"{clip(text, call)}): nothing ran", Retry.RETRYABLE, status=resp.status_code,
                            retry_after_s=retry_after_s(resp), platform_ids=pids, outage=True,
                            booting=True)


def _webhook_error(resp: requests.Response, body: Any, call: StageCall,
                   target: dict[str, Any]) -> PlatformError:
    """Classify a webhook's error status (module docstring)."""
    text = _short_message(resp, body)
    status, retry, hint, outage = resp.status_code, None, "", False
    pids = ids(execution_id=_execution_id(body))
    if status == 404 and NOT_REGISTERED.search(text):
        other = OTHER_METHOD.search(resp.text or "")
        if other and other.group(1).upper() != target["method"].upper():
            return http_error(resp, call, PLATFORM, retry=Retry.FATAL, message=text, platform_ids=pids,
                              hint=f" (the webhook listens for {other.group(1).upper()}: set the target's "
                                   f"method)")
        err = PlatformError(f"n8n has no active webhook at {clip(target['url'], call)}: activate/publish the "
                            f"workflow (n8n answered HTTP 404: {clip(text, call)})", Retry.RETRYABLE,
                            status=status, platform_ids=pids, outage=True, booting=True)
        err.retry_after_s = retry_after_s(resp)
        return err
    if status == 500 and "Error in workflow" in text:
        retry, hint = Retry.IF_IDEMPOTENT, " (the workflow ran and failed; it may have had side effects)"
    elif status == 429:
        retry, outage = Retry.RETRYABLE, True
    elif status == 503 and never_forwarded(resp):
        retry, outage = Retry.RETRYABLE, True
        hint = " (a proxy in front refused the call without passing it on: nothing ran)"
    elif status >= 500:
        retry, outage = Retry.UNKNOWN, status == 503
        hint = " (the workflow may have run)"
    elif status == 409 and "is running already" in text:
        retry = Retry.RETRYABLE
    elif status in (401, 403, 409):
        retry = Retry.FATAL
    err = http_error(resp, call, PLATFORM, retry=retry, message=text, hint=hint, platform_ids=pids)
    if outage:
        err.outage, err.retry_after_s = True, retry_after_s(resp)
    return err


def _api_error(resp: requests.Response, body: Any, call: StageCall, pids: dict[str, str]) -> PlatformError:
    """A public API error on a poll: 404 means n8n deleted the execution it gave; 429/503 an outage."""
    if resp.status_code == 404 and isinstance(body, dict):
        return PlatformError(f"n8n deleted execution {pids.get('execution_id')}: {DELETED_HINT} "
                             f"(n8n answered HTTP 404: {clip(platform_message(resp, body), call)})",
                             Retry.UNKNOWN, status=404, platform_ids=pids)
    err = http_error(resp, call, f"{PLATFORM} API", platform_ids=pids, poll=True)
    if resp.status_code in (429, 503):
        err.outage = True
    return err


def _short_message(resp: requests.Response, body: Any) -> str:
    """n8n's message: the JSON ``message`` (with its ``hint``), or the text of an HTML error page."""
    text = platform_message(resp, body)
    if isinstance(body, dict) and isinstance(body.get("hint"), str) and body["hint"]:
        text = f"{text} {body['hint']}"
    if body is None and "<" in text:
        pre = re.search(r"<pre>(.*?)</pre>", text, re.DOTALL | re.IGNORECASE)
        text = pre.group(1) if pre else re.sub(r"<[^>]+>", " ", text)
    return text


def _execution_id(body: Any) -> str | None:
    if not isinstance(body, dict):
        return None
    for key in UNVERIFIED.execution_id_keys:
        if body.get(key) not in (None, ""):
            return str(body[key])
    return None


def _sync_outcome(body: Any, target: dict[str, Any], pids: dict[str, str]) -> Outcome:
    """A sync webhook answer: the contract, or an execution id to poll."""
    if isinstance(body, dict) and "status" in body:
        return Done(parse_contract(body, pids), pids)
    if pids.get("execution_id") and target.get("api_url"):
        return Running({"execution_id": pids["execution_id"]}, pids)
    if pids.get("execution_id"):
        raise contract_error("n8n answered an execution id but the target has no api_url to poll it", pids)
    if isinstance(body, dict) and body.get("message") == STARTED_MESSAGE:
        raise contract_error("n8n answered 'Workflow was started': the Webhook node responds immediately; "
                             "use mode callback, or respond when the last node finishes", pids)
    if body is None:
        raise contract_error("n8n answered without a JSON body", pids)
    return Done(parse_contract(body, pids), pids)


def _execution_outcome(body: dict[str, Any], handle: dict[str, Any], call: StageCall,
                       pids: dict[str, str]) -> Outcome:
    """A polled execution: success -> Done, running -> Running, error/crashed/canceled -> PlatformError."""
    status = body.get("status") or ("success" if body.get("finished") else None)
    name = f"n8n execution {pids['execution_id']}"
    if status == "success":
        return Done(_last_node_answer(body, name, pids), pids)
    if status == "waiting":
        _raise_if_waiting_for_person(body, call, name, pids)
    if status in RUNNING_STATUSES:
        return Running(dict(handle), pids, status=str(status))
    if status in FAILED_STATUSES:
        error = dig(body, "data", "resultData", "error") or {}
        node = dig(error, "node", "name")
        where = f" in node {node!r}" if isinstance(node, str) else ""
        message = clip(dig(error, "message") or "no error message", call)
        raise PlatformError(f"{name} ended with status {status}{where}: {message}", Retry.IF_IDEMPOTENT,
                            platform_ids=pids)
    if status == "canceled":
        raise PlatformError(f"{name} was canceled", Retry.FATAL, platform_ids=pids)
    raise PlatformError(f"{name} has status {clip(status)!r}, which batchgate does not handle",
                        UNVERIFIED.other_status_retry, platform_ids=pids)


def _raise_if_waiting_for_person(body: dict[str, Any], call: StageCall, name: str,
                                 pids: dict[str, str]) -> None:
    """A ``waiting`` execution that will not resume by itself before the attempt's max_run ends.

    ``waitTill`` WAIT_INDEFINITELY: a Wait/Form/"send and wait" node waits for a person with no limit.
    A ``waitTill`` past ``call.run_deadline_s``: it resumes only after the attempt would have failed as
    ``max_run``. Both are ``waiting_human``, with the node's name and prompt. A short wait, a parent
    parked on a sub-execution, or no ``waitTill``: still running.
    """
    wait_till = _timestamp(body.get("waitTill"))
    if wait_till is None or wait_till == WAIT_FOR_SUB_EXECUTION:
        return
    deadline = call.run_deadline_s
    if wait_till < WAIT_INDEFINITELY and (deadline is None or wait_till <= deadline):
        return
    node = dig(body, "data", "resultData", "lastNodeExecuted")
    where = f" at node {node!r}" if isinstance(node, str) else ""
    if wait_till >= WAIT_INDEFINITELY:
        what = f"{name} is waiting{where} with no time limit"
    else:
        until = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(wait_till))
        what = (f"{name} is waiting{where} until {until}, after the stage's max_run ends "
                f"({time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime(deadline))})")
    handle, how = n8n_waits.resume_handle(body, call.target, pids["execution_id"], node,
                                          indefinite=wait_till >= WAIT_INDEFINITELY)
    raise waiting_for_person(what, call, _prompt(body, node), pids, hint=WAITING_HINT, resume=handle, how=how)


def _timestamp(value: Any) -> float | None:
    """Unix seconds of an ISO 8601 date-time (n8n's ``waitTill``), or None."""
    if not isinstance(value, str) or not value:
        return None
    try:
        return datetime.fromisoformat(value.replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _prompt(body: dict[str, Any], node: Any) -> str | None:
    """What the waiting node asks, from the execution's ``workflowData`` when n8n includes it."""
    nodes = dig(body, "workflowData", "nodes")
    found = [n for n in (nodes if isinstance(nodes, list) else []) if isinstance(n, dict)
             and n.get("name") == node]
    parameters = found[0].get("parameters") if found else None
    if not isinstance(parameters, dict):
        return None
    notes = found[0].get("notes")  # the node's Notes setting: where a Wait node's author says what it asks
    return next((parameters[k] for k in PROMPT_PARAMETERS if isinstance(parameters.get(k), str)
                 and parameters[k].strip()), notes if isinstance(notes, str) and notes.strip() else None)


def _last_node_answer(body: dict[str, Any], name: str, pids: dict[str, str]) -> Answer:
    """The answer in the last executed node's first item: the contract, or plain output."""
    result = dig(body, "data", "resultData")
    node = dig(result, "lastNodeExecuted")
    if not isinstance(node, str):
        raise PlatformError(f"{name} succeeded but the API returned no execution data (does the instance "
                            f"save data of successful executions?)", Retry.FATAL, platform_ids=pids)
    items = dig(result, "runData", node, -1, "data", "main", 0)
    if not items:
        return Answer(True, output=None)
    return answer_from_value(dig(items, 0, "json"), pids)
