"""The Flask app factory: blueprints, bearer auth, problem+json errors, body limits."""

from __future__ import annotations

import logging
import math
import traceback
import uuid
from datetime import timedelta
from typing import Any

import redis
from flask import Flask, Response, g, jsonify, request
from flask.json.provider import DefaultJSONProvider
from werkzeug.exceptions import HTTPException

from gateway import logs, tracing
from gateway.api.common import Services, request_services, require_json_type
from gateway.api.idempotency import IdempotencyStore
from gateway.api.spool import CallbackSpool
from gateway.errors import (
    BatchgateError,
    BodyTooLarge,
    LedgerUnavailable,
    RetryableError,
    Unauthorized,
)
from gateway.ledger.embedded import REDIS_DOWN
from gateway.ledger.flows import FlowRegistry
from gateway.ledger.jobs import JobService
from gateway.ledger.ledger import Ledger
from gateway.security import tenant_for_token
from gateway.settings import Settings

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"
SIGNED_URL_PATHS = ("/v1/callbacks/", "/v1/blobs/", "/decide/")  # authenticated by their signed token
BODY_METHODS = frozenset({"POST", "PUT", "PATCH"})
LEDGER_RETRY_AFTER = timedelta(seconds=2)  # a Redis restart from its AOF takes about that


def create_app(settings: Settings | None = None, client: redis.Redis | None = None) -> Flask:
    """Build the WSGI app; with no client, connect as settings say (no URL: join a running `up`)."""
    from gateway.api import approvals, callbacks, decide, flows, health, jobs, metrics, pull, subscriptions
    from gateway.console import views as console
    from gateway.ledger.embedded import connect
    from gateway.push import resumer
    from gateway.push.dispatch import Dispatcher
    from gateway.push.supervisor import recovery_gate

    settings = settings or Settings()
    if not logging.getLogger().handlers:  # a gunicorn worker: nothing set the root logger up
        logs.configure(settings.log_level, settings.log_format,
                       [*logs.secret_values(settings), *settings.token_map()])
    if client is None:
        client, settings = connect(settings)
    ledger = Ledger(client, settings)
    try:
        ledger.check_digest_agreement()
        deferred_check = False
    except REDIS_DOWN as exc:
        # Start anyway (answering 503 until the ledger is there) rather than fail the worker's boot,
        # which would stop gunicorn: the check runs before each request until it has passed once.
        log.warning("ledger redis unavailable at start (%s); the API answers 503 until it is back",
                    type(exc).__name__)
        deferred_check = True
    registry = FlowRegistry(client, ledger.keys)
    app = Flask("batchgate")
    app.json = StrictJSONProvider(app)
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["batchgate"] = Services(
        settings=settings, redis=client, ledger=ledger, flows=registry,
        jobs=JobService(ledger, registry),
        idempotency=IdempotencyStore(client, ledger.keys, settings.idempotency_ttl),
        dispatcher=Dispatcher.build(settings, ledger) if settings.redis_url else None)
    services: Services = app.extensions["batchgate"]
    resumer.install(services.dispatcher)  # a decided platform approval resumes its run (issue 16)
    services.spool = CallbackSpool(settings.data_dir / "callback-spool",
                                   lambda token, body: callbacks.commit_callback(services, token, body))
    services.spool.start()  # what an earlier process spooled is committed once Redis answers
    for bp in (health.bp, metrics.bp, flows.bp, jobs.bp, pull.bp, callbacks.bp, subscriptions.bp, approvals.bp,
               decide.bp, console.bp):
        app.register_blueprint(bp)
    if deferred_check:
        app.before_request(ledger.check_digest_agreement)  # a no-op once it has passed
    if tracing.setup("batchgate-api"):  # OTEL_* configured and the otel extra installed
        app.before_request(_start_trace)
        app.after_request(_note_status)
        app.teardown_request(_end_trace)
    app.before_request(_authenticate)
    app.before_request(_bind_log_context)
    app.teardown_request(_unbind_log_context)
    startup = recovery_gate(ledger, "api")  # a restart's recovery is decided before any job request
    app.extensions["batchgate.startup"] = startup  # the console waits on it too (console/views.py)
    app.before_request(lambda: _recovery_decided(startup))
    app.before_request(_json_bodies_only)
    app.after_request(_no_content_no_type)
    _register_errors(app)
    return app


def _start_trace() -> None:
    """A server span per request, named by its route (never its path: it may hold a signed token)."""
    route = request.url_rule.rule if request.url_rule is not None else "unmatched"
    g.trace_span = tracing.start_server_span(f"HTTP {request.method} {route}", request.headers)


def _note_status(resp: Response) -> Response:
    g.trace_status = resp.status_code
    return resp


def _end_trace(exc: BaseException | None = None) -> None:
    started = g.pop("trace_span", None)
    tracing.end_span(started, 500 if exc is not None else getattr(g, "trace_status", None))


def _bind_log_context() -> None:
    """Lines logged while a request on a job is served carry its job_id (and seq) and tenant."""
    args = request.view_args or {}
    fields = {"job_id": args.get("job_id"), "seq": args.get("seq"), "tenant": g.get("tenant")}
    if any(v is not None for v in fields.values()):
        g.log_context = logs.bind(**fields)
        g.log_context.__enter__()


def _unbind_log_context(exc: BaseException | None = None) -> None:
    ctx = g.pop("log_context", None)
    if ctx is not None:
        ctx.__exit__(None, None, None)


