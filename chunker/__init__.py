"""Split long jobs into batches read from inline lists, sequences, files and HTTP APIs.

Source specs (validate_spec fills the defaults shown):

- {"type": "inline", "items": [...]}
- {"type": "sequence", "count": N, "start": 0}
- {"type": "jsonl", "path" | "url": ..., "max_record_bytes"?: N}
- {"type": "csv", "path" | "url": ..., "delimiter": ",", "header": true, "max_record_bytes"?: N}
- {"type": "http_json", "url": ..., "items_field": "data", "headers": {}, "params": {},
  "pagination": {"style": "none" | "offset" | "page" | "token" | "link" | "key", ...}}

Local paths are opened through chunker.localfiles: /proc, /dev, /sys and anything but a regular file
are never read, and open_source's file_access confines paths to roots (a server passes its roots; the
default reads any other path). A line (jsonl) or record (csv) longer than max_record_bytes (default
1 MiB, absent from the normalised spec) fails the read; no reader holds more than one batch in memory.

Cursors are JSON-serialisable dicts (see chunker.cursors). A Batch's end_cursor is where
the next batch starts, or None once the source is exhausted.

Typical use::

    source = open_source(validate_spec(spec))
    cursor = source.initial_cursor()
    while cursor is not None:
        batch = source.read_batch(cursor, max_items=100, max_bytes=256_000)
        handle(batch.items)
        cursor = batch.end_cursor
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import requests

from chunker import cursors
from chunker.batching import Batch
from chunker.errors import ChunkerError, SourceReadError, SourceSpecError
from chunker.files import CsvSource, JsonlSource, validate_file_spec
from chunker.http_api import HttpJsonSource, validate_http_json
from chunker.inline import InlineSource, SequenceSource, validate_inline, validate_sequence
from chunker.localfiles import DEFAULT_MAX_RECORD_BYTES, FileAccess, FileAccessError
from chunker.source import Source
from chunker.validation import Fields

__all__ = [
    "Batch",
    "ChunkerError",
    "DEFAULT_MAX_RECORD_BYTES",
    "FileAccess",
    "FileAccessError",
    "Source",
    "SourceReadError",
    "SourceSpecError",
    "open_source",
    "validate_cursor",
    "validate_spec",
]

_VALIDATORS: dict[str, Callable[[Fields], dict]] = {
    "inline": validate_inline,
    "sequence": validate_sequence,
    "jsonl": lambda f: validate_file_spec(f, "jsonl"),
    "csv": lambda f: validate_file_spec(f, "csv"),
    "http_json": validate_http_json,
}


def _validate(spec: Any, *, require_items: bool) -> dict:
    """Dispatches to the validator of the spec's type."""
    f = Fields(spec, "source spec")
    source_type = f.get_str("type")
    if source_type not in _VALIDATORS:
        f.fail("type", f"must be one of {', '.join(_VALIDATORS)}, got {source_type!r}")
    if source_type == "inline":
        return validate_inline(f, require_items=require_items)
    return _VALIDATORS[source_type](f)


def validate_spec(spec: dict) -> dict:
    """Checks a source spec without reading any data and returns a normalised copy.

    Inline items are not copied: the returned spec shares the "items" list.

    Raises:
        SourceSpecError: If the spec is invalid; the message names the offending field.
    """
    return _validate(spec, require_items=True)


def open_source(
    spec: dict,
    *,
    session: requests.Session | None = None,
    timeout_s: float = 30.0,
    inline_items: Sequence | None = None,
    file_access: FileAccess | None = None,
) -> Source:
    """Validates spec and returns a Source for it; performs no I/O.

    Args:
        spec: Source spec (see validate_spec).
        session: requests session for URL sources; a new one is made when needed if None.
        timeout_s: Connect and read timeout for each HTTP request, in seconds.
        inline_items: For inline sources, any object supporting len() and obj[a:b];
            overrides spec["items"] (which may then be omitted).
        file_access: For jsonl/csv paths: the roots paths must resolve into, directories never read
            and the cap on max_record_bytes (checked when reading). None: any path but /proc, /dev,
            /sys (for trusted callers; a server must pass its roots).

    Raises:
        SourceSpecError: If spec or the arguments are invalid.
    """
    if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or not 0 < timeout_s < math.inf:
        raise SourceSpecError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
    checked = _validate(spec, require_items=inline_items is None)
    if inline_items is not None and checked["type"] != "inline":
        raise SourceSpecError(f"inline_items can only be used with an inline source, not {checked['type']!r}")
    return _build(checked, session, timeout_s, inline_items, file_access)


def validate_cursor(cursor: Any, spec: dict | None = None) -> dict:
    """Checks a cursor and returns a normalised copy, without reading any data.

    Args:
        cursor: The cursor to check.
        spec: If given, also check the cursor fits this source (type, first page, link
            origin); inline "items" may be omitted.

    Raises:
        SourceSpecError: If the cursor (or spec) is invalid; the message names the field.
    """
    if spec is None:
        return cursors.validate_cursor(cursor)
    return _build(_validate(spec, require_items=False), None, 30.0, None).validate_cursor(cursor)


def _build(checked: dict, session: requests.Session | None, timeout_s: float, inline_items: Any,
           file_access: FileAccess | None = None) -> Source:
    """Creates the Source for a validated spec."""
    source_type = checked["type"]
    if source_type == "inline":
        return InlineSource(checked.get("items", []) if inline_items is None else inline_items)
    if source_type == "sequence":
        return SequenceSource(checked["count"], checked["start"])
    if source_type == "http_json":
        return HttpJsonSource(checked, session, timeout_s)
    file_source = JsonlSource if source_type == "jsonl" else CsvSource
    return file_source(checked, session, timeout_s, access=file_access or FileAccess())
