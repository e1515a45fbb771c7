"""Plumbing every connector shares: signed requests, transport failures, platform messages, answers.

Every outbound request goes through :func:`send`: the body is ``encode(payload)``, the headers are
``signed_headers(call, body)`` plus the platform's auth. Transport failures are classed by whether the
request can have reached the platform:

- never sent (connection refused, DNS failure, connect timeout): ``RETRYABLE`` with ``outage`` (the
  target is unavailable, not this call);
- sent (read timeout, connection dropped before or during the answer): ``UNKNOWN`` for a call that starts
  a run (the flow may have run), ``RETRYABLE`` for a poll (``poll=True``: a read without side effects).

:func:`http_error` classes HTTP error answers the same way (``classify_http``). Messages built here are
clipped and scrubbed of the call's secret values.
The gateway passes a guarded session (gateway.net.outbound): it checks the address of every connection and
redirect hop, and drops the auth and signature headers when a redirect changes the origin; an address it
refuses, or too many redirects, is ``PlatformError(FATAL)``.
"""

from __future__ import annotations

import json
import logging
import socket
import time
from collections.abc import Iterator
from typing import Any
from urllib.parse import urlsplit

import requests
import urllib3

from connectors.base import (
    OUTPUT_TRIMMED,
    Answer,
    PlatformError,
    Retry,
    StageCall,
    WaitingHuman,
    classify_http,
    encode,
    is_outage,
    never_forwarded,
    retry_after_s,
    signed_headers,
)

log = logging.getLogger(__name__)

MESSAGE_LIMIT = 500
"""Longest platform message kept in an error (characters)."""

REDACTED = "[redacted]"


def ids(**values: Any) -> dict[str, str]:
    """Platform ids as strings, without the empty ones."""
    return {name: str(value) for name, value in values.items() if value not in (None, "")}


def clip(text: Any, call: StageCall | None = None) -> str:
    """A platform message fit for an error: secrets removed, at most ``MESSAGE_LIMIT`` characters."""
    text = " ".join(str(text).split())
    if call is not None:
        for secret in call.secrets.values():
            if secret and len(secret) >= 4:
                text = text.replace(secret, REDACTED)
    return text if len(text) <= MESSAGE_LIMIT else text[:MESSAGE_LIMIT - 1] + "…"


def require_secret(call: StageCall, field_name: str, platform: str) -> str:
    """The secret value a ``*_secret`` target field names; FATAL when the gateway has none for it."""
    value = call.secret(field_name)
    if not value:
        name = call.target.get(field_name)
        raise PlatformError(f"{platform}: the secret {name!r} (target field {field_name}) is not configured",
                            Retry.FATAL)
    return value


def send(call: StageCall, session: requests.Session, method: str, url: str, *, platform: str,
         payload: Any = None, headers: dict[str, str] | None = None, auth: dict[str, str] | None = None,
         stream: bool = False, platform_ids: dict[str, str] | None = None,
         poll: bool = False) -> requests.Response:
    """Send one signed request; transport failures raise ``PlatformError``.

    Args:
        call: the stage attempt (envelope for the signed headers, timeout).
        session: the HTTP session to send with.
        method: HTTP method.
        url: full URL, query included.
        platform: the platform's name for messages.
        payload: JSON body; None sends an empty (still signed) body.
        headers: extra static headers, below the signed ones.
        auth: the platform's auth headers, on top.
        stream: leave the body unread (for server-sent events).
        platform_ids: ids already known (a poll's run id), kept on transport errors.
        poll: the request only reads a run's state: a failure after sending is RETRYABLE, not UNKNOWN.

    Raises:
        PlatformError: RETRYABLE + outage when the request was never sent (refused, DNS, connect
            timeout); UNKNOWN (RETRYABLE when ``poll``) when it was sent and the answer did not come;
            FATAL when the outbound guard refused the address.
    """
    body = b"" if payload is None else encode(payload)
    all_headers = {**(headers or {}), **signed_headers(call, body), **(auth or {})}
    env = call.envelope
    log.debug("%s %s job_id=%s seq=%s stage=%s attempt=%s", method, platform, env.get("job_id"),
              env.get("seq"), env.get("stage"), env.get("attempt"))
    try:
        return session.request(method, url, data=body, headers=all_headers, timeout=call.timeout_s,
                               stream=stream)
    except requests.RequestException as exc:
        refusal = getattr(exc, "refusal", None)  # the gateway's outbound guard refused an address or hop
        if isinstance(refusal, str):
            raise PlatformError(f"{platform} request refused: {clip(refusal, call)}", Retry.FATAL,
                                platform_ids=platform_ids) from exc
        if never_sent(exc):
            raise PlatformError(f"could not reach {platform} at {urlsplit(url).netloc}: {_reason(exc)}",
                                Retry.RETRYABLE, outage=True, platform_ids=platform_ids) from exc
        if isinstance(exc, _DELIVERED_FAILURES):
            raise delivered_error(call, platform, exc, platform_ids=platform_ids, poll=poll) from exc
        raise PlatformError(f"{platform} request failed: {type(exc).__name__}", Retry.FATAL,
                            platform_ids=platform_ids) from exc


