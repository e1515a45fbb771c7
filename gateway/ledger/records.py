"""Checksummed records: the Python side of the digest the Lua scripts compute (lua/lib.lua)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

EXCLUDED = ("checksum", "corrupt")


def digest(fields: dict[str, str]) -> str:
    """sha1 over the sorted 'name NUL value' entries joined by NUL, as ``digest`` in lib.lua."""
    entries = sorted(f"{name}\0{value}" for name, value in fields.items() if name not in EXCLUDED)
    return hashlib.sha1("\0".join(entries).encode("utf-8", "surrogateescape")).hexdigest()


def seal(fields: dict[str, str]) -> dict[str, str]:
    """A copy of ``fields`` with its checksum added."""
    sealed = {k: v for k, v in fields.items() if k not in EXCLUDED}
    sealed["checksum"] = digest(sealed)
    return sealed


def intact(fields: dict[str, str]) -> bool:
    """True when the record carries a checksum that matches its fields and is not marked corrupt."""
    return "corrupt" not in fields and fields.get("checksum") == digest(fields)


def dumps(value: Any) -> str:
    """Compact, stable JSON as stored in the ledger."""
    return json.dumps(value, separators=(",", ":"), sort_keys=True, ensure_ascii=False)


def loads_or_none(text: str | None) -> Any:
    """Decode a stored JSON field; '' and None mean absent."""
    return json.loads(text) if text else None


# Log and audit entries are Redis stream fields (strings); these are given back typed.
INT_FIELDS = frozenset({"seq", "attempt", "items", "duration_ms", "reopened", "superseded", "voided",
                        "expired", "retry_in_ms", "status"})
JSON_FIELDS = frozenset({"cursor", "next_cursor", "progress"})
CURSOR_EVENTS = frozenset({"cursor_moved"})  # their "from" and "to" are cursors


def typed_entry(fields: dict[str, str], stage_names: list[str] | None = None) -> dict[str, Any]:
    """A log or audit entry with numbers as numbers and cursors as JSON; stage indices as names."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if name in INT_FIELDS and value.lstrip("-").isdigit():
            out[name] = int(value)
        elif name == "retryable" and value in ("0", "1"):
            out[name] = value == "1"
        elif value and (name in JSON_FIELDS
                        or (name in ("from", "to") and fields.get("event") in CURSOR_EVENTS)):
            try:
                out[name] = json.loads(value)
            except ValueError:
                out[name] = value
        else:
            out[name] = value
    stage = fields.get("stage")
    if stage_names is not None and stage is not None and stage.isdigit() and int(stage) < len(stage_names):
        out["stage"] = stage_names[int(stage)]
    return out
