"""Edge validation: one strict JSON decoder, and pydantic errors as problems without echoing input."""

from __future__ import annotations

import json
import math
import re
from itertools import accumulate
from typing import Any, TypeVar

from pydantic import BaseModel, ValidationError

from gateway.errors import InvalidRequest, MalformedBody

M = TypeVar("M", bound=BaseModel)

#: Deepest nesting of arrays and objects a body may have (json.loads recurses once per level).
MAX_DEPTH = 64
#: Integers must fit in 64 bits; anything wider is refused rather than stored and echoed.
MAX_INT = 2**64
MAX_INT_DIGITS = len(str(MAX_INT)) + 1  # sign included; checked before int() converts

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_NOT_BRACKET = re.compile(rb"[^\[\]{}]+")
_DEPTH_STEP = [0] * 256
for _ch in b"[{":
    _DEPTH_STEP[_ch] = 1
for _ch in b"]}":
    _DEPTH_STEP[_ch] = -1
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def is_json_mimetype(mimetype: str) -> bool:
    """application/json or any application/*+json (problem+json, merge-patch+json, ...)."""
    mimetype = mimetype.lower()
    return mimetype == "application/json" or (mimetype.startswith("application/")
                                              and mimetype.endswith("+json"))


def nests_deeper(raw: bytes, limit: int = MAX_DEPTH) -> bool:
    """Whether arrays and objects nest deeper than ``limit`` (brackets inside strings do not count).

    O(n) and without recursion, however deep the input; a body with few brackets is not scanned.
    """
    if raw.count(b"[") + raw.count(b"{") <= limit:
        return False
    brackets = _NOT_BRACKET.sub(b"", _STRING.sub(b"", raw))
    return max(accumulate(_DEPTH_STEP[b] for b in brackets), default=0) > limit


def _refuse_constant(name: str) -> Any:
    raise MalformedBody(f"body is not valid JSON: {name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise MalformedBody(f"body holds a number out of range: {text[:40]}")
    return value


def _bounded_int(text: str) -> int:
    if len(text) > MAX_INT_DIGITS or abs(value := int(text)) >= MAX_INT:
        raise MalformedBody(f"body holds an integer wider than 64 bits: {text[:40]}"
                            + ("..." if len(text) > 40 else ""))
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise MalformedBody(f"body has a duplicate key {json.dumps(dup)[:80]}")
    return obj


def _lone_surrogate_at(value: Any) -> str | None:
    """The path of the first string (or key) holding a lone UTF-16 surrogate, if any."""
    stack: list[tuple[str, Any]] = [("", value)]
    while stack:
        path, node = stack.pop()
        if isinstance(node, str):
            if _SURROGATE.search(node):
                return path or "(body)"
        elif isinstance(node, dict):
            for key, item in node.items():
                sub = f"{path}.{key}" if path else str(key)
                if _SURROGATE.search(key):
                    return (path or "(body)") + " (a key)"
                stack.append((sub, item))
        elif isinstance(node, list):
            stack.extend((f"{path}[{i}]", item) for i, item in enumerate(node))
    return None


def strict_loads(raw: bytes) -> Any:
    """Decode a request body as strict JSON (RFC 8259, I-JSON's limits); MalformedBody otherwise.

    UTF-8 only; at most MAX_DEPTH levels; no NaN/Infinity, no float that overflows, no integer wider
    than 64 bits; no duplicate keys; no lone surrogates (``"\\ud800"``), which nothing can store.
    """
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        raise MalformedBody("body is not valid JSON: it is not UTF-8") from None
    if nests_deeper(raw):
        raise MalformedBody(f"body nests deeper than {MAX_DEPTH} levels")
    try:
        value = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float,
                           parse_int=_bounded_int, object_pairs_hook=_unique_keys)
    except MalformedBody:
        raise
    except RecursionError:  # not reachable after the depth check; kept as a backstop
        raise MalformedBody(f"body nests deeper than {MAX_DEPTH} levels") from None
    except ValueError as exc:  # JSONDecodeError, and int() past Python's digit limit
        raise MalformedBody(f"body is not valid JSON: {str(exc)[:200]}") from None
    if _SURROGATE_ESCAPE.search(raw):
        where = _lone_surrogate_at(value)
        if where is not None:
            raise MalformedBody(f"body holds a lone UTF-16 surrogate (\\ud800-\\udfff) at {where}: "
                                "strings must be valid Unicode")
    return value


def problem_errors(exc: ValidationError) -> list[dict[str, str]]:
    """Field paths and messages only: input values may hold secrets."""
    return [{"field": ".".join(str(p) for p in err["loc"]) or "(body)", "message": err["msg"]}
            for err in exc.errors(include_url=False, include_input=False)]


def parse(model: type[M], payload: Any, what: str) -> M:
    """Validate ``payload`` as ``model`` or raise InvalidRequest naming each bad field."""
    try:
        return model.model_validate(payload)
    except ValidationError as exc:
        raise InvalidRequest(f"{what} is invalid", errors=problem_errors(exc)) from exc