_DELIVERED_FAILURES = (requests.Timeout, requests.ConnectionError, requests.exceptions.ChunkedEncodingError,
                       requests.exceptions.ContentDecodingError)
_CONNECT_FAILURES = (urllib3.exceptions.NewConnectionError, urllib3.exceptions.ConnectTimeoutError,
                     urllib3.exceptions.NameResolutionError, socket.gaierror, ConnectionRefusedError)


NOT_DELIVERED = "batchgate_not_delivered"
"""Attribute the gateway's session sets on a transport failure it proved was never read by the peer
(gateway.net.keepalive: the peer's TCP acknowledged no byte of the request): ``"reused"`` or ``"fresh"``."""


def causes(exc: BaseException | None) -> Iterator[BaseException]:
    """``exc`` and every exception it wraps (``reason``, cause, context, exception arguments), once each."""
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        item = todo.pop()
        if not isinstance(item, BaseException) or id(item) in seen:
            continue
        seen.add(id(item))
        yield item
        todo.extend([getattr(item, "reason", None), item.__cause__, item.__context__, *item.args])


def undelivered_mark(exc: BaseException | None) -> str | None:
    """The :data:`NOT_DELIVERED` mark on ``exc`` or an exception it wraps, if any."""
    return next((str(m) for e in causes(exc) if (m := getattr(e, NOT_DELIVERED, None))), None)


def never_sent(exc: BaseException) -> bool:
    """Whether a transport failure happened before the request could reach the platform.

    True for a connect timeout, a refused connection, a failed name lookup (urllib3's
    ``NewConnectionError`` / ``ConnectTimeoutError`` / ``NameResolutionError`` inside requests'
    ``ConnectionError``), a failed TLS handshake, and a failure the gateway's session proved undelivered
    (:data:`NOT_DELIVERED`); False for anything after the request could have been sent (read timeout,
    reset, ``RemoteDisconnected``, a broken chunked body), and False when unsure.
    """
    if isinstance(exc, requests.ConnectTimeout):
        return True
    wrapped = exc.args[0] if exc.args else None
    if isinstance(wrapped, urllib3.exceptions.MaxRetryError) and isinstance(
            wrapped.reason, urllib3.exceptions.SSLError):
        return True  # the TLS handshake failed (urlopen wraps it); a TLS error while reading is not wrapped
    return any(isinstance(e, _CONNECT_FAILURES) or getattr(e, NOT_DELIVERED, None) for e in causes(exc))


def _reason(exc: BaseException) -> str:
    inner = exc.args[0] if exc.args and isinstance(exc.args[0], BaseException) else None
    inner = getattr(inner, "reason", inner)
    return type(inner or exc).__name__


