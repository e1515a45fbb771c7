"""Real local HTTP servers that speak the platforms' contracts, for connector tests over a socket.

Each fake listens on 127.0.0.1 on a free port in a thread, records every request it gets (``.requests``,
a list of :class:`Recorded`), and plays behaviours queued with ``plan(...)``: one per trigger request, in
order, then the default ``"ok"``. ``"ok"`` answers success with an output computed from the envelope's
items: ``{"count": len(items)}``. Polls follow the run a trigger created (``"async"``: running, then done)::

    with FakeDify(api_key="app-test") as dify:
        dify.plan("rate_limited")          # the next run request gets 429 + Retry-After: 2
        ...                                # call dify.base_url; inspect dify.requests[-1].json

Behaviours (``BEHAVIOURS`` on each class):

- every fake: ``ok``, ``rate_limited`` (429, Retry-After: 2), ``slow`` (sleeps ``slow_s`` first).
- FakeHttpPlatform: ``failed_answer`` (contract failure), ``not_contract``, ``accepted`` (202),
  ``server_error`` (502), ``unauthorized`` (401).
- FakeN8n: ``started`` (responds immediately), ``fail_in_workflow`` (500 Error in workflow),
  ``not_registered`` (404), ``running_already`` / ``finished_already`` (409), ``unauthorized`` (403),
  ``async`` / ``async_error`` (``{"executionId"}``; the execution API says running, then success / error).
- FakeDify: ``contract`` (outputs follow the answer contract), ``status_failed_200``, ``stopped_200``,
  ``async`` (running, then succeeded), ``invalid_param``, ``workflow_request_error``, ``internal_error``,
  ``stream_error`` (an SSE error frame), ``pings_only`` (pings, never ``workflow_started``). Streaming
  answers send ``workflow_started`` then ping frames until the client hangs up; the run's outcome is then
  read by polling.
- FakeCoze: ``contract``, ``code_nonzero_200`` (4013 on HTTP 200), ``not_published`` (4200),
  ``studio_auth`` (700012006 on 200), ``studio_500`` (HTTP 500 ``{code: 500}``), ``async`` / ``async_fail``
  (execute_id; run history says Running, then Success / Fail).
"""

from __future__ import annotations

import itertools
import json
import threading
import time
from collections import Counter, deque
from dataclasses import dataclass
from email.message import Message
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qsl, urlsplit

COMMON = ("ok", "rate_limited", "slow")
RETRY_AFTER_S = "2"


@dataclass
class Recorded:
    """One request a fake received."""

    method: str
    path: str
    query: dict[str, str]
    headers: Message
    body: bytes
    json: Any


class Reply:
    """Writes one response: JSON, text, or a chunked server-sent event stream."""

    def __init__(self, handler: BaseHTTPRequestHandler, extra_headers: dict[str, str]) -> None:
        self.handler = handler
        self.extra = extra_headers

    def json(self, status: int, body: Any, headers: dict[str, str] | None = None) -> None:
        self.raw(status, json.dumps(body).encode(), "application/json", headers)

    def text(self, status: int, text: str) -> None:
        self.raw(status, text.encode(), "text/plain; charset=utf-8")

    def raw(self, status: int, body: bytes, content_type: str, headers: dict[str, str] | None = None) -> None:
        self._head(status, {"Content-Type": content_type, "Content-Length": str(len(body)),
                            **(headers or {})})
        self.handler.wfile.write(body)

    def sse_open(self) -> None:
        # the stream's connection is closed after it, and said so: without "Connection: close" a client
        # reuses it for its next request, which the closing server never reads (RemoteDisconnected)
        self._head(200, {"Content-Type": "text/event-stream", "Transfer-Encoding": "chunked",
                         "Cache-Control": "no-cache", "Connection": "close"})
        self.handler.close_connection = True

    def sse(self, frame: str) -> None:
        """Send one frame (``data: {...}`` or ``event: ping``) as its own chunk."""
        data = (frame + "\n\n").encode()
        self.handler.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
        self.handler.wfile.flush()

    def sse_close(self) -> None:
        self.handler.wfile.write(b"0\r\n\r\n")

    def _head(self, status: int, headers: dict[str, str]) -> None:
        self.handler.send_response(status)
        for name, value in {**self.extra, **headers}.items():
            self.handler.send_header(name, value)
        self.handler.end_headers()


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    timeout = 10

    def _any(self) -> None:
        self.server.platform._dispatch(self)  # type: ignore[attr-defined]

    do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _any

    def log_message(self, *args: Any) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass  # clients that hang up mid-answer (timeouts, streams) are expected here


