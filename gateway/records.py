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
