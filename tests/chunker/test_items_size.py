"""items_size (one encoding per batch, used when there is no byte limit) agrees with item_size per item."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from chunker.batching import item_size, items_size
from chunker.errors import SourceReadError

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=5), inner, max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(st.lists(JSON, max_size=8))
def test_items_size_is_the_sum_of_item_sizes(items):
    assert items_size(items) == sum(item_size(i) for i in items)


def test_items_size_refuses_what_json_cannot_encode():
    with pytest.raises(SourceReadError, match="not JSON-serialisable"):
        items_size([1, object()])
