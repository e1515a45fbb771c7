"""Liveness and readiness: no auth, no secrets."""

from __future__ import annotations

from flask import Blueprint, jsonify

from gateway.app import request_services

bp = Blueprint("health", __name__)


@bp.get("/healthz")
def healthz():
    """200 while the ledger's Redis answers."""
    request_services().redis.ping()
    return jsonify({"status": "ok"})
