"""Generic HTTP connector: POST the envelope to any endpoint that speaks the answer contract.

Target::

    {"type": "http", "url": "https://...", "method": "POST", "mode": "sync" | "callback", "headers": {},
     "auth_secret": "<secret name>"?, "auth_header": "Authorization", "auth_scheme": "Bearer"}

``sync``: a 2xx JSON body is the answer contract. ``callback``: any 2xx means accepted; the endpoint posts
the answer to the envelope's ``callback_url`` later. Other statuses follow ``classify_http``.
"""

from __future__ import annotations

from typing import Any

import requests

from connectors.base import Accepted, Done, Outcome, PlatformError, Retry, StageCall
from connectors.targets import TargetChecker, checked
from connectors.transport import http_error, json_body, parse_contract, require_secret, send

PLATFORM = "http target"
FIELDS = ("url", "method", "mode", "headers", "auth_secret", "auth_header", "auth_scheme")


def validate_target(target: dict[str, Any]) -> dict[str, Any]:
    """Check an http target and fill its defaults.

    Defaults: ``method`` POST, ``mode`` sync, ``headers`` {}, ``auth_header`` Authorization,
    ``auth_scheme`` Bearer (empty string: the secret is the whole header value).

    Raises:
        ValueError: naming the field at fault.
    """
    check = TargetChecker(target, "http", FIELDS)
    check.url("url", required=True)
    check.method()
    check.choice("mode", ("sync", "callback"), "sync")
    check.headers("headers")
    check.secret_name("auth_secret", what="endpoint's credential")
    check.string("auth_header", "Authorization")
    check.string("auth_scheme", "Bearer", allow_empty=True)
    return check.result


class HttpConnector:
    """Any HTTP endpoint that takes the envelope as its JSON body."""

    def trigger(self, call: StageCall, session: requests.Session) -> Outcome:
        """POST the envelope; sync answers are parsed, callback answers are acceptances."""
        target = checked(validate_target, call.target)
        resp = send(call, session, target["method"], target["url"], platform=PLATFORM,
                    payload=call.envelope, headers=target["headers"], auth=_auth(call, target))
        if not resp.ok:
            raise http_error(resp, call, PLATFORM)
        if target["mode"] == "callback":
            return Accepted()
        body = json_body(resp)
        if body is None:
            raise PlatformError(f"answer does not follow the contract: {PLATFORM} answered HTTP "
                                f"{resp.status_code} without a JSON body", Retry.FATAL,
                                status=resp.status_code)
        return Done(parse_contract(body))

    def poll(self, call: StageCall, handle: dict[str, Any], session: requests.Session) -> Outcome:
        """HTTP targets give no run id: there is nothing to poll."""
        raise PlatformError("http targets have no run to poll (use mode sync or callback)", Retry.FATAL)


def _auth(call: StageCall, target: dict[str, Any]) -> dict[str, str]:
    if not target.get("auth_secret"):
        return {}
    secret = require_secret(call, "auth_secret", PLATFORM)
    scheme = target["auth_scheme"]
    return {target["auth_header"]: f"{scheme} {secret}" if scheme else secret}
