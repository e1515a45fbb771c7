"""Platform stand-ins that reproduce Dify's and Coze Studio's failure modes on a real socket.

tests/platforms.py has fakes that answer each request with a planned reply. The stand-ins here model the
*runs* behind the requests, because the failures that matter for "never pay twice" are about runs that go
on, or get stuck, after the HTTP exchange went wrong. Each counts the runs it bills per idempotency key
(``billed``, from the ``Idempotency-Key`` header), so a test can tell a lost answer from a lost run.

StandinDify (langgenius/dify service API, workflow app):

- ``POST /v1/workflows/run`` and ``/v1/workflows/{id}/run``, ``GET /v1/workflows/run/{id}``.
- A run works for ``run_s`` in a background thread, then is billed, whatever happened to the request.
- blocking: when ``blocking_cut_s`` is set and the run is longer, the gateway in front (Dify Cloud's,
  about 60 s) gives up at that time: ``cut_style`` "504" answers 504, "drop" closes the connection. The run
  still finishes, is billed and is recorded ``succeeded``.
- streaming: ``workflow_started``, ``node_started``, ``event: ping`` every ``ping_s``, ``node_finished``,
  ``workflow_finished``. The run's status is written by the request that streams it: if the client hangs
  up before ``workflow_finished`` (or ``break_after_s`` cuts the stream server-side, as a proxy would), the
  run is still billed but stays ``running`` for ever (#12798, #20237, #23654) unless
  ``sticks_on_hangup`` is False (a Dify that decouples the run from the stream).
- ``max_active``: the app's concurrent-run limit; beyond it, 429 ``too_many_requests`` with no
  Retry-After (libs/external_api.py sets none). ``published`` False: 400 ``invalid_param`` "Workflow not
  published". ``free_plan``: a pinned ``workflow_id`` gets 403 ``workflow_version_execution_not_allowed``.
  ``poll_unavailable``: polls answer 503.
- ``stream_error`` (a dict: ``code``, ``status``, ``message``): a streaming run sends ``workflow_started``,
  then after ``error_after_s`` an ``error`` frame with those fields and ends the stream. The run is billed
  and its record stays ``running`` for ever: Dify's generate pipeline writes the error frame and never
  finalizes the run (issue 15; ``base_app_generate_response_converter._error_to_stream_response``).
- ``human_input`` (the form's text): a streaming run stops at a human-input node: ``workflow_started``,
  ``human_input_required`` (``form_content``, ``node_title``; api/core/workflow/nodes/human_input/
  pause_reason.py), ``workflow_paused``, end of stream; its record says ``paused``. Billed once.

StandinN8n (n8n-io/n8n: a production webhook answering ``{"executionId"}`` through Respond to Webhook,
and the public API ``GET /api/v1/executions/{id}?includeData=true``): each webhook call starts an execution
that is billed at once per key (the workflow runs), unless the call never reached n8n. ``plan(...)``:
``ok`` (running for ``run_s``, then success with the contract); ``wait_person`` (``waiting`` with
``waitTill`` 3000-01-01, n8n's WAIT_INDEFINITELY, at a "send and wait" node whose ``message`` is the
prompt, with ``workflowData``); ``wait_long`` (``waiting`` until ``wait_long_s`` from now); ``wait_short``
(``waiting`` for ``run_s``, then success); ``db_not_ready`` (503 "Database is not ready!", no run);
``proxy_503`` (an Envoy in front: 503 "no healthy upstream", no run); ``bare_503`` (a gateway in front
gives up with a bare 503 after the call started the workflow: billed). ``polls`` counts API reads per
execution.

StandinCozeStudio (coze-dev/coze-studio OpenAPI):

- ``POST /v1/workflow/run`` (sync or ``is_async``), ``GET /v1/workflow/get_run_history``.
- Every error is HTTP 200 ``{code, msg, debug_url}``; the debug_url names the run's ``execute_id``, or
  ``execute_id=0`` when no run was created (vo.wfErr.DebugURL with no AppendDebug).
- ``published`` False: 6031 before any run. ``plan(...)`` queues what the next runs do: ``ok``;
  ``timeout`` (6023, run created, billed, history Fail); ``node_fail`` (720701013, run created, billed,
  history Fail with ``error_msg``); ``risk`` (4102, no run); ``question`` (a question node: the sync run
  is interrupted, 6039 with a zero debug_url, history status ``<UNSET>``); ``cancel`` (async run that
  ends ``Cancel``); ``slow`` (runs ``slow_run_s``: longer than ``sync_cut_s``, after which a sync call's
  connection is dropped while the run goes on and is billed).
- Records the ``version`` field of each run request in ``versions``.

StandinCoze (coze.com, as coze-py reads it): the same runs; run history at
``/v1/workflows/{workflow_id}/run_histories/{execute_id}``, whose ``output`` wraps the End node's JSON as
``{"Output": "<json>", "node_status": "{}"}`` (coze-py tests/test_workflow_run_history.py) and carries
``is_output_trimmed``; ``trimmed`` runs succeed with an End node output cut to ``trim_at`` characters.
"""

