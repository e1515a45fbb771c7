"""Batch type and the helper that cuts a stream of items into one batch."""

from __future__ import annotations

import json
from collections.abc import Generator
from dataclasses import dataclass
from typing import Any

from chunker.errors import SourceReadError, SourceSpecError
from chunker.validation import describe, is_int

#: Yielded by paged readers between pages: "more may follow, but reading on costs a request".
PAGE_BREAK: Any = object()


@dataclass(frozen=True)
class Batch:
    """A run of consecutive items read from a source.

    Attributes:
        items: The items, in source order.
        start_cursor: Cursor this batch was read from.
        end_cursor: Cursor where the next batch starts, or None if the source is exhausted.
        size_bytes: Sum of the compact JSON UTF-8 sizes of the items.
    """

    items: list
    start_cursor: dict
    end_cursor: dict | None
    size_bytes: int


@dataclass(frozen=True)
class ReadFailure:
    """Stands in for an item that could not be decoded; raised only if it would enter a batch."""

    error: SourceReadError


# A stream entry: (item | PAGE_BREAK | ReadFailure, cursor just after that item).
Entry = tuple[Any, "dict | None"]


def item_size(item: Any) -> int:
    """Returns the size in bytes of an item as compact UTF-8 JSON."""
    try:
        text = json.dumps(item, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise SourceReadError(f"item is not JSON-serialisable: {exc}", retryable=False) from None
    return len(text.encode())


def check_limits(max_items: Any, max_bytes: Any) -> None:
    """Checks read_batch limits."""
    if not is_int(max_items) or max_items < 1:
        raise SourceSpecError(f"max_items must be an integer >= 1, got {describe(max_items)}")
    if max_bytes is not None and (not is_int(max_bytes) or max_bytes < 1):
        raise SourceSpecError(f"max_bytes must be null or an integer >= 1, got {describe(max_bytes)}")


def collect(
    entries: Generator[Entry, None, None], start: dict, max_items: int, max_bytes: int | None
) -> Batch:
    """Takes items from entries until a limit is hit, peeking one entry to detect exhaustion.

    The batch stops at max_items, or before an item that would push size_bytes over
    max_bytes (a batch always holds at least one item). end_cursor is None only when
    entries ran out; a PAGE_BREAK met with a full batch ends it without fetching more.
    """
    if max_bytes is None:
        return _collect_by_count(entries, start, max_items)
    items: list = []
    size = 0
    end = start
    for item, after in entries:
        if item is PAGE_BREAK:
            if len(items) >= max_items:
                return Batch(items, start, end, size)
            continue
        if len(items) >= max_items:
            return Batch(items, start, end, size)
        if isinstance(item, ReadFailure):
            raise item.error
        n = item_size(item)
        if items and max_bytes is not None and size + n > max_bytes:
            return Batch(items, start, end, size)
        items.append(item)
        size += n
        end = after
    return Batch(items, start, None, size)


def _collect_by_count(entries: Generator[Entry, None, None], start: dict, max_items: int) -> Batch:
    """collect without a byte limit: the same cut, with the items sized once, together (one JSON encoding
    per batch instead of one per item: planning ahead reads many batches per lease)."""
    items: list = []
    end = start
    for item, after in entries:
        if item is PAGE_BREAK:
            if len(items) >= max_items:
                return Batch(items, start, end, items_size(items))
            continue
        if len(items) >= max_items:
            return Batch(items, start, end, items_size(items))
        if isinstance(item, ReadFailure):
            raise item.error
        items.append(item)
        end = after
    return Batch(items, start, None, items_size(items))


def items_size(items: list) -> int:
    """sum(item_size(i) for i in items), from one encoding of the list: "[" + items joined by "," + "]"."""
    if not items:
        return 0
    try:
        text = json.dumps(items, separators=(",", ":"), ensure_ascii=False)
    except (TypeError, ValueError) as exc:
        raise SourceReadError(f"item is not JSON-serialisable: {exc}", retryable=False) from None
    return len(text.encode()) - len(items) - 1
