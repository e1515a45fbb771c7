"""Stand-ins whose runs wait for a person and go on when resumed, on a real socket (tests/standins.py).

WaitingN8n (n8n-io/n8n packages/cli/src/webhooks/waiting-webhooks.ts): ``plan("wait_webhook")`` starts an
execution that waits (``waitTill`` WAIT_INDEFINITELY) at a Wait node "On Webhook Call" (POST, its
``notes`` the prompt); ``plan("wait_send")`` at a Slack "send and wait" node (``message`` the prompt,
"Approve and Disapprove"), whose link is ``/webhook-waiting/<id>/<nodeId>?approved=``; ``signed=True``
marks it ``validateSignature`` (newer n8n signs that link) and refuses unsigned calls with 401. A resume
request on a waiting execution resumes it: it runs for ``run_s`` and ends with the contract, output
``{"count", "decision", "comment"}``; the answer is ``{"message": "Workflow was started"}`` (Wait node
responding on receipt). A resume of an execution that already resumed gets n8n's 409 ("is running
already" / "has finished already"), of an unknown one 404, of a path/method it does not wait at 404.
``resumed`` counts the resumes that took, per execution. Faults: ``resume_fail`` (the next N resume calls
answer 503 without resuming), ``resume_hang_s`` (the execution resumes, the answer comes that much later).

WaitingDify (langgenius/dify service_api ``human_input_form.py``, ``workflow_events.py``): a streaming run
pauses at a human-input node whose form (``form_token`` per run, one ``comment`` input, actions ``approve``
and ``reject`` unless ``actions`` says otherwise) is announced on the stream. ``POST
/v1/form/human_input/<token>`` ``{inputs, action, user}`` resumes it: the run works ``run_s`` and succeeds
with outputs ``{"count", "action", "inputs"}``; a second submission gets 412 "Form already submitted or
expired", an unknown token 404. ``GET /v1/workflow/<run_id>/events?user=`` streams the resumed run (pings)
to ``workflow_finished``, or answers that one frame when it already ended. ``submitted`` counts accepted
submissions per run. Faults: ``submit_fail`` (next N submissions answer 503 and change nothing),
``submit_hang_s`` (the submission takes, its answer comes that much later).

WaitingCoze (coze-dev/coze-studio OpenAPI ``stream_run`` / ``stream_resume``, events as
``convertStreamRunEvent`` writes them): ``plan("question")`` makes a streaming run stop at a question
node: a ``Message`` with the question, then ``Interrupt`` (``event_id`` ``<execute_id>/1``, type 2, ``data``
``{"question"}``); its history says ``<UNSET>``. ``stream_resume`` with that event resumes it: after
``run_s`` the End node's ``Message`` (``{"count", "answer"}``, the answer being ``resume_data``) and ``Done``;
the history then says ``Success``. Resuming a run that is not interrupted answers Studio's 720701013 "is not
interrupted ... cannot resume" (HTTP 200). Other runs stream their End node's output and ``Done``.
``resumed`` counts resumes that took. Faults: ``resume_fail`` (next N resumes answer 502, nothing resumed),
``resume_hang_s`` (the resume takes; its stream starts that much later).
"""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from typing import Any

from tests.platforms import Recorded, Reply, bearer, envelope_items
from tests.standins import WAIT_INDEFINITELY, StandinCozeStudio, StandinDify, StandinN8n

REVIEW_NOTE = "Check the shortlist before the e-mails go out"