class FakePlatform:
    """A platform on a real socket; subclasses implement ``route``."""

    BEHAVIOURS: tuple[str, ...] = COMMON

    def __init__(self) -> None:
        self.requests: list[Recorded] = []
        self.slow_s = 5.0
        self._plans: deque[str] = deque()
        self._runs: dict[str, dict[str, Any]] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._stopping = threading.Event()
        self._server: _Server | None = None
        self._thread: threading.Thread | None = None

    # lifecycle
    def start(self) -> FakePlatform:
        self._server = _Server(("127.0.0.1", 0), _Handler)
        self._server.platform = self  # type: ignore[attr-defined]
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02},
                                        daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopping.set()
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._thread.join()
            self._server = None

    def __enter__(self) -> FakePlatform:
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_port}"

    @property
    def url(self) -> str:
        """Where a target points: the base URL unless the platform has a trigger URL."""
        return self.base_url

    # behaviours
    def plan(self, *behaviours: str) -> None:
        """Queue behaviours for the next trigger requests, one each, in order."""
        for name in behaviours:
            if name not in self.BEHAVIOURS:
                raise ValueError(f"{type(self).__name__} has no behaviour {name!r}; known: {self.BEHAVIOURS}")
        with self._lock:
            self._plans.extend(behaviours)

    def next_behaviour(self) -> str:
        with self._lock:
            return self._plans.popleft() if self._plans else "ok"

    def wait(self, seconds: float) -> bool:
        """Sleep, cut short by ``stop``; False when stopping."""
        return not self._stopping.wait(seconds)

    def new_run(self, statuses: list[str], **data: Any) -> str:
        """Record a run whose polls report ``statuses`` in turn (the last one sticks)."""
        run_id = f"run-{next(self._ids)}"
        with self._lock:
            self._runs[run_id] = {"statuses": deque(statuses), **data}
        return run_id

    def poll_run(self, run_id: str) -> tuple[str, dict[str, Any]] | None:
        """The next status of a run and its data, or None for an unknown run."""
        with self._lock:
            run = self._runs.get(run_id)
            if run is None:
                return None
            statuses = run["statuses"]
            return (statuses.popleft() if len(statuses) > 1 else statuses[0]), run

    def paths(self) -> list[str]:
        return [r.path for r in self.requests]

    # plumbing
    def extra_headers(self) -> dict[str, str]:
        return {}

    def route(self, req: Recorded, reply: Reply) -> None:
        raise NotImplementedError

    def _dispatch(self, handler: BaseHTTPRequestHandler) -> None:
        length = int(handler.headers.get("Content-Length") or 0)
        body = handler.rfile.read(length) if length else b""
        parts = urlsplit(handler.path)
        try:
            parsed = json.loads(body) if body else None
        except ValueError:
            parsed = None
        req = Recorded(handler.command, parts.path, dict(parse_qsl(parts.query)), handler.headers, body,
                       parsed)
        with self._lock:
            self.requests.append(req)
        try:
            self.route(req, Reply(handler, self.extra_headers()))
        except (BrokenPipeError, ConnectionResetError):
            handler.close_connection = True


def envelope_items(value: Any) -> list[Any]:
    """Items from an envelope, or from platform variables holding it (``batchgate`` JSON or ``items``)."""
    if isinstance(value, dict) and isinstance(value.get("batchgate"), str):
        value = json.loads(value["batchgate"])
    items = value.get("items") if isinstance(value, dict) else None
    return items if isinstance(items, list) else []


def contract(items: list[Any]) -> dict[str, Any]:
    """A success answer following the contract."""
    return {"status": "succeeded", "output": {"count": len(items)}, "next_cursor": None}


def bearer(req: Recorded) -> str:
    return (req.headers.get("Authorization") or "").removeprefix("Bearer ")


