"""Liveness and readiness: no auth, no secrets.

``/livez``: the process answers (nothing else is asked: a liveness probe that fails on Redis would have
the orchestrator restart every API for a Redis outage). ``/readyz``: this API can do its work now --
Redis answers, the ledger's scripts are loaded (loaded again if Redis lost them), and some supervisor
has beaten within ``ready_intervals`` supervisor intervals (without one, leases never expire and crashed
jobs never recover, so a load balancer should know). ``/healthz`` stays as it was: Redis answers.
"""

from __future__ import annotations

import functools
import hashlib
import os

from flask import Blueprint, jsonify
from redis.exceptions import RedisError

from gateway.api.common import request_services
from gateway.api.openapi import document
from gateway.errors import NotReady
from gateway.ledger.liveness import Liveness
from gateway.ledger.scripts import OPERATIONS, source

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    """200 while the ledger's Redis answers; ``instance`` lets `batchgate up` tell its API apart."""
    request_services().redis.ping()
    body = {"status": "ok"}
    instance = os.environ.get("BATCHGATE_INSTANCE_ID")
    if instance:
        body["instance"] = instance
    return jsonify(body)


@bp.get("/livez")
def livez():
    """200 while this process serves requests."""
    return jsonify({"status": "ok"})


@bp.get("/readyz")
def readyz():
    """200 when Redis answers, the scripts are loaded and a supervisor is alive; else a 503 problem whose
    ``checks`` say which failed and why."""
    services = request_services()
    checks: dict[str, dict] = {}
    try:
        services.redis.ping()
        checks["redis"] = {"ok": True}
    except RedisError as exc:
        checks["redis"] = {"ok": False, "detail": f"Redis does not answer ({type(exc).__name__})"}
    if checks["redis"]["ok"]:
        checks["scripts"] = _scripts(services.redis)
        checks["supervisor"] = _supervisor(services)
    failing = [f"{name}: {check['detail']}" for name, check in checks.items() if not check["ok"]]
    if failing:
        raise NotReady("; ".join(failing), checks=checks)
    return jsonify({"status": "ready", "checks": checks})


def _scripts(client) -> dict:
    """Every ledger script is in Redis's script cache (one that is missing, after a restart or SCRIPT
    FLUSH, is loaded now: redis-py would load it on first use anyway; this checks it compiles)."""
    texts = _script_texts()
    try:
        missing = [text for (sha, text), there in zip(texts, client.script_exists(*[sha for sha, _ in texts]),
                                                        strict=True) if not there]
        for text in missing:
            client.script_load(text)
        return {"ok": True, "loaded_now": len(missing)}
    except RedisError as exc:
        return {"ok": False, "detail": f"loading the ledger's scripts failed ({type(exc).__name__})"}


def _supervisor(services) -> dict:
    settings = services.settings
    max_age = settings.ready_intervals * settings.supervisor_interval.total_seconds()
    try:
        beats = Liveness(services.redis, services.ledger.keys, "supervisor").beats()
    except RedisError as exc:
        return {"ok": False, "detail": f"reading supervisor beats failed ({type(exc).__name__})"}
    fresh = [b for b in beats if b.age_s <= max_age]
    out: dict = {"ok": bool(fresh), "alive": len(fresh), "max_age_s": max_age}
    if beats:
        out["last_beat_age_s"] = round(beats[0].age_s, 3)
    if not fresh:
        out["detail"] = ("no supervisor has beaten within "
                         f"{max_age:g} s: leases do not expire and crashed jobs are not recovered; "
                         "run `batchgate supervisor`")
    return out


@functools.cache
def _script_texts() -> tuple[tuple[str, str], ...]:
    """(sha1, text) of every ledger script, read from the package once per process."""
    return tuple((hashlib.sha1(text.encode()).hexdigest(), text) for text in map(source, OPERATIONS))


@bp.get("/openapi.json")
def openapi_document():
    """The OpenAPI 3.1 document of the whole API (no auth: it holds no secrets)."""
    return jsonify(document())