def delivered_error(call: StageCall, platform: str, exc: BaseException, *, poll: bool = False,
                    platform_ids: dict[str, str] | None = None,
                    handle: dict[str, Any] | None = None) -> PlatformError:
    """The request reached the platform but its answer did not come back (timeout, dropped connection).

    UNKNOWN for a call that starts a run (the flow may have run; ``handle`` lets the gateway poll it),
    RETRYABLE for a poll.
    """
    if isinstance(exc, requests.Timeout) or isinstance(exc, (TimeoutError, socket.timeout,
                                                             urllib3.exceptions.ReadTimeoutError)):
        what = f"{platform} did not answer within {call.timeout_s:g} s"
    else:
        what = f"{platform} dropped the connection before answering ({_reason(exc)})"
    if poll:
        return PlatformError(f"{what} (a poll: polling again)", Retry.RETRYABLE, platform_ids=platform_ids)
    return PlatformError(f"{what}; the request was delivered, so the run may have happened", Retry.UNKNOWN,
                         platform_ids=platform_ids, handle=handle)


class Progress:
    """Calls ``call.on_progress`` at most once per ``interval_s``; its exceptions are logged, not raised.

    A connector calls the instance whenever the platform shows life (a stream event, ping included).
    """

    def __init__(self, call: StageCall, interval_s: float = 1.0) -> None:
        self._fn = call.on_progress
        self._interval_s = interval_s
        self._last = float("-inf")

    def __call__(self) -> None:
        if self._fn is None:
            return
        now = time.monotonic()
        if now - self._last < self._interval_s:
            return
        self._last = now
        try:
            self._fn()
        except Exception:  # the gateway's heartbeat must not break a stream we still have to read to the end
            log.warning("on_progress raised; the call goes on", exc_info=True)


def json_body(resp: requests.Response) -> Any:
    """The response's JSON body, or None when it has none."""
    try:
        return resp.json()
    except ValueError:
        return None


def platform_message(resp: requests.Response, body: Any = None) -> str:
    """The platform's own message from an error response: a JSON ``message``/``msg``, else the text."""
    if isinstance(body, dict):
        for key in ("message", "msg", "error"):
            if isinstance(body.get(key), str) and body[key]:
                return body[key]
    return resp.text or resp.reason or ""


def http_error(resp: requests.Response, call: StageCall, platform: str, *, retry: Retry | None = None,
               message: str | None = None, hint: str = "", code: Any = None,
               platform_ids: dict[str, str] | None = None, poll: bool = False,
               handle: dict[str, Any] | None = None) -> PlatformError:
    """A ``PlatformError`` for an HTTP error answer; the status decides the class unless ``retry`` does.

    ``message`` defaults to the platform's own message (clipped); ``hint`` is batchgate's advice after it.
    ``poll``: the request only read a run's state (5xx is RETRYABLE, not UNKNOWN). 429 and 503 set
    ``outage``; ``retry_after_s`` comes from Retry-After on a RETRYABLE answer (None when absent).
    """
    retry = retry or classify_http(resp, poll=poll)
    outage = is_outage(resp.status_code)
    if retry is Retry.RETRYABLE and never_forwarded(resp):
        hint += " (a proxy in front refused the call without passing it on: nothing ran)"
    text = message if message is not None else platform_message(resp, json_body(resp))
    return PlatformError(f"{platform} answered HTTP {resp.status_code}: {clip(text, call)}{hint}", retry,
                         retry_after_s=retry_after_s(resp) if retry is Retry.RETRYABLE or outage else None,
                         status=resp.status_code, code=None if code is None else str(code),
                         platform_ids=platform_ids, outage=outage,
                         handle=handle if retry is Retry.UNKNOWN else None)