from __future__ import annotations

import itertools
import json
import select
import socket
import threading
import time
from collections import Counter
from datetime import UTC, datetime, timedelta
from typing import Any
from urllib.parse import urlencode

from tests.platforms import FakePlatform, Recorded, Reply, bearer, envelope_items


def _drop(reply: Reply) -> None:
    """Close the connection without (the rest of) an answer, as a gateway or proxy that gives up does."""
    handler = reply.handler
    handler.close_connection = True
    try:
        handler.wfile.flush()
    except OSError:
        pass
    try:
        handler.connection.shutdown(socket.SHUT_RDWR)
    except OSError:
        pass


def _client_gone(reply: Reply) -> bool:
    """Whether the client closed its end (it sends nothing after its request, so readable means EOF)."""
    conn = reply.handler.connection
    try:
        readable, _, _ = select.select([conn], [], [], 0)
        return bool(readable) and conn.recv(1, socket.MSG_PEEK) == b""
    except OSError:
        return True


class _Billing:
    """Runs in background threads, billed per idempotency key when they finish."""

    def __init__(self) -> None:
        self.billed: Counter[str] = Counter()
        self._workers: list[threading.Thread] = []
        self._billing_lock = threading.Lock()

    def work(self, seconds: float, key: str, then: Any = None) -> threading.Thread:
        """Run for ``seconds`` in the background, then bill ``key`` and call ``then()``."""
        def run() -> None:
            time.sleep(seconds)
            with self._billing_lock:
                self.billed[key] += 1
            if then is not None:
                then()

        worker = threading.Thread(target=run, daemon=True)
        with self._billing_lock:
            self._workers.append(worker)
        worker.start()
        return worker

    def settle(self, timeout_s: float = 10.0) -> None:
        """Wait until every run started so far has finished and been billed."""
        deadline = time.monotonic() + timeout_s
        with self._billing_lock:
            workers = list(self._workers)
        for worker in workers:
            worker.join(max(0.0, deadline - time.monotonic()))
            assert not worker.is_alive(), "a stand-in run did not finish"


