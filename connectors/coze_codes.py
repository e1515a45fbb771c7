"""What Coze's answers mean, shared by the blocking and async calls (coze.py) and the streaming runs
(coze_stream.py): the error codes that rule a retry out, and whether a failed answer shows a run."""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs, urlsplit

FATAL_CODES = frozenset({4000, 4100, 4101, 4200, 4010, 4011, 4019, 4022, 4008, 4314, 4315, 6003, 700012006,
                         6031, 6039})


def run_evidence(body: dict[str, Any]) -> tuple[bool, str | None]:
    """Whether a failed answer shows that a run was created, and its execute_id when known.

    An ``execute_id`` field counts; so does a ``debug_url``, unless its ``execute_id`` query parameter is
    ``0`` (Coze Studio builds a debug_url for every error, with zeros when no run exists).
    """
    execute_id = str(body.get("execute_id") or "").strip()
    if execute_id and execute_id != "0":
        return True, execute_id
    debug_url = body.get("debug_url")
    if not isinstance(debug_url, str) or not debug_url:
        return False, None
    try:
        values = parse_qs(urlsplit(debug_url).query).get("execute_id") or []
    except ValueError:
        values = []
    if not values:
        return True, None  # a debug_url that names no execution: assume a run, without a handle
    value = values[0].strip()
    if value in ("", "0"):
        return False, None
    return True, value
