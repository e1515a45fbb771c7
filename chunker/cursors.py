"""Cursors: plain JSON-serialisable dicts with a "type" key saying where a read starts.

- offset: {"type": "offset", "offset": int} plus, for jsonl/csv files, "byte" (position of
  that record) and "line" (physical lines before it, for error messages). A file cursor
  without "byte" is honoured by scanning from the start and skipping "offset" records.
- page:   {"type": "page", "page": int, "skip": int}
- token:  {"type": "token", "token": str | None, "skip": int}   (None = first page)
- link:   {"type": "link", "url": str, "skip": int}
- key:    {"type": "key", "after": str | int | None, "skip": int}
"skip" is how many items of that page are already consumed; it defaults to 0.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from chunker.errors import SourceSpecError
from chunker.validation import Fields, describe, is_int


def offset_cursor(offset: int, byte: int | None = None, line: int | None = None) -> dict:
    """Builds an offset cursor; byte/line are included only when given."""
    cursor: dict[str, Any] = {"type": "offset", "offset": offset}
    if byte is not None:
        cursor["byte"] = byte
    if line is not None:
        cursor["line"] = line
    return cursor


def _skip(f: Fields) -> int:
    """Returns the optional "skip" field (default 0)."""
    return f.get_int("skip", 0, minimum=0)


def _offset(f: Fields) -> dict:
    """Checks an offset cursor."""
    f.only({"type", "offset", "byte", "line"})
    cursor = offset_cursor(f.get_int("offset", minimum=0))
    for key in ("byte", "line"):
        if key in f.data:
            cursor[key] = f.get_int(key, minimum=0)
    return cursor


def _page(f: Fields) -> dict:
    """Checks a page cursor."""
    f.only({"type", "page", "skip"})
    return {"type": "page", "page": f.get_int("page", minimum=0), "skip": _skip(f)}


def _token(f: Fields) -> dict:
    """Checks a token cursor (token None means the first page)."""
    f.only({"type", "token", "skip"})
    token = f.data.get("token")
    if token is not None:
        token = f.get_str("token")
    return {"type": "token", "token": token, "skip": _skip(f)}


def _link(f: Fields) -> dict:
    """Checks a link cursor."""
    f.only({"type", "url", "skip"})
    return {"type": "link", "url": f.get_url("url"), "skip": _skip(f)}


def _key(f: Fields) -> dict:
    """Checks a key cursor (after None means the first page)."""
    f.only({"type", "after", "skip"})
    after = f.data.get("after")
    if not (after is None or isinstance(after, str) or is_int(after)):
        f.fail("after", f"must be a string, an integer or null, got {describe(after)}")
    return {"type": "key", "after": after, "skip": _skip(f)}


_VALIDATORS: dict[str, Callable[[Fields], dict]] = {
    "offset": _offset,
    "page": _page,
    "token": _token,
    "link": _link,
    "key": _key,
}


def validate_cursor(cursor: Any) -> dict:
    """Checks a cursor's shape and returns a normalised copy (defaults filled).

    Raises:
        SourceSpecError: If the cursor is not a dict of a known type with valid fields.
    """
    f = Fields(cursor, "cursor")
    ctype = f.get_str("type")
    if ctype not in _VALIDATORS:
        f.fail("type", f"must be one of {', '.join(_VALIDATORS)}, got {ctype!r}")
    return _VALIDATORS[ctype](f)


def expect_cursor(cursor: Any, expected_type: str, source_type: str) -> dict:
    """Validates a cursor and checks it is of the type a source uses."""
    checked = validate_cursor(cursor)
    if checked["type"] != expected_type:
        raise SourceSpecError(
            f"cursor of type {checked['type']!r} cannot be used with source type {source_type!r},"
            f" which uses {expected_type!r} cursors"
        )
    return checked