class StandinDify(FakePlatform, _Billing):
    """A Dify workflow app whose runs outlive the requests that started them (module docstring)."""

    def __init__(self, api_key: str = "app-standin", *, run_s: float = 0.3, ping_s: float = 0.05,
                 blocking_cut_s: float | None = None, cut_style: str = "504",
                 break_after_s: float | None = None,
                 sticks_on_hangup: bool = True, max_active: int | None = None, published: bool = True,
                 free_plan: bool = False, stream_error: dict[str, Any] | None = None,
                 error_after_s: float = 0.05, human_input: str | None = None) -> None:
        FakePlatform.__init__(self)
        _Billing.__init__(self)
        self.api_key, self.run_s, self.ping_s = api_key, run_s, ping_s
        self.blocking_cut_s, self.cut_style, self.break_after_s = blocking_cut_s, cut_style, break_after_s
        self.sticks_on_hangup, self.max_active = sticks_on_hangup, max_active
        self.published, self.free_plan = published, free_plan
        self.stream_error, self.error_after_s, self.human_input = stream_error, error_after_s, human_input
        self.poll_unavailable = False
        self.break_before_started = False
        self.runs: dict[str, dict[str, Any]] = {}
        self.active = 0
        self._seq = itertools.count(1)

    # what tests look at
    def status(self, run_id: str) -> str:
        with self._lock:
            return self.runs[run_id]["status"]

    def polls(self) -> int:
        """How many run polls (``GET /v1/workflows/run/{id}``) the stand-in answered."""
        with self._lock:
            return sum(1 for r in self.requests if r.method == "GET")

    def stuck_runs(self) -> list[str]:
        """Runs billed (their work is done) whose record still says ``running``."""
        with self._lock:
            return [rid for rid, run in self.runs.items() if run["worked"] and run["status"] == "running"]

    # HTTP
    def route(self, req: Recorded, reply: Reply) -> None:
        if bearer(req) != self.api_key:
            return self._error(reply, 401, "unauthorized", "Access token is invalid")
        if req.method == "GET" and req.path.startswith("/v1/workflows/run/"):
            return self._poll(req.path.rsplit("/", 1)[1], reply)
        if req.method == "POST" and req.path.startswith("/v1/workflows/") and req.path.endswith("/run"):
            return self._run(req, reply)
        reply.json(404, {"code": "not_found", "message": "Not Found", "status": 404})

    def _error(self, reply: Reply, status: int, code: str, message: str) -> None:
        reply.json(status, {"code": code, "message": message, "status": status})  # never a Retry-After

    def _run(self, req: Recorded, reply: Reply) -> None:
        pinned = req.path != "/v1/workflows/run"
        if pinned and self.free_plan:
            return self._error(reply, 403, "workflow_version_execution_not_allowed",
                               "Workflow version execution is unavailable on the current plan.")
        if not self.published:
            return self._error(reply, 400, "invalid_param", "Workflow not published")
        with self._lock:
            if self.max_active is not None and self.active >= self.max_active:
                full = True
            else:
                full = False
                self.active += 1
        if full:
            return self._error(reply, 429, "too_many_requests", "Too many requests. Please try again later.")
        body = req.json or {}
        run_id = f"dify-run-{next(self._seq)}"
        items = envelope_items(body.get("inputs"))
        key = req.headers.get("Idempotency-Key") or "?"
        with self._lock:
            self.runs[run_id] = {"status": "running", "worked": False, "outputs": None, "items": items}
        worked = threading.Event()
        streaming = body.get("response_mode") == "streaming"

        def finished_work() -> None:
            with self._lock:
                self.runs[run_id]["worked"] = True
                self.active -= 1
            if not streaming:  # a blocking request's handler runs the generation to its end, client or not
                self._finish(run_id)
            worked.set()

        self.work(self.run_s, key, finished_work)
        if streaming:
            return self._stream(run_id, worked, reply)
        return self._blocking(run_id, worked, reply)

    def _finish(self, run_id: str) -> dict[str, Any]:
        with self._lock:
            run = self.runs[run_id]
            run.update(status="succeeded", outputs={"count": len(run["items"])})
            return self._record(run_id, run)

    def _record(self, run_id: str, run: dict[str, Any]) -> dict[str, Any]:
        return {"id": run_id, "workflow_id": "wf-standin", "status": run["status"], "outputs": run["outputs"],
                "error": None, "elapsed_time": self.run_s, "total_tokens": 10, "total_steps": 3,
                "created_at": int(time.time()), "finished_at": None}

    def _blocking(self, run_id: str, worked: threading.Event, reply: Reply) -> None:
        if not worked.wait(self.blocking_cut_s if self.blocking_cut_s is not None else 30):
            # the gateway in front gives up; the run goes on (finished_work records it)
            return _drop(reply) if self.cut_style == "drop" else reply.text(504, "upstream request timeout")
        with self._lock:
            record = self._record(run_id, self.runs[run_id])
        reply.json(200, {"workflow_run_id": run_id, "task_id": f"task-{run_id}", "data": record})

    def _stream(self, run_id: str, worked: threading.Event, reply: Reply) -> None:
        reply.sse_open()
        if self.break_before_started:
            return _drop(reply)
        task = f"task-{run_id}"
        opened = time.monotonic()

        def frame(event: str, data: dict[str, Any]) -> None:
            reply.sse("data: " + json.dumps({"event": event, "task_id": task, "workflow_run_id": run_id,
                                              "data": data}))

        try:
            frame("workflow_started", {"id": run_id, "workflow_id": "wf-standin", "created_at": int(opened)})
            frame("node_started", {"id": "n1", "node_id": "code", "node_type": "code", "title": "Score"})
            if self.stream_error is not None or self.human_input is not None:
                return self._stream_ends_early(run_id, frame, reply)
            while not worked.wait(self.ping_s):
                if self.break_after_s is not None and time.monotonic() - opened >= self.break_after_s:
                    _drop(reply)
                    raise ConnectionResetError("the proxy cut the stream")
                if _client_gone(reply):
                    raise ConnectionResetError("the client hung up")
                reply.sse("event: ping")
            if _client_gone(reply):  # the next yield would fail: the outcome is never written
                raise ConnectionResetError("the client hung up")
            frame("node_finished", {"id": "n1", "node_id": "code", "status": "succeeded"})
            frame("workflow_finished", self._finish(run_id))  # the streaming request writes the outcome
            reply.sse_close()
        except (BrokenPipeError, ConnectionResetError, OSError):
            # the client (or a proxy) hung up: the run goes on and is billed, its record is never updated
            if not self.sticks_on_hangup:
                worked.wait(30)
                self._finish(run_id)
            reply.handler.close_connection = True

    def _stream_ends_early(self, run_id: str, frame: Any, reply: Reply) -> None:
        """An error frame, or a pause at a human-input node, then the end of the stream."""
        if self.human_input is not None:
            with self._lock:
                self.runs[run_id]["status"] = "paused"
            form = {"form_id": f"form-{run_id}", "node_id": "approve", "node_title": "Approve refund",
                    "form_content": self.human_input, "inputs": [], "actions": [{"id": "ok", "title": "OK"}],
                    "form_token": "tok", "expiration_time": int(time.time()) + 36 * 3600}
            frame("human_input_required", form)
            frame("workflow_paused", {"workflow_run_id": run_id, "paused_nodes": ["approve"],
                                      "reasons": [{"TYPE": "human_input_required", **form}]})
            return reply.sse_close()
        time.sleep(self.error_after_s)
        reply.sse("data: " + json.dumps({"event": "error", "task_id": f"task-{run_id}",
                                          "workflow_run_id": run_id, **(self.stream_error or {})}))
        reply.sse_close()  # the run goes on, is billed, and its record is never finalized

    def _poll(self, run_id: str, reply: Reply) -> None:
        if self.poll_unavailable:
            return reply.text(503, "Service Unavailable")
        with self._lock:
            run = self.runs.get(run_id)
            record = self._record(run_id, run) if run else None
        if record is None:
            return self._error(reply, 404, "not_found", "Workflow run not found")
        reply.json(200, record)