class FakeHttpPlatform(FakePlatform):
    """A generic endpoint at ``/hook`` that answers the contract; ``auth`` = expected Authorization value."""

    BEHAVIOURS = COMMON + ("failed_answer", "not_contract", "accepted", "server_error", "unauthorized")

    def __init__(self, auth: str | None = None) -> None:
        super().__init__()
        self.auth = auth

    @property
    def url(self) -> str:
        return f"{self.base_url}/hook"

    def route(self, req: Recorded, reply: Reply) -> None:
        if req.path != "/hook":
            return reply.text(404, "Not Found")
        if self.auth and req.headers.get("Authorization") != self.auth:
            return reply.json(401, {"error": "unauthorized"})
        behaviour = self.next_behaviour()
        if behaviour == "slow" and not self.wait(self.slow_s):
            return None
        items = envelope_items(req.json)
        replies = {
            "failed_answer": (200, {"status": "failed", "error": {"message": "item 2 is malformed",
                                                                  "retryable": False}}),
            "not_contract": (200, {"result": "fine", "count": len(items)}),
            "accepted": (202, {"accepted": True}),
            "unauthorized": (401, {"error": "unauthorized"}),
        }
        if behaviour == "rate_limited":
            return reply.json(429, {"error": "slow down"}, {"Retry-After": RETRY_AFTER_S})
        if behaviour == "server_error":
            return reply.text(502, "Bad Gateway")
        return reply.json(*replies.get(behaviour, (200, contract(items))))


class FakeN8n(FakePlatform):
    """n8n: a production webhook at ``/webhook/<path>`` and the public executions API."""

    BEHAVIOURS = COMMON + ("started", "fail_in_workflow", "not_registered", "running_already",
                           "finished_already", "unauthorized", "async", "async_error")

    def __init__(self, path: str = "batchgate", header_auth: tuple[str, str] | None = None,
                 api_key: str | None = None) -> None:
        super().__init__()
        self.path, self.header_auth, self.api_key = path, header_auth, api_key

    @property
    def url(self) -> str:
        return f"{self.base_url}/webhook/{self.path}"

    def route(self, req: Recorded, reply: Reply) -> None:
        if req.path.startswith("/api/v1/executions/"):
            return self._execution(req, reply)
        if req.path != f"/webhook/{self.path}" or req.method != "POST":
            return reply.json(404, {"code": 404, "message": f'The requested webhook "{req.method} '
                                    f'{req.path.removeprefix("/webhook/")}" is not registered.',
                                    "hint": "Click the 'Execute workflow' button on the canvas"})
        if self.header_auth and req.headers.get(self.header_auth[0]) != self.header_auth[1]:
            return reply.text(403, "Authorization data is wrong!")
        self._webhook(self.next_behaviour(), envelope_items(req.json), reply)

    def _webhook(self, behaviour: str, items: list[Any], reply: Reply) -> None:
        if behaviour == "slow" and not self.wait(self.slow_s):
            return
        if behaviour in ("async", "async_error"):
            final = "success" if behaviour == "async" else "error"
            return reply.json(200, {"executionId": self.new_run(["running", final], items=items)})
        replies = {
            "started": (200, {"message": "Workflow was started"}),
            "fail_in_workflow": (500, {"message": "Error in workflow"}),
            "not_registered": (404, {"code": 404, "message": f'The requested webhook "POST {self.path}" is '
                                     f'not registered.', "hint": "Activate the workflow"}),
            "running_already": (409, {"message": 'The execution "7" is running already.'}),
            "finished_already": (409, {"message": 'The execution "7" has finished already.'}),
        }
        if behaviour == "unauthorized":
            return reply.text(403, "Authorization data is wrong!")
        if behaviour == "rate_limited":
            return reply.json(429, {"message": "Too many requests"}, {"Retry-After": RETRY_AFTER_S})
        reply.json(*replies.get(behaviour, (200, contract(items))))

    def _execution(self, req: Recorded, reply: Reply) -> None:
        if self.api_key and req.headers.get("X-N8N-API-KEY") != self.api_key:
            return reply.json(401, {"message": "unauthorized"})
        execution_id = req.path.rsplit("/", 1)[1]
        polled = self.poll_run(execution_id)
        if polled is None:
            return reply.json(404, {"message": "Not Found"})
        status, run = polled
        result: dict[str, Any] = {"runData": {}}
        if status == "success":
            node = {"data": {"main": [[{"json": contract(run["items"])}]]}}
            result = {"runData": {"Webhook": [{"data": {"main": [[{"json": {}}]]}}], "Answer": [node]},
                      "lastNodeExecuted": "Answer"}
        elif status == "error":
            result["error"] = {"message": "Cannot read properties of undefined", "node": {"name": "Code"}}
        reply.json(200, {"id": execution_id, "finished": status in ("success", "error"), "mode": "webhook",
                         "status": status, "workflowId": "wf1", "data": {"resultData": result}})


