"""Flow registry routes: register, list, show, retire."""

from __future__ import annotations

from flask import Blueprint, g, jsonify

from gateway.api.common import json_body, request_services
from gateway.ledger.flows import check_secrets, parse_flow
from gateway.ledger.jobspec import check_source_access
from gateway.ledger.planner import check_batch_bound
from gateway.net.urlguard import Allowlist, check_url_shape
from gateway.push.dispatch import target_urls

bp = Blueprint("flows", __name__, url_prefix="/v1/flows")


@bp.post("")
def register():
    """Register a flow version; 201 new, 200 identical, 409 same version with other content or retired,
    422 a target naming a secret this tenant does not have."""
    flow = parse_flow(json_body())
    services = request_services()
    allow = Allowlist.parse(services.settings.outbound_allow)
    for stage in flow.stages:
        for url in target_urls(stage.target or {}):
            check_url_shape(url, allow)  # resolves nothing: the guard checks each call
    check_source_access(flow.source, services.settings, g.tenant)  # a default path the tenant may read
    check_batch_bound(flow.batching, flow.source, services.settings)  # 422: a batch could be too big
    check_secrets(flow, g.tenant, services.settings.secret_names(g.tenant))  # 422: not this tenant's
    record, created = services.flows.register(g.tenant, flow)
    return jsonify(record), 201 if created else 200


@bp.get("")
def list_flows():
    return jsonify({"flows": request_services().flows.list(g.tenant)})


@bp.get("/<flow_id>")
def show(flow_id: str):
    """The latest version, and the list of all versions."""
    flows = request_services().flows
    latest = flows.get(g.tenant, flow_id)
    versions = [f["flow"]["version"] for f in flows.list(g.tenant) if f["flow"]["id"] == flow_id]
    return jsonify({**latest, "versions": versions})


@bp.get("/<flow_id>/versions/<version>")
def show_version(flow_id: str, version: str):
    return jsonify(request_services().flows.get(g.tenant, flow_id, version))


@bp.delete("/<flow_id>/versions/<version>")
def retire(flow_id: str, version: str):
    """Retire a version for good (a tombstone: the id+version is never registered again); jobs
    recorded on it can no longer resume."""
    request_services().flows.delete(g.tenant, flow_id, version)
    return "", 204