class StandinCozeStudio(FakePlatform, _Billing):
    """Coze Studio's workflow OpenAPI with its codes, debug_urls and run history (module docstring)."""

    BEHAVIOURS = ("ok", "timeout", "node_fail", "risk", "question", "cancel", "slow", "trimmed")

    def __init__(self, token: str = "pat_standin", *, run_s: float = 0.05, sync_cut_s: float = 0.5,
                 slow_run_s: float = 0.8, published: bool = True,
                 host: str = "http://studio.example") -> None:
        FakePlatform.__init__(self)
        _Billing.__init__(self)
        self.token, self.run_s, self.sync_cut_s, self.slow_run_s = token, run_s, sync_cut_s, slow_run_s
        self.published, self.host = published, host
        self.versions: list[Any] = []
        self.runs: dict[str, dict[str, Any]] = {}
        self._seq = itertools.count(7_500_000_000_000_000_001)

    def debug_url(self, execute_id: int | str = 0, space_id: int = 0, workflow_id: int | str = 0) -> str:
        query = urlencode({"execute_id": execute_id, "execute_mode": 2, "space_id": space_id,
                           "workflow_id": workflow_id})
        return f"{self.host}/work_flow?{query}"

    def route(self, req: Recorded, reply: Reply) -> None:
        if bearer(req) != self.token:
            return reply.json(200, {"code": 700012006, "msg": "authentication failed",
                                    "debug_url": self.debug_url()})
        if req.method == "POST" and req.path == "/v1/workflow/run":
            return self._run(req, reply)
        if req.method == "GET" and req.path == "/v1/workflow/get_run_history":
            return self._history(req.query.get("execute_id", ""), reply)
        reply.json(404, {"code": 4000, "msg": "Not Found"})

    def _error(self, reply: Reply, code: int, msg: str, execute_id: int | str = 0,
               workflow_id: Any = 0) -> None:
        reply.json(200, {"code": code, "msg": msg,
                         "debug_url": self.debug_url(execute_id, 1 if execute_id else 0, workflow_id)})

    def _run(self, req: Recorded, reply: Reply) -> None:
        body = req.json or {}
        self.versions.append(body.get("version"))
        workflow_id = body.get("workflow_id")
        if not self.published:
            return self._error(reply, 6031, "Workflow not published. The requested operation cannot "
                                            "be performed on an unpublished workflow. Please publish the "
                                            "workflow and try again.")
        behaviour = self.next_behaviour()
        if behaviour == "risk":
            return self._error(reply, 4102, "risk control: please retry later")
        key = req.headers.get("Idempotency-Key") or "?"
        params = body.get("parameters")
        items = envelope_items(json.loads(params) if isinstance(params, str) else params)
        execute_id = str(next(self._seq))
        final = {"timeout": "Fail", "node_fail": "Fail", "question": "<UNSET>",
                 "cancel": "Cancel"}.get(behaviour, "Success")
        errors = {"timeout": ("720702085", "Workflow execution timed out."),
                  "node_fail": ("720701013", "Workflow execution failure: Code node: division by zero"),
                  "cancel": ("777777777", "workflow cancel by user")}
        code, message = errors.get(behaviour, ("0", ""))
        with self._lock:
            self.runs[execute_id] = {"status": "Running", "items": items, "workflow_id": workflow_id,
                                     "behaviour": behaviour}
        finished = threading.Event()

        def done() -> None:
            output = json.dumps({"count": len(items)}) if final == "Success" else ""
            with self._lock:
                self.runs[execute_id].update(status=final, error_code=code, error_msg=message, output=output)
            finished.set()

        self.work(self.slow_run_s if behaviour == "slow" else self.run_s, key, done)
        if body.get("is_async"):
            return reply.json(200, {"code": 0, "msg": "", "execute_id": execute_id,
                                    "debug_url": self.debug_url(execute_id, 1, workflow_id)})
        if not finished.wait(self.sync_cut_s):
            return _drop(reply)  # the sync connection is cut (90 s on Coze); the run goes on
        if behaviour == "timeout":
            return self._error(reply, 6023, "Workflow execution timed out. Please check for long-running "
                                            "operations, optimize if possible, or retry later.",
                               execute_id, workflow_id)
        if behaviour == "node_fail":
            return self._error(reply, 720701013, message, execute_id, workflow_id)
        if behaviour == "question":
            # SyncExecute returns the interrupted run; OpenAPIRun answers NewError(ErrInterruptNotSupported)
            # without AppendDebug: a debug_url full of zeros
            return self._error(reply, 6039, "Synchronous requests do not support interruption. Please switch "
                                            "to asynchronous requests for interruptible operations.")
        with self._lock:
            output = self.runs[execute_id]["output"]
        reply.json(200, {"code": 0, "msg": "", "data": output, "execute_id": execute_id,
                         "debug_url": self.debug_url(execute_id, 1, workflow_id), "token": 10,
                         "cost": "0.00000"})

    def _history(self, execute_id: str, reply: Reply) -> None:
        with self._lock:
            run = dict(self.runs.get(execute_id) or {})
        if not run:
            return reply.json(200, {"code": 4314, "msg": "execute record not found"})
        record = {"execute_id": int(execute_id), "execute_status": run["status"], "bot_id": 0,
                  "connector_id": 1024, "connector_uid": "1", "run_mode": 0, "log_id": "log-studio",
                  "debug_url": self.debug_url(execute_id, 1, run["workflow_id"]), "input": "{}",
                  "output": run.get("output", ""), "token": 10, "cost": "0.00000",
                  "error_code": run.get("error_code", ""), "error_msg": run.get("error_msg", "")}
        reply.json(200, {"code": 0, "msg": "", "data": [record]})


