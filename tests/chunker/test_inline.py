"""Tests for inline and sequence sources and the batch cutting rules."""

from __future__ import annotations

import time
import tracemalloc

import pytest

from chunker import SourceSpecError, open_source
from chunker.batching import item_size

ITEMS = [{"id": i, "text": "é" * (i % 7), "tags": ["a"] * (i % 3)} for i in range(41)]
ITEMS += ["ü", None, 3.5, [1, [2]]]
LIMITS = [(1, None), (3, None), (7, None), (45, None), (100, None), (5, 40), (10, 1), (45, 150), (2, 10_000)]


@pytest.mark.parametrize(("max_items", "max_bytes"), LIMITS)
def test_inline_reads_everything_once_in_order(check_source, max_items, max_bytes):
    check_source(lambda: open_source({"type": "inline", "items": ITEMS}), ITEMS, max_items, max_bytes)


def test_inline_empty_list_gives_one_empty_final_batch():
    source = open_source({"type": "inline", "items": []})
    batch = source.read_batch(source.initial_cursor(), max_items=10, max_bytes=None)
    assert (batch.items, batch.end_cursor, batch.size_bytes) == ([], None, 0)
    assert source.total_hint == 0


def test_exact_fit_ends_with_none_and_cursor_past_end_is_empty():
    source = open_source({"type": "inline", "items": [1, 2, 3, 4]})
    batch = source.read_batch(source.initial_cursor(), max_items=4, max_bytes=None)
    assert batch.items == [1, 2, 3, 4] and batch.end_cursor is None
    past = source.read_batch({"type": "offset", "offset": 99}, max_items=4, max_bytes=None)
    assert (past.items, past.end_cursor) == ([], None)


def test_max_bytes_cuts_before_overflow_and_oversize_item_stands_alone():
    items = ["a" * 10, "b" * 10, "c" * 100, "d"]  # JSON sizes 12, 12, 102, 3
    source = open_source({"type": "inline", "items": items})
    first = source.read_batch(source.initial_cursor(), max_items=10, max_bytes=30)
    assert first.items == items[:2] and first.size_bytes == 24
    second = source.read_batch(first.end_cursor, max_items=10, max_bytes=30)
    assert second.items == [items[2]] and second.size_bytes == 102
    third = source.read_batch(second.end_cursor, max_items=10, max_bytes=30)
    assert third.items == ["d"] and third.end_cursor is None


def test_item_size_is_compact_utf8_json():
    assert item_size({"a": [1, 2], "b": "é"}) == len('{"a":[1,2],"b":"é"}'.encode())


class LazyList:
    """A len()+slice-only adapter (like one over a Redis list) that records the slices asked for."""

    def __init__(self, data: list) -> None:
        self.data = data
        self.slices: list[tuple[int, int]] = []

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: slice) -> list:
        assert isinstance(index, slice), "only slicing is supported"
        self.slices.append((index.start, index.stop))
        return self.data[index]


def test_inline_items_adapter_overrides_spec_items_and_is_only_sliced(check_source):
    lazy = LazyList(list(range(100, 150)))
    source = open_source({"type": "inline"}, inline_items=lazy)
    assert source.total_hint == 50
    batches = check_source(lambda: open_source({"type": "inline", "items": ["ignored"]}, inline_items=lazy),
                           list(range(100, 150)), 8)
    assert len(batches) == 7
    assert all(stop - start <= 9 for start, stop in lazy.slices)


def test_inline_items_rejected_for_other_source_types():
    with pytest.raises(SourceSpecError, match="inline_items"):
        open_source({"type": "sequence", "count": 3}, inline_items=[1])


@pytest.mark.parametrize(("max_items", "max_bytes"), [(1, None), (4, None), (23, None), (50, None), (6, 5)])
def test_sequence_reads_range(check_source, max_items, max_bytes):
    check_source(lambda: open_source({"type": "sequence", "count": 23, "start": 5}), list(range(5, 28)),
                 max_items, max_bytes)


def test_sequence_defaults_and_empty():
    source = open_source({"type": "sequence", "count": 0})
    assert source.total_hint == 0
    batch = source.read_batch(source.initial_cursor(), max_items=3, max_bytes=None)
    assert (batch.items, batch.end_cursor) == ([], None)


def test_million_item_sequence_is_lazy_and_fast():
    tracemalloc.start()
    started = time.perf_counter()
    try:
        source = open_source({"type": "sequence", "count": 1_000_000, "start": 1})
        cursor = source.initial_cursor()
        first = source.read_batch(cursor, max_items=1000, max_bytes=None)
        last = source.read_batch({"type": "offset", "offset": 999_990}, max_items=1000, max_bytes=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert time.perf_counter() - started < 1.0
    assert peak < 1_000_000, f"peak {peak} bytes suggests the sequence was materialised"
    assert source.total_hint == 1_000_000
    assert first.items == list(range(1, 1001)) and first.end_cursor == {"type": "offset", "offset": 1000}
    assert last.items == list(range(999_991, 1_000_001)) and last.end_cursor is None
