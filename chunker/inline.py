"""In-memory sources: inline item lists and integer sequences."""

from __future__ import annotations

from collections.abc import Generator, Sequence
from typing import Any

from chunker.batching import Entry
from chunker.cursors import offset_cursor
from chunker.errors import SourceSpecError
from chunker.source import Source
from chunker.validation import Fields, describe


def validate_inline(f: Fields, *, require_items: bool = True) -> dict:
    """Checks an inline spec: {"type": "inline", "items": [...]}; items are not copied."""
    f.only({"type", "items"})
    spec: dict[str, Any] = {"type": "inline"}
    if "items" not in f.data:
        if require_items:
            f.fail("items", "is required")
        return spec
    if not isinstance(f.data["items"], list):
        f.fail("items", f"must be a list, got {describe(f.data['items'])}")
    spec["items"] = f.data["items"]
    return spec


#: Sequence items are signed 64-bit integers (what JSON parsers and the batchgate API accept).
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1


def validate_sequence(f: Fields) -> dict:
    """Checks a sequence spec: {"type": "sequence", "count": N, "start": 0}.

    Every integer it yields, start .. start + count - 1, must be a signed 64-bit integer.
    """
    f.only({"type", "count", "start"})
    count, start = f.get_int("count", minimum=0), f.get_int("start", 0)
    if count > INT64_MAX:
        f.fail("count", f"must be at most {INT64_MAX} (cursor offsets are signed 64-bit integers)")
    if not INT64_MIN <= start <= INT64_MAX:
        f.fail("start", f"must be a signed 64-bit integer ({INT64_MIN} .. {INT64_MAX})")
    if count > INT64_MAX - start + 1:
        f.fail("count", f"runs the sequence past {INT64_MAX} (the largest signed 64-bit integer): with "
                        f"start {start} it may be at most {INT64_MAX - start + 1}")
    return {"type": "sequence", "count": count, "start": start}


class InlineSource(Source):
    """Items from a list, or any object supporting len() and slicing (e.g. a lazy adapter)."""

    source_type = "inline"

    def __init__(self, items: Sequence) -> None:
        if not (hasattr(items, "__len__") and hasattr(items, "__getitem__")):
            raise SourceSpecError(f"inline items must support len() and slicing, got {describe(items)}")
        self._items = items

    @property
    def total_hint(self) -> int | None:
        """Number of items (len() of the underlying object)."""
        return len(self._items)

    def initial_cursor(self) -> dict:
        """Returns offset 0."""
        return offset_cursor(0)

    def _entries(self, cursor: dict, max_items: int) -> Generator[Entry, None, None]:
        start = cursor["offset"]
        # One extra item lets the batch see whether anything follows.
        for i, item in enumerate(self._items[start : start + max_items + 1], start + 1):
            yield item, offset_cursor(i)


class SequenceSource(Source):
    """The integers start .. start+count-1, generated lazily."""

    source_type = "sequence"

    def __init__(self, count: int, start: int) -> None:
        self._count = count
        self._start = start

    @property
    def total_hint(self) -> int | None:
        """Number of integers in the sequence."""
        return self._count

    def initial_cursor(self) -> dict:
        """Returns offset 0."""
        return offset_cursor(0)

    def _entries(self, cursor: dict, max_items: int) -> Generator[Entry, None, None]:
        for i in range(cursor["offset"], min(self._count, cursor["offset"] + max_items + 1)):
            yield self._start + i, offset_cursor(i + 1)