class StandinCoze(StandinCozeStudio):
    """coze.com's workflow OpenAPI as coze-py reads it: run history wraps the output (module docstring)."""

    def __init__(self, token: str = "pat_standin", *, trim_at: int = 40, **kwargs: Any) -> None:
        super().__init__(token, **kwargs)
        self.trim_at = trim_at

    def route(self, req: Recorded, reply: Reply) -> None:
        if bearer(req) == self.token and req.method == "GET" and "/run_histories/" in req.path:
            return self._cloud_history(req.path.rsplit("/", 1)[1], reply)
        return super().route(req, reply)

    def _cloud_history(self, execute_id: str, reply: Reply) -> None:
        with self._lock:
            run = dict(self.runs.get(execute_id) or {})
        if not run:
            return reply.json(200, {"code": 4314, "msg": "execute record not found"})
        end_output, trimmed = run.get("output", ""), False
        if run["status"] == "Success" and run["behaviour"] == "trimmed":
            end_output = json.dumps({"count": len(run["items"]), "rows": ["x" * 64] * 64})[:self.trim_at]
            trimmed = True
        output = json.dumps({"Output": end_output, "node_status": "{}"}) if run["status"] == "Success" else ""
        record = {"execute_id": execute_id, "execute_status": run["status"], "bot_id": "0",
                  "connector_id": "1024", "connector_uid": "1", "run_mode": 2, "logid": "log-coze",
                  "create_time": int(time.time()), "update_time": int(time.time()),
                  "debug_url": self.debug_url(execute_id, 1, run["workflow_id"]), "output": output,
                  "error_code": run.get("error_code", "0"), "error_message": run.get("error_msg", ""),
                  "is_output_trimmed": trimmed, "node_execute_status": {}}
        reply.json(200, {"code": 0, "msg": "", "data": [record]})


