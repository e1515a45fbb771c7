"""Signed decision links: a person decides an approval without a bearer token.

A link is ``<public base URL>/decide/<token>``, the token signed by ``security.sign`` for the purpose
``decide`` over the approval id (``a``), the approver it was made for (``p``, absent = anyone) and an
expiry (the approval's deadline): tampering with any of them breaks the signature. The key is the
configured ``signing_key``, else one generated once and kept in Redis (``keys.decide_key``), so every
API process of a deployment verifies every link. A GET of the link only shows the approval; a POST
decides, so a chat app's link preview (a GET) can never approve. A link is good for one decision: the
approval is decided once and a decision never changes, so a second POST shows the decision made.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

from gateway import security
from gateway.errors import Unauthorized
from gateway.settings import Settings

if TYPE_CHECKING:
    from gateway.ledger.ledger import Ledger

PURPOSE = "decide"
GRACE_S = 60  # a link stays good this long past the deadline (the timeout decides at the deadline anyway)


def base_url(settings: Settings, request_root: str | None = None) -> str:
    """Where people reach batchgate: BATCHGATE_PUBLIC_URL, else the request's own root, else localhost."""
    if settings.public_url:
        return settings.public_url.rstrip("/")
    if request_root:
        return request_root.rstrip("/")
    return f"http://127.0.0.1:{settings.port}"


def token_for(ledger: Ledger, approval_id: str, approver: str | None, deadline_ms: int) -> str:
    """A signed token deciding ``approval_id`` as ``approver``, good until the deadline (plus grace)."""
    payload: dict[str, Any] = {"a": approval_id}
    if approver is not None:
        payload["p"] = approver
    # an absolute expiry: the link is re-made on every delivery of its event and must be the same each
    # time (a relative one, now + (deadline - now), could round to another second between two calls)
    return security.sign(payload, ledger.approvals.link_key(), PURPOSE,
                         expires_s=deadline_ms // 1000 + GRACE_S)


def read_token(ledger: Ledger, token: str) -> tuple[str, str | None]:
    """(approval id, approver) of a genuine, unexpired link token; 401 forged, 410 expired."""
    payload = security.verify(token, ledger.approvals.link_key(), PURPOSE)
    approver = payload.get("p")
    if approver is not None and not isinstance(approver, str):
        raise Unauthorized("the link's token is malformed")
    return payload["a"], approver


def links_for(ledger: Ledger, data: dict[str, Any], settings: Settings,
              request_root: str | None = None) -> dict[str, Any]:
    """The ``deadline`` and ``links`` of an approval.requested payload: one link per approver, or one
    for anyone (approver null)."""
    deadline_ms = int(data["deadline_ms"])
    root = base_url(settings, request_root)
    approvers = data.get("approvers") or [None]
    links = [{"approver": who,
              "url": f"{root}/decide/{token_for(ledger, data['approval_id'], who, deadline_ms)}"}
             for who in approvers]
    deadline = (time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(deadline_ms / 1000))
                + f".{deadline_ms % 1000:03d}Z")
    return {"deadline": deadline, "links": links}