class WaitingN8n(StandinN8n):
    """StandinN8n whose executions wait for a person and resume through their waiting webhook."""

    BEHAVIOURS = (*StandinN8n.BEHAVIOURS, "wait_webhook", "wait_send")
    SEND_NODE_ID = "5d1f0c4e-node-ask"

    def __init__(self, *args: Any, signed: bool = False, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.signed = signed
        self.resumed: Counter[str] = Counter()
        self.resume_calls: list[Recorded] = []
        self.resume_fail = 0
        self.resume_hang_s = 0.0

    def route(self, req: Recorded, reply: Reply) -> None:
        if req.path.startswith("/webhook-waiting/"):
            return self._resume(req, reply)
        return super().route(req, reply)

    # the waiting webhook
    def _resume(self, req: Recorded, reply: Reply) -> None:
        parts = req.path.split("/")[2:]
        execution_id, suffix = parts[0], "/".join(parts[1:])
        with self._lock:
            self.resume_calls.append(req)
            run = self.executions.get(execution_id)
            fail = self.resume_fail > 0
            self.resume_fail -= 1 if fail else 0
        if fail:
            return reply.text(503, "Service Unavailable")
        if run is None:
            gone = f'The execution "{execution_id}" does not exist.'
            return reply.json(404, {"code": 404, "message": gone})
        if run.get("resumed_at") is not None:
            done = time.monotonic() - run["resumed_at"] >= self.run_s
            what = (f'"{execution_id} has finished already.' if done
                    else f'"{execution_id}" is running already.')
            return reply.json(409, {"code": 409, "message": f"The execution {what}"})
        behaviour = run["behaviour"]
        if behaviour == "wait_send":
            if req.method != "GET" or suffix != self.SEND_NODE_ID:
                return self._no_webhook(execution_id, reply)
            if self.signed and "signature" not in req.query:
                return reply.json(401, {"error": "Invalid token"})
            decision = {"approved": req.query.get("approved") == "true"}
        elif behaviour == "wait_webhook" and req.method == "POST" and not suffix:
            decision = req.json or {}
        else:
            return self._no_webhook(execution_id, reply)
        with self._lock:
            run.update(resumed_at=time.monotonic(), decision=decision)
            self.resumed[execution_id] += 1
        if self.resume_hang_s:
            time.sleep(self.resume_hang_s)
        reply.json(200, {"message": "Workflow was started"})

    def _no_webhook(self, execution_id: str, reply: Reply) -> None:
        reply.json(404, {"code": 404, "message": f'The workflow for execution "{execution_id}" does not '
                                                 f'contain a waiting webhook with a matching path/method.'})

    # the public API
    def _execution(self, execution_id: str, reply: Reply) -> None:
        with self._lock:
            run = self.executions.get(execution_id)
        if run is None or run["behaviour"] not in ("wait_webhook", "wait_send"):
            return super()._execution(execution_id, reply)
        with self._lock:
            self.polls[execution_id] += 1
        body = {"id": execution_id, "finished": False, "mode": "webhook", "workflowId": "wf1",
                "workflowData": {"nodes": self._nodes()}}
        node = "Review" if run["behaviour"] == "wait_webhook" else "Ask manager"
        resumed_at = run.get("resumed_at")
        if resumed_at is None:
            body.update(status="waiting", waitTill=WAIT_INDEFINITELY,
                        data={"resultData": {"runData": {}, "lastNodeExecuted": node},
                              "validateSignature": self.signed})
        elif time.monotonic() - resumed_at < self.run_s:
            body.update(status="running", waitTill=None, data={"resultData": {"runData": {}}})
        else:
            decision = run["decision"]
            word = decision.get("decision") or ("approve" if decision.get("approved") else "reject")
            answer = {"status": "succeeded", "output": {"count": len(run["items"]), "decision": word,
                                                        "comment": decision.get("comment")}}
            run_data = {"Respond": [{"data": {"main": [[{"json": answer}]]}}]}
            body.update(status="success", finished=True,
                        data={"resultData": {"lastNodeExecuted": "Respond", "runData": run_data}})
        reply.json(200, body)

    def _nodes(self) -> list[dict[str, Any]]:
        return [
            {"id": "b7c2-webhook", "name": "Webhook", "type": "n8n-nodes-base.webhook", "parameters": {}},
            {"id": "c3a9-review", "name": "Review", "type": "n8n-nodes-base.wait", "notes": REVIEW_NOTE,
             "parameters": {"resume": "webhook", "httpMethod": "POST", "options": {}}},
            {"id": self.SEND_NODE_ID, "name": "Ask manager", "type": "n8n-nodes-base.slack",
             "parameters": {"operation": "sendAndWait", "message": self.PROMPT,
                            "approvalOptions": {"values": {"approvalType": "double"}}}},
            {"id": "e5f6-respond", "name": "Respond", "type": "n8n-nodes-base.respondToWebhook",
             "parameters": {}},
        ]


class WaitingDify(StandinDify):
    """StandinDify whose paused runs resume when their human-input form is submitted (module docstring)."""

    PROMPT = "Check the extracted invoice total before it is booked"
    ACTIONS = ({"id": "approve", "title": "Approve", "button_style": "primary"},
               {"id": "reject", "title": "Reject", "button_style": "default"})

    def __init__(self, *args: Any, actions: tuple[dict[str, str], ...] = ACTIONS, **kwargs: Any) -> None:
        kwargs.setdefault("human_input", self.PROMPT)
        super().__init__(*args, **kwargs)
        self.actions = list(actions)
        self.forms: dict[str, str] = {}
        self.submitted: Counter[str] = Counter()
        self.submit_calls: list[Recorded] = []
        self.submit_fail = 0
        self.submit_hang_s = 0.0

    def route(self, req: Recorded, reply: Reply) -> None:
        mine = bearer(req) == self.api_key
        if mine and req.method == "POST" and req.path.startswith("/v1/form/human_input/"):
            return self._submit(req.path.rsplit("/", 1)[1], req, reply)
        events = req.path.startswith("/v1/workflow/") and req.path.endswith("/events")
        if mine and req.method == "GET" and events:
            return self._events(req.path.split("/")[3], req, reply)
        return super().route(req, reply)

    def _stream_ends_early(self, run_id: str, frame: Any, reply: Reply) -> None:
        token = f"form-token-{run_id}"
        with self._lock:
            self.runs[run_id]["status"] = "paused"
            self.forms[token] = run_id
        form = {"form_id": f"form-{run_id}", "node_id": "approve", "node_title": "Approve refund",
                "form_content": self.human_input, "form_token": token, "actions": self.actions,
                "inputs": [{"type": "paragraph", "output_variable_name": "comment", "default": None}],
                "resolved_default_values": {}, "expiration_time": int(time.time()) + 36 * 3600}
        frame("human_input_required", form)
        frame("workflow_paused", {"workflow_run_id": run_id, "paused_nodes": ["approve"],
                                  "reasons": [{"TYPE": "human_input_required", **form}]})
        reply.sse_close()

    def _submit(self, token: str, req: Recorded, reply: Reply) -> None:
        body = req.json or {}
        with self._lock:
            self.submit_calls.append(req)
            fail = self.submit_fail > 0
            self.submit_fail -= 1 if fail else 0
            run_id = self.forms.get(token)
            run = self.runs.get(run_id) if run_id else None
        if fail:
            return reply.text(503, "Service Unavailable")
        if run is None:
            return self._error(reply, 404, "not_found", "Form not found")
        if run["status"] != "paused":
            return self._error(reply, 412, "form_not_active", "Form already submitted or expired")
        if body.get("action") not in [a["id"] for a in self.actions] or not body.get("user"):
            return self._error(reply, 400, "invalid_param", "Invalid action or user")
        with self._lock:
            run["status"] = "running"
            self.submitted[run_id] += 1

        def finish() -> None:
            time.sleep(self.run_s)
            with self._lock:
                run.update(status="succeeded", outputs={"count": len(run["items"]), "action": body["action"],
                                                        "inputs": body.get("inputs") or {}})

        threading.Thread(target=finish, daemon=True).start()
        if self.submit_hang_s:
            time.sleep(self.submit_hang_s)
        reply.json(200, {})

    def _events(self, run_id: str, req: Recorded, reply: Reply) -> None:
        with self._lock:
            run = self.runs.get(run_id)
        if run is None or req.query.get("user") != "batchgate":
            return self._error(reply, 404, "not_found", "Workflow run not found")
        reply.sse_open()
        deadline = time.monotonic() + 10
        while True:
            with self._lock:
                status, record = run["status"], self._record(run_id, run)
            if status not in ("running", "paused") or time.monotonic() > deadline:
                break
            reply.sse("event: ping")
            time.sleep(self.ping_s)
        reply.sse("data: " + json.dumps({"event": "workflow_finished", "task_id": f"task-{run_id}",
                                          "workflow_run_id": run_id, "data": record}))
        reply.sse_close()


class WaitingCoze(StandinCozeStudio):
    """Coze Studio's streaming runs, interrupted at a question node and resumed (module docstring)."""

    PROMPT = "Which region should the report cover?"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.resumed: Counter[str] = Counter()
        self.resume_calls: list[Recorded] = []
        self.resume_fail = 0
        self.resume_hang_s = 0.0

    def route(self, req: Recorded, reply: Reply) -> None:
        if bearer(req) == self.token and req.method == "POST" and req.path == "/v1/workflow/stream_run":
            return self._stream_run(req, reply)
        if bearer(req) == self.token and req.method == "POST" and req.path == "/v1/workflow/stream_resume":
            return self._stream_resume(req, reply)
        return super().route(req, reply)

    def _frame(self, reply: Reply, seq: int, event: str, data: dict[str, Any]) -> None:
        reply.sse(f"id: {seq}\nevent: {event}\ndata: {json.dumps(data)}")

    def _stream_run(self, req: Recorded, reply: Reply) -> None:
        body = req.json or {}
        params = body.get("parameters")
        items = json.loads(params) if isinstance(params, str) else params
        execute_id, behaviour = str(next(self._seq)), self.next_behaviour()
        with self._lock:
            self.runs[execute_id] = {"status": "Running", "items": envelope_items(items),
                                     "workflow_id": body.get("workflow_id"), "behaviour": behaviour}
        self.work(0, req.headers.get("Idempotency-Key") or "?")
        reply.sse_open()
        if behaviour == "question":
            self._frame(reply, 0, "Message", {"content": self.PROMPT, "node_title": "Question",
                                              "node_seq_id": "0", "node_is_finish": True,
                                              "node_type": "Question"})
            with self._lock:
                self.runs[execute_id]["status"] = "<UNSET>"
            self._frame(reply, 1, "Interrupt", {
                "interrupt_data": {"event_id": f"{execute_id}/1", "type": 2,
                                   "data": json.dumps({"question": self.PROMPT})},
                "node_title": "Question",
                "debug_url": self.debug_url(execute_id, 1, body.get("workflow_id"))})
            return reply.sse_close()
        self._finish(execute_id, None, reply)

    def _finish(self, execute_id: str, answer: str | None, reply: Reply) -> None:
        time.sleep(self.run_s)
        with self._lock:
            run = self.runs[execute_id]
            output = {"count": len(run["items"])} | ({"answer": answer} if answer is not None else {})
            run.update(status="Success", output=json.dumps(output), error_code="0", error_msg="")
        self._frame(reply, 2, "Message", {"content": json.dumps(output), "node_title": "End",
                                          "node_seq_id": "0", "node_is_finish": True, "node_type": "End"})
        self._frame(reply, 3, "Done", {"debug_url": self.debug_url(execute_id, 1, run["workflow_id"])})
        reply.sse_close()

    def _stream_resume(self, req: Recorded, reply: Reply) -> None:
        body = req.json or {}
        execute_id = str(body.get("event_id") or "").split("/")[0]
        with self._lock:
            self.resume_calls.append(req)
            fail = self.resume_fail > 0
            self.resume_fail -= 1 if fail else 0
            run = self.runs.get(execute_id)
        if fail:
            return reply.text(502, "Bad Gateway")
        if run is None or run["status"] != "<UNSET>":
            status = run["status"] if run else "missing"
            refusal = f"workflow execution {execute_id} is not interrupted, status is {status}, cannot resume"
            return reply.json(200, {"code": 720701013, "msg": refusal})
        with self._lock:
            run["status"] = "Running"
            self.resumed[execute_id] += 1
        if self.resume_hang_s:
            time.sleep(self.resume_hang_s)
        reply.sse_open()
        self._finish(execute_id, str(body.get("resume_data")), reply)
