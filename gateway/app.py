"""The Flask app factory: blueprints, bearer auth, problem+json errors, body limits."""

from __future__ import annotations

import hmac
import logging
from dataclasses import dataclass
from typing import Any

import redis
from flask import Flask, Response, current_app, g, jsonify, request
from werkzeug.exceptions import HTTPException

from gateway.errors import BatchgateError, RetryableError, Unauthorized
from gateway.flows import FlowRegistry
from gateway.idempotency import IdempotencyStore
from gateway.jobs import JobService
from gateway.ledger import Ledger
from gateway.security import redact_path
from gateway.settings import Settings

log = logging.getLogger(__name__)
PROBLEM = "application/problem+json"
SIGNED_URL_PATHS = ("/v1/callbacks/", "/v1/blobs/")  # authenticated by their signed token


@dataclass
class Services:
    """What the request handlers use; one set per app."""

    settings: Settings
    redis: redis.Redis
    ledger: Ledger
    flows: FlowRegistry
    jobs: JobService
    idempotency: IdempotencyStore
    dispatcher: Any = None


def create_app(settings: Settings | None = None, client: redis.Redis | None = None) -> Flask:
    """Build the WSGI app; with no client, connect as settings say (no URL: join a running `up`)."""
    from gateway.api import callbacks, flows, health, jobs, pull
    from gateway.dispatch import Dispatcher
    from gateway.embedded import connect

    settings = settings or Settings()
    if client is None:
        client, settings = connect(settings)
    ledger = Ledger(client, settings)
    ledger.check_digest_agreement()
    registry = FlowRegistry(client, ledger.keys)
    app = Flask("batchgate")
    app.config["MAX_CONTENT_LENGTH"] = settings.max_body_bytes
    app.extensions["batchgate"] = Services(
        settings=settings, redis=client, ledger=ledger, flows=registry,
        jobs=JobService(ledger, registry),
        idempotency=IdempotencyStore(client, ledger.keys, settings.idempotency_ttl),
        dispatcher=Dispatcher.build(settings, ledger) if settings.redis_url else None)
    for bp in (health.bp, flows.bp, jobs.bp, pull.bp, callbacks.bp):
        app.register_blueprint(bp)
    app.before_request(_authenticate)
    _register_errors(app)
    return app


def _authenticate() -> None:
    if not request.path.startswith("/v1/") or request.path.startswith(SIGNED_URL_PATHS):
        return
    services: Services = request_services()
    header = request.headers.get("Authorization", "")
    scheme, _, token = header.partition(" ")
    tenant = None
    if scheme.lower() == "bearer" and token:
        for known, name in services.settings.token_map().items():
            if hmac.compare_digest(known.encode(), token.strip().encode()):
                tenant = name
    if tenant is None:
        raise Unauthorized("a valid bearer token is required (Authorization: Bearer <token>)")
    g.tenant = tenant
    g.actor = f"tenant:{tenant}"


def request_services() -> Services:
    """The Services of the app handling this request."""
    return current_app.extensions["batchgate"]


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
        return problem(exc.code or 500, exc.name, exc.description or exc.name)

    @app.errorhandler(redis.ConnectionError)
    def _redis_down(exc: Exception):
        log.error("ledger redis unavailable: %s", type(exc).__name__)
        resp = problem(503, "Ledger unavailable", "the ledger's Redis cannot be reached; retry later")
        resp.headers["Retry-After"] = "2"
        return resp

    @app.errorhandler(Exception)
    def _unexpected(exc: Exception):
        log.exception("unhandled error on %s %s", request.method, redact_path(request.path))
        return problem(500, "Internal error", "an unexpected error occurred; it has been logged")