WAIT_INDEFINITELY = "3000-01-01T00:00:00.000Z"


class StandinN8n(FakePlatform, _Billing):
    """n8n behind a webhook that answers ``{"executionId"}``, with its executions API (module docstring)."""

    BEHAVIOURS = ("ok", "wait_person", "wait_long", "wait_short", "db_not_ready", "proxy_503", "bare_503")
    PROMPT = "Approve the refund of order 1042?"

    def __init__(self, api_key: str = "n8n-standin", *, run_s: float = 0.3, wait_long_s: float = 3600,
                 path: str = "batchgate") -> None:
        FakePlatform.__init__(self)
        _Billing.__init__(self)
        self.api_key, self.run_s, self.wait_long_s, self.path = api_key, run_s, wait_long_s, path
        self.executions: dict[str, dict[str, Any]] = {}
        self.polls: Counter[str] = Counter()
        self._seq = itertools.count(101)

    @property
    def url(self) -> str:
        return f"{self.base_url}/webhook/{self.path}"

    def route(self, req: Recorded, reply: Reply) -> None:
        if req.method == "GET" and req.path.startswith("/api/v1/executions/"):
            if req.headers.get("X-N8N-API-KEY") != self.api_key:
                return reply.json(401, {"message": "Unauthorized"})
            return self._execution(req.path.rsplit("/", 1)[1], reply)
        if req.method != "POST" or req.path != f"/webhook/{self.path}":
            return reply.json(404, {"code": 404, "message": "The requested webhook is not registered."})
        behaviour = self.next_behaviour()
        if behaviour == "db_not_ready":
            return reply.json(503, {"code": 503, "message": "Database is not ready!"})
        if behaviour == "proxy_503":
            return reply.text(503, "no healthy upstream")
        execution_id = str(next(self._seq))
        items = envelope_items(req.json)
        with self._lock:
            self.executions[execution_id] = {"behaviour": behaviour, "started": time.monotonic(),
                                             "items": items}
        self.work(0, req.headers.get("Idempotency-Key") or "?")  # the workflow runs: billed
        if behaviour == "bare_503":
            return reply.text(503, "Service Unavailable")
        reply.json(200, {"executionId": execution_id})

    def _execution(self, execution_id: str, reply: Reply) -> None:
        with self._lock:
            run = self.executions.get(execution_id)
            self.polls[execution_id] += 1
        if run is None:
            return reply.json(404, {"message": "Not Found"})
        behaviour, elapsed = run["behaviour"], time.monotonic() - run["started"]
        body: dict[str, Any] = {"id": execution_id, "finished": False, "mode": "webhook",
                                "workflowId": "wf1", "status": "running", "waitTill": None,
                                "data": {"resultData": {"runData": {}}}}
        if behaviour == "wait_person":
            body.update(status="waiting", waitTill=WAIT_INDEFINITELY,
                        data={"resultData": {"runData": {}, "lastNodeExecuted": "Ask manager"}},
                        workflowData={"nodes": [{"name": "Ask manager", "type": "n8n-nodes-base.slack",
                                                 "parameters": {"operation": "sendAndWait",
                                                                "message": self.PROMPT}}]})
        elif behaviour == "wait_long":
            until = datetime.now(UTC) + timedelta(seconds=self.wait_long_s)
            body.update(status="waiting", waitTill=until.isoformat().replace("+00:00", "Z"),
                        data={"resultData": {"runData": {}, "lastNodeExecuted": "Wait"}})
        elif elapsed < self.run_s:
            if behaviour == "wait_short":
                until = datetime.now(UTC) + timedelta(seconds=self.run_s - elapsed)
                body.update(status="waiting", waitTill=until.isoformat().replace("+00:00", "Z"))
        else:
            answer = {"status": "succeeded", "output": {"count": len(run["items"])}}
            run_data = {"Respond": [{"data": {"main": [[{"json": answer}]]}}]}
            body.update(status="success", finished=True,
                        data={"resultData": {"lastNodeExecuted": "Respond", "runData": run_data}})
        reply.json(200, body)