class FakeDify(FakePlatform):
    """Dify workflow app API: ``/v1/workflows/run`` (blocking or streaming) and run polling."""

    BEHAVIOURS = COMMON + ("contract", "status_failed_200", "stopped_200", "async", "invalid_param",
                           "workflow_request_error", "internal_error", "stream_error", "pings_only")
    ERRORS = {
        "rate_limited": (429, "too_many_requests", "Too many requests. Please try again later."),
        "invalid_param": (400, "invalid_param", "batchgate is required in input form"),
        "workflow_request_error": (400, "workflow_request_error", "Node Code failed"),
        "internal_error": (500, "internal_server_error", "The server encountered an internal error."),
    }
    FINAL = {"status_failed_200": "failed", "stopped_200": "stopped"}

    def __init__(self, api_key: str = "app-fake-key") -> None:
        super().__init__()
        self.api_key = api_key
        self.stream_s = 3.0
        #: tokens billed per item of a finished run (0: bills nothing, as before); price per token
        self.tokens_per_item = 0
        self.price_per_token = 0.0002
        self.billed: list[tuple[str, int, str]] = []  # (run id, tokens, price) of every run billed

    def route(self, req: Recorded, reply: Reply) -> None:
        if bearer(req) != self.api_key:
            return reply.json(401, {"code": "unauthorized", "message": "Access token is invalid",
                                    "status": 401})
        if req.method == "GET" and req.path.startswith("/v1/workflows/run/"):
            return self._poll(req.path.rsplit("/", 1)[1], reply)
        if req.method != "POST" or not (req.path == "/v1/workflows/run" or req.path.endswith("/run")):
            return reply.json(404, {"code": "not_found", "message": "Not Found", "status": 404})
        behaviour = self.next_behaviour()
        if behaviour == "slow" and not self.wait(self.slow_s):
            return None
        if behaviour in self.ERRORS:
            status, code, message = self.ERRORS[behaviour]
            headers = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
            return reply.json(status, {"code": code, "message": message, "status": status}, headers)
        items = envelope_items((req.json or {}).get("inputs"))
        final = self.FINAL.get(behaviour, "succeeded")
        statuses = ["running", "succeeded"] if behaviour == "async" else [final]
        run_id = self.new_run(statuses, items=items, contract=behaviour == "contract")
        if (req.json or {}).get("response_mode") == "streaming":
            return self._stream(run_id, behaviour, reply)
        status, run = self.poll_run(run_id)
        reply.json(200, {"workflow_run_id": run_id, "task_id": f"task-{run_id}",
                         "data": self._record(run_id, status, run)})

    def _record(self, run_id: str, status: str, run: dict[str, Any]) -> dict[str, Any]:
        outputs = None
        if status == "succeeded":
            outputs = contract(run["items"]) if run["contract"] else {"count": len(run["items"])}
        error = "Node LLM run failed: quota" if status == "failed" else None
        record = {"id": run_id, "workflow_id": "wf-1", "status": status, "outputs": outputs, "error": error,
                  "elapsed_time": 0.1, "total_tokens": 0, "total_steps": 2, "created_at": int(time.time())}
        if self.tokens_per_item and status in ("succeeded", "failed"):
            tokens = self.tokens_per_item * max(len(run["items"]), 1)
            price = f"{tokens * self.price_per_token:.7f}"
            with self._lock:
                if run_id not in {b[0] for b in self.billed}:
                    self.billed.append((run_id, tokens, price))
            record.update(total_tokens=tokens, total_price=price, currency="USD")
        return record

    def _poll(self, run_id: str, reply: Reply) -> None:
        polled = self.poll_run(run_id)
        if polled is None:
            return reply.json(404, {"code": "not_found", "message": "Workflow run not found", "status": 404})
        reply.json(200, self._record(run_id, *polled))

    def _stream(self, run_id: str, behaviour: str, reply: Reply) -> None:
        reply.sse_open()
        task = f"task-{run_id}"
        if behaviour == "stream_error":
            reply.sse("data: " + json.dumps({"event": "error", "task_id": task, "status": 400,
                                              "message": "quota", "code": "provider_quota_exceeded"}))
            return reply.sse_close()
        if behaviour != "pings_only":
            reply.sse("data: " + json.dumps({"event": "workflow_started", "task_id": task,
                                              "workflow_run_id": run_id,
                                              "data": {"id": run_id, "workflow_id": "wf-1"}}))
        deadline = time.monotonic() + self.stream_s
        while time.monotonic() < deadline and self.wait(0.05):
            reply.sse("event: ping")
        reply.sse_close()


