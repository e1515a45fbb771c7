"""Webhook subscription routes: create, list, show, delete, and the deliveries made to one."""

from __future__ import annotations

from typing import Literal

from flask import Blueprint, g, jsonify
from pydantic import BaseModel, ConfigDict, Field

from gateway.api.common import json_body, query_int, request_services
from gateway.ledger.events import DELIVERIES_KEPT, EVENT_TYPES, SubscriptionStore
from gateway.net.urlguard import Allowlist, check_url_shape
from gateway.validation import parse

bp = Blueprint("subscriptions", __name__, url_prefix="/v1/subscriptions")
EventType = Literal[EVENT_TYPES]  # type: ignore[valid-type]


class SubscriptionRequest(BaseModel):
    """A webhook subscription: where to POST, and which job events."""

    model_config = ConfigDict(extra="forbid")
    url: str = Field(min_length=1, max_length=2000, pattern=r"^https?://",
                     description="http(s) URL the outbound guard admits (public, or allowed by "
                                 "BATCHGATE_OUTBOUND_ALLOW)")
    events: list[EventType] = Field(min_length=1, max_length=len(EVENT_TYPES),
                                    description="the event types to deliver")


def _store() -> SubscriptionStore:
    services = request_services()
    return SubscriptionStore(services.redis, services.ledger.keys)


@bp.post("")
def create():
    """201 with the signing secret (shown this once); 422 for a URL the outbound guard refuses."""
    req = parse(SubscriptionRequest, json_body(), "the subscription")
    # 422 UnsafeURL for what the URL shows; each delivery is checked on connection by the guard
    check_url_shape(req.url, Allowlist.parse(request_services().settings.outbound_allow))
    return jsonify(_store().create(g.tenant, req.url, list(req.events))), 201


@bp.get("")
def list_subscriptions():
    store = _store()
    return jsonify({"subscriptions": [store.view(r) for r in store.for_tenant(g.tenant)]})


@bp.get("/<sub_id>")
def show(sub_id: str):
    store = _store()
    return jsonify(store.view(store.owned(g.tenant, sub_id)))


@bp.delete("/<sub_id>")
def delete(sub_id: str):
    _store().delete(g.tenant, sub_id)
    return "", 204


@bp.get("/<sub_id>/deliveries")
def deliveries(sub_id: str):
    """The newest delivery attempts first (at most ``?limit=``, of the last 100 kept)."""
    limit = query_int("limit", DELIVERIES_KEPT, 1, DELIVERIES_KEPT)
    return jsonify({"deliveries": _store().deliveries(g.tenant, sub_id, limit)})
