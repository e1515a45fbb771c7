"""A Python client for batchgate's HTTP API; the ``batchgate`` CLI is built on it.

    from gateway.client import Client, Problem

    bg = Client.discover()                      # BATCHGATE_URL/TOKEN, else the `batchgate up` running here
    bg.apply_flow(yaml.safe_load(open("flow.yaml")))
    job = bg.create_job("resume-screening", params={"role": "data engineer"}, idempotency_key="run-7")
    while (lease := bg.lease(job["job_id"])) is not None:
        bg.complete(job["job_id"], lease["seq"], lease["lease_token"], {"scores": score(lease["items"])})
    bg.wait(job["job_id"])

Every answer is the API's JSON (typed below where it helps an editor); a problem answer (RFC 9457) raises
:class:`Problem` carrying ``status``, ``type``, ``title``, ``detail`` and ``errors`` (each
``{field, message}``); a gateway that cannot be reached raises :class:`Unreachable`. The client holds one
``requests.Session`` (keep-alive), retries nothing on its own (the API's idempotency rules are the
caller's: pass ``idempotency_key`` to ``create_job``), and never logs or shows its token.

It imports nothing of the server: a program that only talks to batchgate needs ``requests`` alone.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypedDict
from urllib.parse import quote, urlencode

import requests

TERMINAL = frozenset({"succeeded", "failed", "cancelled"})
UP_RECORD = "up.json"  # what `batchgate up` writes in its data dir: {"url", "token_file", "pid"}
DEFAULT_DATA_DIR = ".batchgate"


class Problem(Exception):
    """The API answered with a problem (4xx/5xx)."""

    def __init__(self, status: int, body: dict[str, Any] | None, text: str = "") -> None:
        body = body if isinstance(body, dict) else {}
        self.status = status
        self.body = body
        self.type = str(body.get("type") or "about:blank")
        self.title = str(body.get("title") or "")
        self.detail = str(body.get("detail") or text[:500] or self.title or f"HTTP {status}")
        self.errors: list[dict[str, Any]] = [e for e in body.get("errors") or [] if isinstance(e, dict)]
        super().__init__(str(self))

    @property
    def slug(self) -> str:
        """The problem type's last part (``quota-exceeded``, ``invalid-request``, ...)."""
        return self.type.rstrip("/").rsplit("/", 1)[-1]

    def __str__(self) -> str:
        lines = [f"{self.status} {self.detail}"]
        for err in self.errors:
            where = err.get("field") or err.get("loc") or ""
            lines.append(f"  - {where}: {err.get('message') or err.get('msg') or err}" if where
                         else f"  - {err.get('message') or err}")
        return "\n".join(lines)


class Unreachable(Exception):
    """No answer from the gateway (refused, timed out, DNS)."""


class Lease(TypedDict, total=False):
    job_id: str
    seq: int
    stage: str
    stage_index: int
    attempt: int
    idempotency_key: str
    cursor: Any
    end_cursor: Any
    items: list[Any] | None
    input: Any
    params: dict[str, Any]
    lease_token: str
    lease_deadline: str


class Job(TypedDict, total=False):
    job_id: str
    status: str
    flow: dict[str, Any]
    committed_cursor: Any
    batches: dict[str, int]
    items_done: int
    items_total: int | None
    progress: float | None
    error: str | None
    waiting: dict[str, Any] | None


@dataclass
class Page:
    """One page of a listing and the path of the next (None on the last page)."""

    items: list[dict[str, Any]]
    next: str | None


@dataclass(frozen=True)
class Found:
    """Where :meth:`Client.discover` found the gateway and the token (for messages; never the token)."""

    url: str
    url_from: str
    token_from: str | None