class FakeCoze(FakePlatform):
    """Coze OpenAPI: ``/v1/workflow/run`` and run history (Coze Studio's endpoint when ``studio``)."""

    BEHAVIOURS = COMMON + ("contract", "code_nonzero_200", "not_published", "studio_auth", "studio_500",
                           "async", "async_fail")
    CODES = {
        "code_nonzero_200": (200, 4013, "model error, please retry later"),
        "not_published": (200, 4200, "workflow not found or not published"),
        "studio_auth": (200, 700012006, "authentication failed"),
        "studio_500": (500, 500, "internal error"),
        "rate_limited": (429, 4020, "RPM exceeded"),
    }

    def __init__(self, token: str = "pat_fake_token", studio: bool = False) -> None:
        super().__init__()
        self.token, self.studio = token, studio
        self._logs = itertools.count(1)

    def extra_headers(self) -> dict[str, str]:
        return {"X-Tt-Logid": f"log-{next(self._logs)}"}

    def debug_url(self, execute_id: str) -> str:
        return f"https://www.coze.com/work_flow?execute_id={execute_id}"

    def route(self, req: Recorded, reply: Reply) -> None:
        if bearer(req) != self.token:
            if self.studio:
                return reply.json(200, {"code": 700012006, "msg": "authentication failed"})
            return reply.json(401, {"code": 4100, "msg": "authentication is invalid"})
        if req.method == "POST" and req.path == "/v1/workflow/run":
            return self._run(req, reply)
        history = "/v1/workflow/get_run_history" if self.studio else "/v1/workflows/"
        if req.method == "GET" and req.path.startswith(history):
            execute_id = req.query.get("execute_id") if self.studio else req.path.rsplit("/", 1)[1]
            return self._history(execute_id or "", reply)
        reply.json(404, {"code": 4000, "msg": "Not Found"})

    def _run(self, req: Recorded, reply: Reply) -> None:
        behaviour = self.next_behaviour()
        if behaviour == "slow" and not self.wait(self.slow_s):
            return None
        if behaviour in self.CODES:
            status, code, msg = self.CODES[behaviour]
            headers = {"Retry-After": RETRY_AFTER_S} if status == 429 else None
            return reply.json(status, {"code": code, "msg": msg}, headers)
        body = req.json or {}
        items = envelope_items(body.get("parameters"))
        if body.get("is_async"):
            final = "Fail" if behaviour == "async_fail" else "Success"
            execute_id = self.new_run(["Running", final], items=items)
            return reply.json(200, {"code": 0, "msg": "", "execute_id": execute_id,
                                    "debug_url": self.debug_url(execute_id)})
        output = contract(items) if behaviour == "contract" else {"count": len(items)}
        reply.json(200, {"code": 0, "msg": "", "data": json.dumps(output),
                         "debug_url": self.debug_url("sync"),
                         "usage": {"input_count": 1, "output_count": 1, "token_count": 2}})

    def _history(self, execute_id: str, reply: Reply) -> None:
        polled = self.poll_run(execute_id)
        if polled is None:
            return reply.json(200, {"code": 4314, "msg": "execute record not found"})
        status, run = polled
        record = {"execute_id": execute_id, "execute_status": status, "debug_url": self.debug_url(execute_id),
                  "error_code": "0", "error_message": "", "output": ""}
        if status == "Success":
            record["output"] = json.dumps({"Output": json.dumps({"count": len(run["items"])})})
        elif status == "Fail":
            record.update(error_code="5000", error_message="node LLM failed")
        reply.json(200, {"code": 0, "msg": "", "data": [record]})


