"""Platform-facing routes authenticated by signed URLs: stage callbacks and blobs by reference."""

from __future__ import annotations

import logging
from typing import Any

from flask import Blueprint, Response, jsonify

from connectors.base import Answer
from gateway.api.common import Services, json_body, request_services
from gateway.api.spool import REDIS_DOWN
from gateway.errors import InvalidRequest, NotFound, shown
from gateway.push.dispatch import commit_answer
from gateway.security import verify

log = logging.getLogger(__name__)
bp = Blueprint("callbacks", __name__, url_prefix="/v1")


@bp.post("/callbacks/<token>")
def callback(token: str):
    """Commit a platform's answer: duplicate gets the first answer, stale 409, forged 401, expired 410.

    While the ledger's Redis is unavailable, a genuine, well-formed answer is kept in the callback spool
    and answered 202 (gateway/api/spool.py): it is committed, fenced as always, when Redis returns.
    """
    services = request_services()
    claim = verify(token, services.settings.signing_secret(), "callback")
    body = json_body()
    _parse(body)  # a malformed answer is refused now, never spooled
    try:
        return jsonify(commit_callback(services, token, body))
    except REDIS_DOWN as exc:
        if services.spool is None:
            raise
        try:
            spool_id = services.spool.keep(token, body)
        except OSError as disk:  # nowhere to keep it: the platform must retry (503, as before the spool)
            log.error("callback spool refused a write (%s): callback for job_id=%s seq=%s not kept",
                      disk.strerror or type(disk).__name__, claim["j"], claim["s"])
            raise exc from None
        log.warning("ledger redis unavailable (%s): callback for job_id=%s seq=%s attempt=%s spooled as %s",
                    type(exc).__name__, claim["j"], claim["s"], claim["a"], spool_id)
        return jsonify({"job_id": claim["j"], "seq": claim["s"], "attempt": claim["a"], "accepted": True,
                        "spooled": True, "spool_id": spool_id}), 202


def commit_callback(services: Services, token: str, body: Any) -> dict[str, Any]:
    """Verify, parse and commit one callback (live, or replayed from the spool)."""
    claim = verify(token, services.settings.signing_secret(), "callback")
    answer = _parse(body)
    spec = services.ledger.spec(claim["j"])
    if not 0 <= claim["st"] < spec.stage_count:  # only a holder of the signing key could make one
        raise NotFound(f"job {shown(spec.job_id)} has no stage {claim['st']}")
    stage = spec.flow.stages[claim["st"]]
    result = commit_answer(services.ledger, spec, stage, claim["s"], claim["t"], answer)
    services.ledger.note(spec.job_id, "callback_received", seq=claim["s"], stage=stage.name,
                         attempt=claim["a"], status="waiting_human" if answer.waiting
                         else "succeeded" if answer.succeeded else "failed")
    if services.dispatcher is not None:
        services.dispatcher.kick(spec.job_id)
    return result


def _parse(body: Any) -> Answer:
    try:
        return Answer.parse(body)
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None


@bp.get("/blobs/<token>")
def blob(token: str):
    """A batch's items, for envelopes that carry ``items_url`` instead of ``items``."""
    services = request_services()
    claim = verify(token, services.settings.signing_secret(), "blob")
    raw = services.redis.get(services.ledger.keys.job(claim["j"]).items(claim["s"]))
    if raw is None:
        raise NotFound("these items are gone: the batch has been committed or superseded")
    return Response(raw, mimetype="application/json")
