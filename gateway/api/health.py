"""Liveness and readiness: no auth, no secrets."""

from __future__ import annotations

import os

from flask import Blueprint, jsonify

from gateway.api.common import request_services
from gateway.api.openapi import document

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


@bp.get("/openapi.json")
def openapi_document():
    """The OpenAPI 3.1 document of the whole API (no auth: it holds no secrets)."""
    return jsonify(document())