def waiting_for_person(what: str, call: StageCall, prompt: Any = None,
                       platform_ids: dict[str, str] | None = None, hint: str = "", *,
                       resume: dict[str, Any] | None = None, how: str = "") -> WaitingHuman:
    """``waiting_human``: the run stopped to wait for a person.

    ``what`` names the run and where it waits; ``prompt`` is the platform's question to the person, kept
    (clipped, secrets removed) in the message and in ``.prompt``. ``resume``: the handle a decision resumes
    the run with, when the platform's API can; ``how``: where a person answers it otherwise (``hint`` is
    said in the message when no handle is given).
    """
    shown = clip(prompt, call) if isinstance(prompt, str) and prompt.strip() else None
    text = f"{what}: waiting for a person" + (f" ({shown})" if shown else "")
    text += ("; the platform's API can resume it with a decision" if resume is not None
             else f"; batchgate cannot answer it{hint}")
    return WaitingHuman(text, prompt=shown, resume=resume, how=how or hint.lstrip(": "),
                        platform_ids=platform_ids, watch=watch_handle(platform_ids or {}))


WATCH_KEYS = (("execution_id", "execution_id"), ("workflow_run_id", "run_id"), ("execute_id", "execute_id"))
"""Platform id -> the ``poll`` handle key that watches the run (n8n, Dify, Coze)."""


def watch_handle(platform_ids: dict[str, str]) -> dict[str, str] | None:
    """The ``poll`` handle of a run from its platform ids, or None when they name no run."""
    return next(({key: platform_ids[pid]} for pid, key in WATCH_KEYS if platform_ids.get(pid)), None)


def not_resumed(handle: dict[str, Any], why: str, pids: dict[str, str] | None = None) -> PlatformError:
    """FATAL ``rejected``: a rejection the waiting run cannot take; the run is not resumed and still waits."""
    where = handle.get("node") or handle.get("node_title") or "its node"
    return PlatformError(f"{handle.get('platform', 'the platform')} run not resumed on rejection: {why}; it "
                         f"still waits at {where!r} on the platform (stop it there)", Retry.FATAL,
                         code="rejected", platform_ids=pids)


def output_trimmed(what: str, platform_ids: dict[str, str] | None = None, hint: str = "") -> PlatformError:
    """FATAL ``output_trimmed``: the run succeeded but the platform cut its output; never committed."""
    return PlatformError(f"{what} succeeded but the platform trimmed its output; a cut result is never "
                         f"committed{hint}", Retry.FATAL, code=OUTPUT_TRIMMED, platform_ids=platform_ids)


def contract_error(reason: str, platform_ids: dict[str, str] | None = None) -> PlatformError:
    """FATAL: the flow's answer does not follow the answer contract."""
    return PlatformError(f"answer does not follow the contract: {clip(reason)}", Retry.FATAL,
                         platform_ids=platform_ids)


def parse_contract(body: Any, platform_ids: dict[str, str] | None = None) -> Answer:
    """``Answer.parse`` with contract violations raised as FATAL ``PlatformError``."""
    try:
        return Answer.parse(body)
    except ValueError as exc:
        keys = f" (keys: {', '.join(sorted(map(str, body))[:20])})" if isinstance(body, dict) else ""
        raise contract_error(f"{exc}{keys}", platform_ids) from None


def answer_from_value(value: Any, platform_ids: dict[str, str] | None = None) -> Answer:
    """An answer from a platform's outputs: the contract when it has ``status``, else plain output.

    Plain output keeps ``next_cursor`` when the outputs carry one.
    """
    if isinstance(value, dict) and "status" in value:
        return parse_contract(value, platform_ids)
    if isinstance(value, dict) and "next_cursor" in value:
        return Answer(True, output=value, next_cursor=value["next_cursor"], has_next_cursor=True)
    return Answer(True, output=value)


def parse_json_text(text: Any) -> Any:
    """A platform's JSON-in-a-string output, parsed; text that is not JSON stays text."""
    if not isinstance(text, (str, bytes)):
        return text
    try:
        return json.loads(text)
    except ValueError:
        return text


def dig(value: Any, *path: str | int) -> Any:
    """``value[p0][p1]...`` through dicts and lists, or None where the path breaks."""
    for step in path:
        if isinstance(step, int) and isinstance(value, list) and -len(value) <= step < len(value):
            value = value[step]
        elif isinstance(step, str) and isinstance(value, dict):
            value = value.get(step)
        else:
            return None
    return value
