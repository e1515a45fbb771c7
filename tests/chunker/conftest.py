"""Fixtures for chunker tests: real local HTTP servers and a whole-source checker."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from chunker import Batch, Source
from tests.chunker.helpers import App, Server, check_batches, file_app, read_all, roundtrip


@pytest.fixture
def serve() -> Iterator[Callable[[App], Server]]:
    """Starts servers for a test and stops them afterwards."""
    servers: list[Server] = []

    def start(app: App) -> Server:
        servers.append(Server(app))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


@pytest.fixture
def file_server(serve: Callable[[App], Server]) -> Callable[[bytes, bool], Server]:
    """Returns a factory for servers serving a file body, with or without Range support."""
    return lambda body, honour_range: serve(file_app(body, honour_range))


@pytest.fixture
def check_source() -> Callable[..., list[Batch]]:
    """Returns check(make_source, expected, max_items, max_bytes=None) -> batches.

    Reads the whole source, checks the items and cut rules, then checks that a fresh
    source resumed from every intermediate (JSON round-tripped) end cursor continues
    with the same next batch, and that resuming mid-way yields exactly the rest.
    """

    def check(make_source: Callable[[], Source], expected: list, max_items: int,
              max_bytes: int | None = None) -> list[Batch]:
        batches = read_all(make_source(), max_items=max_items, max_bytes=max_bytes)
        check_batches(batches, expected, max_items, max_bytes)
        for before, after in zip(batches, batches[1:]):
            cursor = roundtrip(before.end_cursor)
            again = make_source().read_batch(cursor, max_items=max_items, max_bytes=max_bytes)
            assert (again.items, again.end_cursor) == (after.items, after.end_cursor)
        if len(batches) > 2:
            middle = len(batches) // 2
            rest = read_all(make_source(), max_items=max_items, max_bytes=max_bytes,
                            cursor=roundtrip(batches[middle - 1].end_cursor))
            done = sum(len(b.items) for b in batches[:middle])
            assert [i for b in rest for i in b.items] == expected[done:]
        return batches

    return check
