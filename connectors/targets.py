"""Checks shared by the connectors' ``validate_target`` functions.

A target holds configuration and secret NAMES (fields ending in ``_secret``), never secret values: the gateway
resolves names to values at call time. Every check raises ``ValueError`` with a message naming the target
type and the field, and never echoes a value that may be a secret.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any
from urllib.parse import urlsplit

from connectors.base import PlatformError, Retry

SECRET_NAME = re.compile(r"^[A-Za-z0-9_.:/-]{1,128}$")

SECRET_VALUE_PREFIXES = ("app-", "pat_", "sat_", "eyJ", "Bearer ", "Basic ")
"""How API keys and tokens of the supported platforms start (Dify app keys, Coze tokens, JWTs)."""

GATEWAY_FIELDS = ("max_in_flight", "keepalive_idle")
"""Fields every target may carry for the gateway (calls in flight per endpoint; how long an idle pooled
connection may still be reused, in seconds); connectors ignore them."""
MAX_IN_FLIGHT_LIMIT = 1000
KEEPALIVE_IDLE_LIMIT_S = 3600


BODY_METHODS = ("POST", "PUT", "PATCH")


class TargetChecker:
    """Reads one target dict field by field; ``result`` holds the checked, defaulted copy."""

    def __init__(self, target: Any, kind: str, fields: Iterable[str]) -> None:
        if not isinstance(target, dict):
            raise ValueError(f"{kind} target must be an object")
        self.kind = kind
        self.target = target
        self.result: dict[str, Any] = {"type": kind}
        known = {*fields, *GATEWAY_FIELDS}
        unknown = sorted(str(name) for name in set(target) - known - {"type"})
        if unknown:
            raise ValueError(f"{kind} target: unknown field(s) {', '.join(unknown)}; "
                             f"known fields: {', '.join(sorted(known))}")
        self._max_in_flight()
        self._keepalive_idle()

    def _max_in_flight(self) -> None:
        value = self.target.get("max_in_flight")
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_IN_FLIGHT_LIMIT:
            raise self.fail(f"max_in_flight must be a whole number from 1 to {MAX_IN_FLIGHT_LIMIT}")
        self.result["max_in_flight"] = value

    def _keepalive_idle(self) -> None:
        value = self.target.get("keepalive_idle")
        if value is None:
            return
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not (
                0 <= value <= KEEPALIVE_IDLE_LIMIT_S):
            raise self.fail(f"keepalive_idle must be a number of seconds from 0 to {KEEPALIVE_IDLE_LIMIT_S} "
                            "(below the platform's keep-alive timeout; 0: a new connection per call)")
        self.result["keepalive_idle"] = value

    def fail(self, message: str) -> ValueError:
        """A ValueError prefixed with the target type."""
        return ValueError(f"{self.kind} target: {message}")

    def string(self, name: str, default: str | None = None, *, required: bool = False,
               allow_empty: bool = False) -> str | None:
        """A string field (a number is accepted and kept as its string form)."""
        value = self.target.get(name)
        if isinstance(value, int) and not isinstance(value, bool):
            value = str(value)
        if value is None or (value == "" and not allow_empty):
            if required:
                raise self.fail(f"{name} is required")
            value = default
        elif not isinstance(value, str):
            raise self.fail(f"{name} must be a string")
        if value is not None:
            self.result[name] = value
        return value

    def choice(self, name: str, options: tuple[str, ...], default: str) -> str:
        """A field limited to ``options`` (case as given)."""
        value = self.target.get(name)
        value = default if value is None else value
        if value not in options:
            raise self.fail(f"{name} must be one of {', '.join(options)}")
        self.result[name] = value
        return value

    def flag(self, name: str, default: bool) -> bool:
        """A boolean field."""
        value = self.target.get(name)
        value = default if value is None else value
        if not isinstance(value, bool):
            raise self.fail(f"{name} must be true or false")
        self.result[name] = value
        return value

    def method(self) -> str:
        """``method``: POST (default), PUT or PATCH, since the envelope travels as the body."""
        method = str(self.target.get("method") or "POST").upper()
        if method not in BODY_METHODS:
            raise self.fail(f"method must be one of {', '.join(BODY_METHODS)} "
                            "(the envelope travels as the body)")
        self.result["method"] = method
        return method

    def api_base(self, name: str, default: str) -> str:
        """A platform's API base URL, without trailing slashes or a trailing ``/v1``."""
        base = self.url(name, default, base=True)
        if base.endswith("/v1"):
            base = base[:-len("/v1")]
            self.result[name] = base
        return base

    def url(self, name: str, default: str | None = None, *, required: bool = False,
            base: bool = False) -> str | None:
        """An http(s) URL; ``base`` strips trailing slashes so paths can be appended."""
        value = self.string(name, default, required=required)
        if value is None:
            return None
        parts = urlsplit(value)
        if parts.scheme not in ("http", "https") or not parts.netloc:
            raise self.fail(f"{name} must be an absolute http(s) URL")
        if parts.username or parts.password:
            raise self.fail(f"{name} must not carry credentials; name a secret in a *_secret field instead")
        if base:
            value = value.rstrip("/")
            self.result[name] = value
        return value

    def secret_name(self, name: str, *, required: bool = False, what: str = "secret") -> str | None:
        """The NAME of a secret (a ``*_secret`` field); values that look like keys are refused."""
        value = self.target.get(name)
        if value in (None, ""):
            if required:
                raise self.fail(f"{name} is required: the name of the secret holding the {what}")
            return None
        if not isinstance(value, str) or not SECRET_NAME.match(value):
            raise self.fail(f"{name} must be a secret name (letters, digits, _ . : / -, at most 128)")
        if value.startswith(SECRET_VALUE_PREFIXES):
            raise self.fail(f"{name} looks like the {what} itself; store it in the gateway's secrets "
                            f"and put its name here")
        self.result[name] = value
        return value

    def mapping(self, name: str) -> dict[str, str] | None:
        """A ``{platform variable: envelope path}`` mapping for ``map_fields``."""
        value = self.target.get(name)
        if value is None:
            return None
        if not isinstance(value, dict) or not value:
            raise self.fail(f"{name} must be a non-empty object of variable name -> envelope path")
        for var, path in value.items():
            if not isinstance(path, str) or not path or not var:
                raise self.fail(f"{name}.{var} must be a non-empty envelope path such as \"items\", "
                                f"\"params.title\" or \"$json\"")
        self.result[name] = dict(value)
        return value

    def headers(self, name: str) -> dict[str, str]:
        """Static extra headers: string names to string values."""
        value = self.target.get(name) or {}
        if not isinstance(value, dict) or not all(isinstance(k, str) and k and isinstance(v, str)
                                                  for k, v in value.items()):
            raise self.fail(f"{name} must be an object of header name -> string value")
        self.result[name] = dict(value)
        return value


def checked(validate: Callable[[dict[str, Any]], dict[str, Any]], target: dict[str, Any]) -> dict[str, Any]:
    """``validate(target)``, with an invalid target raised as a FATAL ``PlatformError``."""
    try:
        return validate(target)
    except ValueError as exc:
        raise PlatformError(str(exc), Retry.FATAL) from None
