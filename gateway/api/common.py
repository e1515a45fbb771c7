"""What every blueprint uses: the app's Services, JSON bodies, query integers, Idempotency-Key handling."""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import redis
from flask import current_app, g, jsonify, request

from gateway.api.idempotency import IdempotencyStore, fingerprint
from gateway.errors import BatchgateError, InvalidRequest, MalformedBody, UnsupportedMediaType
from gateway.ledger.flows import FlowRegistry
from gateway.ledger.jobs import JobService
from gateway.ledger.ledger import Ledger
from gateway.settings import Settings
from gateway.validation import is_json_mimetype, strict_loads


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
    spool: Any = None  # gateway.api.spool.CallbackSpool: callbacks kept while Redis is unavailable


def request_services() -> Services:
    """The Services of the app handling this request."""
    return current_app.extensions["batchgate"]


def app_service(name: str, make: Callable[[Services], Any]) -> Any:
    """A helper object kept once per app under ``name``, made from the app's Services on first use."""
    found = current_app.extensions.get(name)
    if found is None:
        found = current_app.extensions.setdefault(name, make(request_services()))
    return found


def require_json_type() -> None:
    """415 unless the request's Content-Type is application/json or application/*+json."""
    if not is_json_mimetype(request.mimetype):
        shown = (request.mimetype or "none")[:100]
        raise UnsupportedMediaType(f"the body must be application/json (Content-Type: {shown})")


def json_body(required: bool = True) -> dict[str, Any]:
    """The request body as a JSON object, decoded strictly (``validation.strict_loads``).

    {} for an empty optional body; 415 for a body that is not ``application/json``; 400 for one that
    is not strict JSON or not an object.
    """
    raw = request.get_data(cache=True)
    if not raw.strip():
        if required:
            raise MalformedBody("a JSON object body is required")
        return {}
    require_json_type()
    body = strict_loads(raw)
    if not isinstance(body, dict):
        raise MalformedBody("body must be a JSON object")
    return body


def query_int(name: str, default: int, lo: int, hi: int) -> int:
    """An integer query parameter within [lo, hi]."""
    raw = request.args.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        raise InvalidRequest(f"query parameter {name} must be an integer") from None
    if not lo <= value <= hi:
        raise InvalidRequest(f"query parameter {name} must be between {lo} and {hi}")
    return value


def idempotent(view: Callable[..., Any]) -> Callable[..., Any]:
    """Honour an Idempotency-Key header: replay, 422 on another body, 409 while in flight; a 409 or 429
    answer (try again later) is not stored, so the same key may be retried."""

    @functools.wraps(view)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        key = request.headers.get("Idempotency-Key")
        if key is None:
            return view(*args, **kwargs)
        store = request_services().idempotency
        fp = fingerprint(request.method, request.path, request.get_data(cache=True))
        replay = store.begin(g.tenant, key, fp)
        if replay is not None:
            resp = jsonify(replay[1])
            resp.status_code = replay[0]
            if replay[0] >= 400:
                resp.mimetype = "application/problem+json"
            resp.headers["Idempotent-Replayed"] = "true"
            return resp
        try:
            body, status = view(*args, **kwargs)
        except BatchgateError as exc:
            if exc.status < 500 and exc.status not in (409, 429):  # in flight, quota: retry later
                store.finish(g.tenant, key, exc.status, exc.problem())
            else:
                store.abandon(g.tenant, key)
            raise
        except Exception:
            store.abandon(g.tenant, key)
            raise
        store.finish(g.tenant, key, status, body)
        return jsonify(body), status

    return wrapper
