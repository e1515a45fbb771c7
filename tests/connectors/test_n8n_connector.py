"""n8n fidelity: the connector against a stand-in n8n on a real socket that behaves like real n8n.

The stand-in answers the bodies real n8n 1.82.3 and 2.41.1 answer while they boot or before a workflow is
active (copied from docs/n8n-notes.md), deletes an execution once it succeeded (an instance that does not
save successful executions), cuts a sync call after reading it, holds it past the timeout, or is not
listening at all. Each case checks the class the gateway acts on: RETRYABLE (+ outage: spend no
attempt), UNKNOWN (delivered: the workflow may have run), IF_IDEMPOTENT, FATAL.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests

from connectors import get_connector
from connectors.base import Done, Retry, Running
from gateway.net.outbound import guarded_session
from gateway.net.urlguard import Allowlist
from tests.connectors.helpers import HOOK_SECRET, N8N_API_KEY, call, raises

R, IDEM, U, F = Retry.RETRYABLE, Retry.IF_IDEMPOTENT, Retry.UNKNOWN, Retry.FATAL
PATH = "batchgate-store"

# What real n8n answers to POST /webhook/batchgate-store while it boots and before the workflow is active
# (docs/n8n-notes.md, "Webhook 404s while n8n starts"; curl in a loop while `n8n start` came up).
EXPRESS_404 = (  # before n8n registers its routes: Express's default 404 page
    '<!DOCTYPE html>\n<html lang="en">\n<head>\n<meta charset="utf-8">\n<title>Error</title>\n</head>\n'
    f'<body>\n<pre>Cannot POST /webhook/{PATH}</pre>\n</body>\n</html>\n')
HINT = ("The workflow must be active for a production URL to run successfully. You can activate the "
        "workflow using the toggle in the top-right of the editor. Note that unlike test URL calls, "
        "production URL calls aren't shown on the canvas (only in the executions list)")
V1_NOT_REGISTERED = {  # 1.82.3 and 2.41.1 alike once routes are up and the workflow is not (yet) active
    "code": 404, "message": f'The requested webhook "POST {PATH}" is not registered.', "hint": HINT}
V2_NOT_REGISTERED = {  # the same from 2.41.1 without NODE_ENV=production: a stacktrace rides along
    **V1_NOT_REGISTERED,
    "stacktrace": f'ResponseError: The requested webhook "POST {PATH}" is not registered.\n    at '
                  "LiveWebhooks.findWebhook "
                  "(/work/n8n/v2/node_modules/n8n/src/webhooks/live-webhooks.ts:283:10)"}
WRONG_METHOD = {  # POST to an active webhook that listens for GET only (webhook-not-found.error.js)
    "code": 404,
    "message": "This webhook is not registered for POST requests. Did you mean to make a GET request?"}
STARTING_UP = "n8n is starting up. Please wait"  # HTTP 200 text/html to any path while migrations run
DB_NOT_READY = {"code": 503, "message": "Database is not ready!"}  # any path before the database connects
API_NOT_FOUND = {"message": "Not Found"}  # GET /api/v1/executions/<deleted id>


class StandInN8n:
    """A stand-in n8n on 127.0.0.1: ``mode`` says how the next webhook calls are answered."""

    def __init__(self) -> None:
        self.mode = "ok"
        self.executions: dict[str, list[str]] = {}  # id -> statuses still to report; deleted when done
        self.webhook_calls = 0
        self.hold_s = 3.0
        stand_in = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                stand_in.handle_webhook(self, body)

            def do_GET(self) -> None:
                stand_in.handle_api(self)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.base_url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.url = f"{self.base_url}/webhook/{PATH}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()

    @staticmethod
    def send(handler: BaseHTTPRequestHandler, status: int, body: Any, headers: dict[str, str] | None = None,
             content_type: str = "application/json; charset=utf-8") -> None:
        data = (json.dumps(body) if not isinstance(body, str) else body).encode()
        handler.send_response(status)
        handler.send_header("Content-Type", content_type)
        handler.send_header("Content-Length", str(len(data)))
        for name, value in (headers or {}).items():
            handler.send_header(name, value)
        handler.end_headers()
        handler.wfile.write(data)

    def handle_webhook(self, handler: BaseHTTPRequestHandler, body: bytes) -> None:
        self.webhook_calls += 1
        mode = self.mode
        if mode == "cut":  # read the whole call, then hang up without a status line
            handler.close_connection = True
            handler.connection.shutdown(socket.SHUT_RDWR)
            return
        if mode == "hold":  # the workflow runs longer than the call's timeout
            time.sleep(self.hold_s)
            return self.send(handler, 200, {"status": "succeeded", "output": {"late": True}})
        if mode == "starting_up":
            return self.send(handler, 200, STARTING_UP, content_type="text/html; charset=utf-8")
        if mode == "express_404":
            return self.send(handler, 404, EXPRESS_404, content_type="text/html; charset=utf-8")
        replies = {
            "v1_not_registered": (404, V1_NOT_REGISTERED), "v2_not_registered": (404, V2_NOT_REGISTERED),
            "wrong_method": (404, WRONG_METHOD), "db_not_ready": (503, DB_NOT_READY),
            "error_in_workflow": (500, {"code": 0, "message": "Error in workflow"}),
            "internal": (500, {"message": "Internal Server Error"}),
            "bad_gateway": (502, "<html><body>502 Bad Gateway</body></html>"),
            "unavailable": (503, "Service Unavailable"),
            "gateway_timeout": (504, "Gateway Timeout"),
            "rate_limited": (429, {"message": "Too many requests"}),
        }
        if mode in replies:
            status, reply = replies[mode]
            return self.send(handler, status, reply, {"Retry-After": "4"})
        if mode == "execution":  # a Respond to Webhook node answering the execution id to poll
            execution_id = str(100 + len(self.executions))
            self.executions[execution_id] = ["running", "success"]
            return self.send(handler, 200, {"executionId": execution_id})
        self.send(handler, 200, {"status": "succeeded", "output": {"stored": 3}})

    def handle_api(self, handler: BaseHTTPRequestHandler) -> None:
        if self.mode == "starting_up":
            return self.send(handler, 200, STARTING_UP, content_type="text/html; charset=utf-8")
        if handler.headers.get("X-N8N-API-KEY") != N8N_API_KEY:
            return self.send(handler, 401, {"message": "unauthorized"})
        execution_id = handler.path.split("?")[0].rsplit("/", 1)[1]
        statuses = self.executions.get(execution_id)
        if not statuses:  # never existed, or deleted once it succeeded (saveDataSuccessExecution: none)
            return self.send(handler, 404, API_NOT_FOUND)
        status = statuses.pop(0)
        if status == "success":
            del self.executions[execution_id]
        self.send(handler, 200, {"id": execution_id, "finished": status == "success", "status": status,
                                 "mode": "webhook", "data": {"resultData": {"runData": {}}}})


@pytest.fixture
def n8n():
    server = StandInN8n()
    yield server
    server.close()


@pytest.fixture(params=["plain", "guarded"])
def session(request):
    """A plain requests session, and the guarded session the gateway sends with (127.0.0.1 allowed)."""
    with (requests.Session() if request.param == "plain"
          else guarded_session(Allowlist.parse(["127.0.0.1/32"]))) as s:
        yield s


def stage(url: str, timeout_s: float = 5.0, **target: Any):
    return call({"type": "n8n", "url": url, "auth_secret": "HOOK", "api_url": url.split("/webhook/")[0],
                 "api_key_secret": "N8N", **target},
                {"auth_secret": HOOK_SECRET, "api_key_secret": N8N_API_KEY}, timeout_s=timeout_s)


def trigger(server: StandInN8n, session, **kwargs):
    return get_connector("n8n").trigger(stage(server.url, **kwargs), session)


@pytest.mark.parametrize("mode", ["express_404", "v1_not_registered", "v2_not_registered"])
def test_webhook_not_registered_is_an_outage_with_a_clear_message(n8n, session, mode):
    n8n.mode = mode
    err = raises(R, lambda: trigger(n8n, session), HOOK_SECRET, N8N_API_KEY)
    assert err.outage and err.status == 404
    assert err.message.startswith(f"n8n has no active webhook at {n8n.url}: activate/publish the workflow")
    assert "<" not in err.message  # the HTML page is reduced to its text
    assert ("Cannot POST" if mode == "express_404" else "is not registered") in err.message


def test_webhook_registered_for_another_method_is_fatal(n8n, session):
    n8n.mode = "wrong_method"
    err = raises(F, lambda: trigger(n8n, session))
    assert not err.outage and "listens for GET: set the target's method" in err.message


@pytest.mark.parametrize("mode", ["sync", "callback"])
@pytest.mark.parametrize("boot", ["starting_up", "db_not_ready"])
def test_n8n_starting_up_is_an_outage_not_an_answer(n8n, session, mode, boot):
    """The 200 "starting up" page is neither a sync answer nor a callback acceptance: nothing ran."""
    n8n.mode = boot
    err = raises(R, lambda: trigger(n8n, session, mode=mode))
    assert err.outage and "is starting up" in err.message and "nothing ran" in err.message


def test_poll_while_n8n_starts_up_is_an_outage(n8n, session):
    n8n.mode = "starting_up"
    err = raises(R, lambda: get_connector("n8n").poll(stage(n8n.url), {"execution_id": "7"}, session))
    assert err.outage and err.platform_ids == {"execution_id": "7"}


def test_webhook_comes_up_after_boot(n8n, session):
    """A restart as observed on real n8n: each phase is an outage, then the workflow answers."""
    for mode in ("starting_up", "express_404", "v2_not_registered"):
        n8n.mode = mode
        assert raises(R, lambda: trigger(n8n, session)).outage
    n8n.mode = "ok"
    out = trigger(n8n, session)
    assert isinstance(out, Done) and out.answer.output == {"stored": 3}
    assert n8n.webhook_calls == 4


def test_sync_call_cut_after_send_is_unknown(n8n, session):
    n8n.mode = "cut"
    err = raises(U, lambda: trigger(n8n, session))
    assert not err.outage and "may have run" in err.message and n8n.webhook_calls == 1


def test_sync_call_past_its_timeout_is_unknown(n8n, session):
    n8n.mode, n8n.hold_s = "hold", 2.0
    started = time.monotonic()
    err = raises(U, lambda: trigger(n8n, session, timeout_s=0.5))
    assert time.monotonic() - started < 1.8
    assert not err.outage and "did not answer within 0.5 s after the call was sent" in err.message


def test_nothing_listening_is_an_outage(session):
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}/webhook/{PATH}"
    err = raises(R, lambda: get_connector("n8n").trigger(stage(url), session))
    assert err.outage and "was not delivered" in err.message
    err = raises(R, lambda: get_connector("n8n").poll(stage(url), {"execution_id": "5"}, session))
    assert err.outage and err.platform_ids == {"execution_id": "5"}


@pytest.mark.parametrize("mode, status, retry, outage", [
    ("error_in_workflow", 500, IDEM, False),
    ("internal", 500, U, False),
    ("bad_gateway", 502, U, False),
    ("gateway_timeout", 504, U, False),
    ("unavailable", 503, U, True),
    ("rate_limited", 429, R, True),
])
def test_webhook_statuses(n8n, session, mode, status, retry, outage):
    n8n.mode = mode
    err = raises(retry, lambda: trigger(n8n, session), HOOK_SECRET)
    assert err.status == status and err.outage is outage
    assert err.retry_after_s == (4.0 if outage else None)
    assert "<" not in err.message


def test_poll_of_an_execution_n8n_deleted_is_unknown(n8n, session):
    """An instance that does not save successful executions deletes the one the webhook answered."""
    n8n.mode = "execution"
    connector, one = get_connector("n8n"), stage(n8n.url)
    out = connector.trigger(one, session)
    assert isinstance(out, Running)
    handle = out.handle
    assert isinstance(connector.poll(one, handle, session), Running)
    n8n.executions[handle["execution_id"]] = []  # it finished and n8n deleted it before the next poll
    del n8n.executions[handle["execution_id"]]
    err = raises(U, lambda: connector.poll(one, handle, session), N8N_API_KEY)
    assert err.message.startswith(
        f"n8n deleted execution {handle['execution_id']}: save successful executions for polled flows "
        f"(EXECUTIONS_DATA_SAVE_ON_SUCCESS=all or the workflow setting)")
    assert err.platform_ids == {"execution_id": handle["execution_id"]} and not err.outage
    assert err.retryable_for(True) and not err.retryable_for(False)


def test_poll_404_without_json_is_not_a_deleted_execution(session):
    """A 404 HTML page on the API path is a wrong api_url (or the API is off), not a deleted execution."""
    with StandInHtml404() as base:
        one = stage(f"{base}/webhook/{PATH}")
        err = raises(F, lambda: get_connector("n8n").poll(one, {"execution_id": "9"}, session))
        assert "deleted" not in err.message


@pytest.mark.parametrize("exc, retry, outage", [
    (requests.ConnectionError("refused, cause unknown"), U, False),  # could be after send: assume it was
    (requests.ReadTimeout("slow"), U, False),
    (requests.ConnectTimeout("no route"), R, True),
])
def test_transport_errors_without_a_socket(mock, exc, retry, outage):
    url = "https://n8n.example/webhook/x"
    mock.post(url, body=exc)
    with requests.Session() as plain:
        err = raises(retry, lambda: get_connector("n8n").trigger(stage(url), plain))
    assert err.outage is outage


class StandInHtml404:
    """Any GET gets Express's HTML 404 page."""

    def __enter__(self) -> str:
        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_GET(self) -> None:
                body = f"<html><body><pre>Cannot GET {self.path}</pre></body></html>".encode()
                self.send_response(404)
                self.send_header("Content-Type", "text/html")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(target=self.server.serve_forever, daemon=True).start()
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def __exit__(self, *exc: Any) -> None:
        self.server.shutdown()
        self.server.server_close()
