"""n8n connector: trigger a workflow through its webhook, read the answer or poll the execution.

Target::

    {"type": "n8n", "url": "<webhook url>", "method": "POST", "mode": "sync" | "callback",
     "auth": "header" | "basic" | "none", "auth_secret": "<secret name>"?, "auth_header": "X-N8N-Auth",
     "api_url": "<n8n base url>"?, "api_key_secret": "<secret name>"?}

The body is the envelope as JSON, so a flow reads ``{{ $json.body.items }}``. ``sync``: the Webhook node
responds when the last node finishes (or through Respond to Webhook) with the answer contract, or with an
execution id to poll through the public API (``api_url``). ``callback``: the Webhook node responds
immediately and the flow posts its answer to the envelope's ``callback_url``.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import requests

from connectors.base import Accepted, Answer, Done, Outcome, PlatformError, Retry, Running, StageCall
from connectors.targets import TargetChecker, checked
from connectors.transport import (
    answer_from_value,
    clip,
    contract_error,
    dig,
    http_error,
    ids,
    json_body,
    parse_contract,
    platform_message,
    require_secret,
    send,
)

PLATFORM = "n8n"
FIELDS = ("url", "method", "mode", "auth", "auth_secret", "auth_header", "api_url", "api_key_secret")
RUNNING_STATUSES = ("new", "running", "waiting")
FAILED_STATUSES = ("error", "crashed")
STARTED_MESSAGE = "Workflow was started"


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
        resp = send(call, session, target["method"], target["url"], platform=PLATFORM,
                    payload=call.envelope, auth=_webhook_auth(call, target))
        body = json_body(resp)
        if not resp.ok:
            raise _webhook_error(resp, body, call)
        pids = ids(execution_id=_execution_id(body))
        if target["mode"] == "callback":
            return Accepted(pids)
        return _sync_outcome(body, target, pids)

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
        resp = send(call, session, "GET", url, platform=PLATFORM, auth={"X-N8N-API-KEY": key},
                    platform_ids=pids)
        body = json_body(resp)
        if not resp.ok:
            raise http_error(resp, call, f"{PLATFORM} API", platform_ids=pids)
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


def _webhook_error(resp: requests.Response, body: Any, call: StageCall) -> PlatformError:
    """Classify a webhook's error status by the contracts file."""
    text = platform_message(resp, body)
    status, retry, hint = resp.status_code, None, ""
    if status == 500 and "Error in workflow" in text:
        retry, hint = Retry.IF_IDEMPOTENT, " (the workflow ran and failed; it may have had side effects)"
    elif status == 404 and "not registered" in text:
        retry, hint = Retry.FATAL, (" (is the workflow active? right after activation this can last a few "
                                    "seconds)")
    elif status == 409 and "is running already" in text:
        retry = Retry.RETRYABLE
    elif status in (401, 403, 409):
        retry = Retry.FATAL
    return http_error(resp, call, PLATFORM, retry=retry, message=text, hint=hint,
                      platform_ids=ids(execution_id=_execution_id(body)))


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
    if status in RUNNING_STATUSES:
        return Running(dict(handle), pids)
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
