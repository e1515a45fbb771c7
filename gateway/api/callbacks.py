"""Platform-facing routes authenticated by signed URLs: stage callbacks and blobs by reference."""

from __future__ import annotations

from flask import Blueprint, Response, jsonify

from connectors.base import Answer
from gateway.api.common import json_body, request_services
from gateway.errors import InvalidRequest, NotFound
from gateway.push.dispatch import commit_answer
from gateway.security import verify

bp = Blueprint("callbacks", __name__, url_prefix="/v1")


@bp.post("/callbacks/<token>")
def callback(token: str):
    """Commit a platform's answer: duplicate gets the first answer, stale 409, forged 401, expired 410."""
    services = request_services()
    claim = verify(token, services.settings.signing_secret(), "callback")
    try:
        answer = Answer.parse(json_body())
    except ValueError as exc:
        raise InvalidRequest(str(exc)) from None
    spec = services.ledger.spec(claim["j"])
    stage = spec.flow.stages[claim["st"]]
    result = commit_answer(services.ledger, spec, stage, claim["s"], claim["t"], answer)
    services.ledger.note(spec.job_id, "callback_received", seq=claim["s"], stage=stage.name,
                         attempt=claim["a"], status="succeeded" if answer.succeeded else "failed")
    if services.dispatcher is not None:
        services.dispatcher.kick(spec.job_id)
    return jsonify(result)


@bp.get("/blobs/<token>")
def blob(token: str):
    """A batch's items, for envelopes that carry ``items_url`` instead of ``items``."""
    services = request_services()
    claim = verify(token, services.settings.signing_secret(), "blob")
    raw = services.redis.get(services.ledger.keys.job(claim["j"]).items(claim["s"]))
    if raw is None:
        raise NotFound("these items are gone: the batch has been committed or superseded")
    return Response(raw, mimetype="application/json")
