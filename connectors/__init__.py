"""Platform connectors (n8n, Dify, Coze, generic HTTP) for push mode; no Flask, no RQ."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from connectors import coze, dify, http, n8n
from connectors.base import Connector

CONNECTORS: dict[str, Connector] = {
    "http": http.HttpConnector(),
    "n8n": n8n.N8nConnector(),
    "dify": dify.DifyConnector(),
    "coze": coze.CozeConnector(),
}

_VALIDATORS: dict[str, Callable[[dict[str, Any]], dict[str, Any]]] = {
    "http": http.validate_target,
    "n8n": n8n.validate_target,
    "dify": dify.validate_target,
    "coze": coze.validate_target,
}


def _known() -> str:
    return ", ".join(sorted(CONNECTORS))


def get_connector(type_: str) -> Connector:
    """The connector for a target type.

    Raises:
        ValueError: for an unknown type, listing the known ones.
    """
    try:
        return CONNECTORS[type_]
    except (KeyError, TypeError):
        raise ValueError(f"unknown target type {type_!r}; known types: {_known()}") from None


def validate_target(target: dict[str, Any]) -> dict[str, Any]:
    """Check a stage target by its ``type`` and return a copy with the defaults filled in.

    Raises:
        ValueError: with a precise message (unknown type, missing or invalid field).
    """
    if not isinstance(target, dict):
        raise ValueError("target must be an object with a type")
    kind = target.get("type")
    if kind not in _VALIDATORS:
        raise ValueError(f"unknown target type {kind!r}; known types: {_known()}")
    return _VALIDATORS[kind](target)