class Client:
    """Bearer-authenticated JSON calls to one gateway."""

    def __init__(self, base_url: str, token: str | None = None, timeout: float = 30.0,
                 session: requests.Session | None = None) -> None:
        self.base = base_url.rstrip("/")
        self.timeout = timeout
        self.session = session or requests.Session()
        self.found: Found | None = None
        self._last_lease_status: str | None = None
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def __repr__(self) -> str:  # never the token
        return f"Client({self.base!r})"

    # -- finding the gateway --------------------------------------------------------------------

    @classmethod
    def discover(cls, url: str | None = None, token: str | None = None, data_dir: str | Path | None = None,
                 environ: dict[str, str] | None = None) -> Client:
        """A client for the gateway the caller means, in this order: the arguments;
        ``BATCHGATE_URL`` (else ``BATCHGATE_PUBLIC_URL``) and ``BATCHGATE_TOKEN``; the record a running
        ``batchgate up`` keeps in its data dir (``data_dir``, else ``BATCHGATE_DATA_DIR``, else
        ``./.batchgate``); the last ``up`` this user started, wherever its data dir is."""
        env = os.environ if environ is None else environ
        url_from = "--url"
        token_from = "--token" if token else None
        if not url:
            for name in ("BATCHGATE_URL", "BATCHGATE_PUBLIC_URL"):
                if env.get(name):
                    url, url_from = env[name], name
                    break
        if not token and env.get("BATCHGATE_TOKEN"):
            token, token_from = env["BATCHGATE_TOKEN"], "BATCHGATE_TOKEN"
        if not url or not token:
            for record, where in _up_records(data_dir or env.get("BATCHGATE_DATA_DIR"), env):
                if not url and record.get("url"):
                    url, url_from = record["url"], where
                if not token and record.get("token_file"):
                    try:
                        token = Path(record["token_file"]).read_text().strip() or None
                        token_from = record["token_file"] if token else None
                    except OSError:
                        pass
                if url and token:
                    break
        if not url:
            host, port = env.get("BATCHGATE_HOST", "127.0.0.1"), env.get("BATCHGATE_PORT", "8080")
            url, url_from = f"http://{host}:{port}", "the default address"
        client = cls(url, token)
        client.found = Found(client.base, url_from, token_from)
        return client

    # -- the calls --------------------------------------------------------------------------------

    def call(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
             params: dict[str, Any] | None = None) -> Any:
        """One request; the JSON answer (None for 204), or Problem / Unreachable."""
        return self.request(method, path, body, headers, params)[0]

    def request(self, method: str, path: str, body: Any = None, headers: dict[str, str] | None = None,
                params: dict[str, Any] | None = None) -> tuple[Any, requests.Response]:
        if params:
            query = urlencode({k: v for k, v in params.items() if v is not None})
            path = f"{path}?{query}" if query else path
        try:
            resp = self.session.request(method, self.base + path, json=body, headers=headers,
                                        timeout=self.timeout)
        except requests.RequestException as exc:
            raise Unreachable(f"cannot reach batchgate at {self.base} ({type(exc).__name__})") from None
        try:
            data = resp.json() if resp.content else None
        except ValueError:
            data = None
        if resp.status_code >= 400:
            raise Problem(resp.status_code, data, resp.text)
        return (None if resp.status_code == 204 else data), resp

    # flows
    def apply_flow(self, flow: dict[str, Any]) -> dict[str, Any]:
        """Register a flow version (201 new, 200 identical): the flow record."""
        return self.call("POST", "/v1/flows", flow)

    def flows(self) -> list[dict[str, Any]]:
        return self.call("GET", "/v1/flows")["flows"]

    def flow(self, flow_id: str, version: str | None = None) -> dict[str, Any]:
        path = f"/v1/flows/{_q(flow_id)}" + (f"/versions/{_q(version)}" if version else "")
        return self.call("GET", path)

    def retire_flow(self, flow_id: str, version: str) -> None:
        self.call("DELETE", f"/v1/flows/{_q(flow_id)}/versions/{_q(version)}")

    # jobs
    def create_job(self, flow_id: str, flow_version: str | None = None, params: dict[str, Any] | None = None,
                   source: dict[str, Any] | None = None, idempotency_key: str | None = None,
                   sink: dict[str, Any] | None = None) -> Job:
        """Start a job; ``sink`` (README "Result sinks") overrides the flow's result sink."""
        body: dict[str, Any] = {"flow_id": flow_id}
        for key, value in (("flow_version", flow_version), ("params", params), ("source", source),
                           ("sink", sink)):
            if value is not None:
                body[key] = value
        headers = {"Idempotency-Key": idempotency_key} if idempotency_key else None
        return self.call("POST", "/v1/jobs", body, headers)

    def plan_job(self, flow_id: str, flow_version: str | None = None, params: dict[str, Any] | None = None,
                 source: dict[str, Any] | None = None) -> dict[str, Any]:
        """A dry run: batches, calls per stage, expected duration and cost, each with how sure it is; no
        job is created and no platform called."""
        body: dict[str, Any] = {"flow_id": flow_id, "dry_run": True}
        for key, value in (("flow_version", flow_version), ("params", params), ("source", source)):
            if value is not None:
                body[key] = value
        return self.call("POST", "/v1/jobs", body)

    def job(self, job_id: str) -> Job:
        return self.call("GET", f"/v1/jobs/{_q(job_id)}")

    def cost(self, job_id: str) -> dict[str, Any]:
        """The job's cost ledger: calls, paid and redone calls, tokens, price, per stage."""
        return self.job(job_id)["cost"]

    def jobs_page(self, status: str | None = None, flow_id: str | None = None, flow_version: str | None = None,
                  created_after: Any = None, created_before: Any = None, order: str | None = None,
                  limit: int | None = None, cursor_path: str | None = None) -> Page:
        """One page of the tenant's jobs (``cursor_path``: a page's ``next``)."""
        if cursor_path:
            data = self.call("GET", cursor_path)
        else:
            data = self.call("GET", "/v1/jobs", params={
                "status": status, "flow_id": flow_id, "flow_version": flow_version,
                "created_after": created_after, "created_before": created_before, "order": order,
                "limit": limit})
        return Page(data["jobs"], data.get("next"))

    def jobs(self, **filters: Any) -> Iterator[Job]:
        """Every job matching ``filters`` (as :meth:`jobs_page`), page after page."""
        page = self.jobs_page(**filters)
        while True:
            yield from page.items
            if not page.next:
                return
            page = self.jobs_page(cursor_path=page.next)

    def batches(self, job_id: str, status: str | None = None, after: int | None = None,
                limit: int | None = None) -> list[dict[str, Any]]:
        return self.call("GET", f"/v1/jobs/{_q(job_id)}/batches",
                         params={"status": status, "after": after, "limit": limit})["batches"]

    def batch(self, job_id: str, seq: int) -> dict[str, Any]:
        return self.call("GET", f"/v1/jobs/{_q(job_id)}/batches/{int(seq)}")

    def log(self, job_id: str, after: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        return self.call("GET", f"/v1/jobs/{_q(job_id)}/log", params={"after": after, "limit": limit})["entries"]

    def audit(self, job_id: str, after: str | None = None, limit: int | None = None) -> list[dict[str, Any]]:
        return self.call("GET", f"/v1/jobs/{_q(job_id)}/audit",
                         params={"after": after, "limit": limit})["entries"]

    def pause(self, job_id: str) -> dict[str, Any]:
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/pause")

    def resume(self, job_id: str, cursor: Any = None, reason: str | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {}
        if cursor is not None:
            body["cursor"] = cursor
        if reason:
            body["reason"] = reason
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/resume", body or None)

    def cancel(self, job_id: str, reason: str | None = None) -> dict[str, Any]:
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/cancel", {"reason": reason} if reason else None)

    def retry_failed(self, job_id: str) -> dict[str, Any]:
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/retry-failed")

    def quarantine(self, job_id: str) -> dict[str, Any]:
        """Items bisection quarantined: ``{"count", "items": [{"id", "seq", "index", "item", "error"...}]}``."""
        return self.call("GET", f"/v1/jobs/{_q(job_id)}/quarantine")

    def retry_quarantined(self, job_id: str, items: list[str] | None = None) -> dict[str, Any]:
        """Run quarantined items again (ids ``<seq>.<index>``; None = all); the job view, with
        ``quarantine_retry``."""
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/quarantine/retry",
                         None if items is None else {"items": items})

    def release(self, job_id: str) -> dict[str, Any]:
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/release")

    def migrate(self, job_id: str, flow_version: str, reason: str) -> dict[str, Any]:
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/migrate",
                         {"flow_version": flow_version, "reason": reason})

    def wait(self, job_id: str, timeout: float | None = None, interval: float = 1.0,
             on_update: Callable[[Job], None] | None = None) -> Job:
        """Poll until the job succeeds, fails or is cancelled; TimeoutError past ``timeout`` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if on_update is not None:
                on_update(job)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() >= deadline:
                raise TimeoutError(f"job {job_id} is still {job['status']} after {timeout:g} s")
            time.sleep(interval)

    # pull mode
    def lease(self, job_id: str, stage: str | None = None) -> Lease | None:
        """The next ready batch of ``job_id``, or None (204: nothing ready now; see
        :meth:`job_status_of_last_lease` for what the job is doing)."""
        data, resp = self.request("POST", f"/v1/jobs/{_q(job_id)}/lease", {"stage": stage} if stage else None)
        self._last_lease_status = resp.headers.get("Batchgate-Job-Status")
        return data

    def job_status_of_last_lease(self) -> str | None:
        """The ``Batchgate-Job-Status`` header of the last :meth:`lease` answer."""
        return self._last_lease_status

    def heartbeat(self, job_id: str, seq: int, lease_token: str, progress: Any = None,
                  extend_s: float | None = None) -> dict[str, Any]:
        body: dict[str, Any] = {"lease_token": lease_token}
        if progress is not None:
            body["progress"] = progress
        if extend_s is not None:
            body["extend_s"] = extend_s
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/batches/{int(seq)}/heartbeat", body)

    def complete(self, job_id: str, seq: int, lease_token: str, output: Any, next_cursor: Any = ...,
                 items: list[Any] | None = None, lease_next: bool = False,
                 usage: dict[str, Any] | None = None) -> dict[str, Any]:
        """Commit; with ``lease_next`` the answer's ``next`` is the job's next batch (or None): one round
        trip per step. ``usage`` ({"tokens", "price", "currency"}): what the call cost, for the job's
        cost ledger."""
        body: dict[str, Any] = {"lease_token": lease_token, "output": output}
        if usage is not None:
            body["usage"] = usage
        if lease_next:
            body["lease_next"] = True
        if next_cursor is not ...:
            body["next_cursor"] = next_cursor
        if items is not None:
            body["items"] = items
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/batches/{int(seq)}/complete", body)

    def fail(self, job_id: str, seq: int, lease_token: str, message: str, retryable: bool,
             type: str | None = None,  # noqa: A002 - the API's field name
             usage: dict[str, Any] | None = None) -> dict[str, Any]:
        error: dict[str, Any] = {"message": message, "retryable": retryable}
        if type:
            error["type"] = type
        body: dict[str, Any] = {"lease_token": lease_token, "error": error}
        if usage is not None:
            body["usage"] = usage
        return self.call("POST", f"/v1/jobs/{_q(job_id)}/batches/{int(seq)}/fail", body)

    # approvals
    def approvals_page(self, status: str = "pending", limit: int | None = None,
                       cursor_path: str | None = None) -> Page:
        """One page of the tenant's approvals (pending, approved or rejected), newest first."""
        if cursor_path:
            data = self.call("GET", cursor_path)
        else:
            data = self.call("GET", "/v1/approvals", params={"status": status, "limit": limit})
        return Page(data["approvals"], data.get("next"))

    def approvals(self, status: str = "pending") -> Iterator[dict[str, Any]]:
        page = self.approvals_page(status)
        while True:
            yield from page.items
            if not page.next:
                return
            page = self.approvals_page(cursor_path=page.next)

    def approval(self, approval_id: str) -> dict[str, Any]:
        """One approval: the batch, the shown output, the prompt, deadline, approvers, decision, links."""
        return self.call("GET", f"/v1/approvals/{_q(approval_id)}")

    def approve(self, approval_id: str, comment: str | None = None, output: Any = None) -> dict[str, Any]:
        """Approve (``output`` replaces the shown output); the same decision again returns the first."""
        body: dict[str, Any] = {"decision": "approve"}
        if comment:
            body["comment"] = comment
        if output is not None:
            body["output"] = output
        return self.call("POST", f"/v1/approvals/{_q(approval_id)}", body)

    def reject(self, approval_id: str, comment: str | None = None) -> dict[str, Any]:
        """Reject: the batch fails with type ``rejected`` (the failure budget decides the job)."""
        body: dict[str, Any] = {"decision": "reject"}
        if comment:
            body["comment"] = comment
        return self.call("POST", f"/v1/approvals/{_q(approval_id)}", body)

    # event webhooks
    def subscribe(self, url: str, events: list[str]) -> dict[str, Any]:
        """201: the subscription with its signing ``secret`` (shown only this once)."""
        return self.call("POST", "/v1/subscriptions", {"url": url, "events": events})

    def subscriptions(self) -> list[dict[str, Any]]:
        return self.call("GET", "/v1/subscriptions")["subscriptions"]

    def unsubscribe(self, sub_id: str) -> None:
        self.call("DELETE", f"/v1/subscriptions/{_q(sub_id)}")

    def deliveries(self, sub_id: str, limit: int | None = None) -> list[dict[str, Any]]:
        return self.call("GET", f"/v1/subscriptions/{_q(sub_id)}/deliveries",
                         params={"limit": limit})["deliveries"]


def _q(part: str) -> str:
    return quote(str(part), safe="")


def state_dir(environ: dict[str, str] | os._Environ) -> Path:
    """Where ``up`` leaves a pointer to its data dir for this user ($XDG_STATE_HOME/batchgate)."""
    base = environ.get("XDG_STATE_HOME") or str(Path(environ.get("HOME") or Path.home()) / ".local/state")
    return Path(base) / "batchgate"


def _up_records(data_dir: str | Path | None, environ: Any) -> Iterator[tuple[dict[str, Any], str]]:
    """Records of running ``up``s: the data dir's, then this user's last one."""
    places = [Path(data_dir or DEFAULT_DATA_DIR) / UP_RECORD]
    try:
        pointer = json.loads((state_dir(environ) / "last-up.json").read_text())
        places.append(Path(pointer["data_dir"]) / UP_RECORD)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    seen = set()
    for path in places:
        key = str(path.resolve()) if path.exists() else str(path)
        if key in seen:
            continue
        seen.add(key)
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and _alive(record.get("pid")):
            yield record, str(path)


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