class StrictJSONProvider(DefaultJSONProvider):
    """Responses are strict JSON: a non-finite float (only from data stored before input refused
    them, or a platform's answer) goes out as null, never as the invalid token NaN or Infinity."""

    def dumps(self, obj: Any, **kwargs: Any) -> str:
        kwargs["allow_nan"] = False
        try:
            return super().dumps(obj, **kwargs)
        except ValueError:
            return super().dumps(_finite(obj), **kwargs)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json_bodies_only() -> None:
    """415 for any body that is not JSON, on every route but the console's HTML forms (json_body checks
    again where it reads); 413 for a chunked body over the limit."""
    if request.method not in BODY_METHODS or request.routing_exception is not None:
        return
    if request.blueprint == "console":  # form posts, each checked for its CSRF token (console/views.py)
        return
    if request.path.startswith("/decide/"):  # an HTML form post (decide.py), not the JSON API
        return
    chunked = "chunked" in request.headers.get("Transfer-Encoding", "").lower()
    if request.content_length or chunked:
        require_json_type()
    if chunked and request.content_length is None:
        _read_chunked_body()


def _read_chunked_body() -> None:
    """Read (and cache) a chunked body, 413 if it is longer than the limit.

    Werkzeug stops reading a body without Content-Length at MAX_CONTENT_LENGTH and hands over what it
    read, so a body cut at the limit that happened to be valid JSON was accepted. Reading with a limit one
    byte higher tells a body of exactly the limit from a longer one.
    """
    limit = request_services().settings.max_body_bytes
    request.max_content_length = limit + 1
    if len(request.get_data(cache=True)) > limit:
        raise BodyTooLarge(f"the body exceeds the {limit}-byte limit")


def _no_content_no_type(resp: Response) -> Response:
    """A 204 (or 304) has no body, so it carries neither Content-Type nor Content-Length."""
    if resp.status_code in (204, 304):
        resp.set_data(b"")
        resp.headers.pop("Content-Type", None)
        resp.headers.pop("Content-Length", None)
    return resp


def redact_path(path: str) -> str:
    """``path`` fit for a log line: a signed URL's token (a bearer credential) replaced."""
    for prefix in SIGNED_URL_PATHS:
        if path.startswith(prefix):
            return prefix + "[redacted]"
    return path


def _authenticate() -> None:
    if not request.path.startswith("/v1/") or request.path.startswith(SIGNED_URL_PATHS):
        return
    services: Services = request_services()
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    tenant = None
    if scheme.lower() == "bearer" and token:
        tenant = tenant_for_token(services.settings.token_map(), token)
    if tenant is None:
        raise Unauthorized("a valid bearer token is required (Authorization: Bearer <token>)")
    g.tenant = tenant
    g.actor = f"tenant:{tenant}"


def _recovery_decided(generation: Any) -> None:
    """Tenant requests wait (up to 5 s, then 503) until start-up recovery after a restart is decided:
    no job is leased or created before jobs left running by the crash are held (record mode)."""
    if getattr(g, "tenant", None) is not None and not generation.ready(wait_s=5.0):
        raise RetryableError("batchgate is deciding its recovery after a restart; try again shortly",
                             retry_after=timedelta(seconds=1))


def problem(status: int, title: str, detail: str, **extra) -> Response:
    """An RFC 9457 response."""
    body = {"type": "about:blank", "title": title, "status": status, "detail": detail, **extra}
    resp = jsonify(body)
    resp.status_code = status
    resp.mimetype = PROBLEM
    return resp


def _register_errors(app: Flask) -> None:
    @app.errorhandler(BatchgateError)
    def _batchgate(exc: BatchgateError):
        resp = jsonify(exc.problem())
        resp.status_code = exc.status
        resp.mimetype = PROBLEM
        if isinstance(exc, RetryableError) and exc.retry_after is not None:
            resp.headers["Retry-After"] = str(max(1, int(exc.retry_after.total_seconds())))
        if exc.status == 401:
            resp.headers["WWW-Authenticate"] = 'Bearer realm="batchgate"'
        return resp

    @app.errorhandler(HTTPException)
    def _http(exc: HTTPException):
        """Routing and werkzeug errors (404, 405, 413, ...) as problems, keeping headers such as Allow."""
        if exc.code == 413:
            limit = request_services().settings.max_body_bytes
            return _batchgate(BodyTooLarge(f"the body exceeds the {limit}-byte limit"))
        resp = problem(exc.code or 500, exc.name, exc.description or exc.name)
        for name, value in exc.get_headers():
            if name.lower() not in ("content-type", "content-length"):
                resp.headers[name] = value
        return resp

    def _redis_down(exc: Exception):
        """503 problem with Retry-After; redis-py reconnects on a later request by itself (and the
        ledger's scripts reload themselves: EVALSHA falls back to SCRIPT LOAD after a restart)."""
        log.warning("ledger redis unavailable on %s %s: %s", request.method, redact_path(request.path),
                    type(exc).__name__)
        return _batchgate(LedgerUnavailable(
            "the ledger's Redis cannot be reached right now (down, restarting or loading its data); "
            "retry later",
            retry_after=LEDGER_RETRY_AFTER))

    for down in REDIS_DOWN:  # down, restarting, loading its AOF (BusyLoadingError), a cluster failing over
        app.register_error_handler(down, _redis_down)

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        """500 with an opaque id to quote; the log line has the id, never a signed URL's token."""
        error_id = uuid.uuid4().hex
        path = redact_path(request.path)
        trace = "".join(traceback.format_exception(exc))
        token = request.path.split("/", 3)[-1] if path != request.path else ""
        if token:
            trace = trace.replace(token, "[redacted]")
        log.error("unhandled %s on %s %s (error %s)\n%s", type(exc).__name__, request.method, path,
                  error_id, trace.rstrip())
        return problem(500, "Internal error",
                       f"an unexpected error occurred; it has been logged as error {error_id}",
                       instance=f"urn:batchgate:error:{error_id}", error_id=error_id)