def respond(handler: BaseHTTPRequestHandler, status: int, body: Any = b"",
            content_type: str = "application/json") -> None:
    """Answer a request: ``body`` as JSON, or bytes as they are."""
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    handler.send_response(status)
    if data:
        handler.send_header("Content-Type", content_type)
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


def serve_on(handler: type[BaseHTTPRequestHandler], port: int = 0) -> ThreadingHTTPServer:
    """A threaded HTTP server on 127.0.0.1 (``port`` 0: a free one; a given port may be reused at once)."""
    ThreadingHTTPServer.allow_reuse_address = True
    server = ThreadingHTTPServer(("127.0.0.1", port), handler)
    server.daemon_threads = True
    threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    return server


class SlowSyncPlatform:
    """A sync platform that takes ``delay`` seconds per call, recording arrivals and the peak in flight."""

    def __init__(self, delay: float) -> None:
        self.delay = delay
        self.arrivals: list[tuple[float, int]] = []
        self.in_flight = 0
        self.peak = 0
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.arrivals.append((time.monotonic(), body["seq"]))
                    outer.in_flight += 1
                    outer.peak = max(outer.peak, outer.in_flight)
                try:
                    time.sleep(outer.delay)
                finally:
                    # done before the answer is written: the caller can only start its next call once it
                    # has the answer, so counting down after the write let a loaded machine see one more
                    # "in flight" than batchgate ever had (the next call arrived before this thread ran on)
                    with outer.lock:
                        outer.in_flight -= 1
                respond(self, 200, {"status": "succeeded", "output": {"n": len(body["items"])}})

        ThreadingHTTPServer.request_queue_size = 256
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_port}"
        threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.02},
                         daemon=True).start()

    def seqs(self) -> list[int]:
        with self.lock:
            return [seq for _, seq in self.arrivals]

    def close(self) -> None:
        self.server.shutdown()


class OnceCallbackPlatform:
    """A callback-mode platform that, like most flows, posts each answer once and never retries.

    It accepts a call (202), works ``min_s``-``max_s`` seconds, then POSTs ``{"status": "succeeded"}``
    to the envelope's ``callback_url`` on a new connection. ``runs`` counts the paid runs per
    idempotency key; ``posted`` counts what each post met (an HTTP status, or the exception's name).
    """

    def __init__(self, min_s: float = 0.1, max_s: float = 0.8, seed: int = 7) -> None:
        import random

        import requests

        self._post = requests.post
        self._errors = requests.RequestException
        self.min_s, self.span_s = min_s, max_s - min_s
        self.runs: Counter = Counter()
        self.callback_urls: list[str] = []
        self.posted: Counter = Counter()
        self.lock = threading.Lock()
        self.rng = random.Random(seed)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_POST(self):
                env = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                with outer.lock:
                    outer.runs[env["idempotency_key"]] += 1
                    outer.callback_urls.append(env["callback_url"])
                    delay = outer.min_s + outer.rng.random() * outer.span_s
                respond(self, 202, {"accepted": True})
                threading.Timer(delay, outer.post_back, args=(env,)).start()

        self.server = serve_on(Handler, 0)
        self.url = f"http://127.0.0.1:{self.server.server_port}/hook"

    def post_back(self, env: dict) -> None:
        try:
            outcome: Any = self._post(env["callback_url"], json={"status": "succeeded",
                                                                 "output": {"seq": env["seq"]}},
                                      timeout=30).status_code
        except self._errors as exc:
            outcome = type(exc).__name__
        with self.lock:
            self.posted[outcome] += 1

    def reruns(self) -> dict[str, int]:
        """Paid runs beyond the first, per idempotency key."""
        with self.lock:
            return {key: n - 1 for key, n in self.runs.items() if n > 1}

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
