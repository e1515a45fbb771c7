"""The Source base class shared by every source type."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Generator

from chunker.batching import Batch, Entry, check_limits, collect
from chunker.cursors import expect_cursor


class Source(ABC):
    """A readable source of items, read batch by batch from JSON-serialisable cursors.

    Subclasses set source_type and cursor_type and implement initial_cursor and _entries.
    """

    source_type: str = ""
    cursor_type: str = "offset"

    @property
    def total_hint(self) -> int | None:
        """Number of items if known without reading, else None."""
        return None

    @abstractmethod
    def initial_cursor(self) -> dict:
        """Returns the cursor of the first item."""

    def read_batch(self, cursor: dict, *, max_items: int, max_bytes: int | None = None) -> Batch:
        """Reads the batch starting at cursor.

        Raises:
            SourceSpecError: If the cursor or limits are invalid for this source.
            SourceReadError: If reading fails; see its retryable attribute.
        """
        checked = self.validate_cursor(cursor)
        check_limits(max_items, max_bytes)
        entries = self._entries(checked, max_items)
        try:
            return collect(entries, checked, max_items, max_bytes)
        finally:
            entries.close()

    def validate_cursor(self, cursor: dict) -> dict:
        """Checks that cursor is well-formed and usable with this source, without reading.

        Raises:
            SourceSpecError: If the cursor is malformed or of the wrong type for this source.
        """
        return self.check_cursor(expect_cursor(cursor, self.cursor_type, self.source_type))

    def check_cursor(self, cursor: dict) -> dict:
        """Hook for source-specific checks of a well-formed cursor; returns the cursor to read from."""
        return cursor

    @abstractmethod
    def _entries(self, cursor: dict, max_items: int) -> Generator[Entry, None, None]:
        """Yields (item, cursor after item) from cursor on; see batching.collect."""
