"""Helpers for chunker tests: a real local HTTP server and whole-source checks."""

from __future__ import annotations

import json
import re
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit

from chunker import Batch, Source
from chunker.batching import item_size

# An app maps (path, query, request headers) to (status, response headers, body).
App = Callable[[str, dict[str, list[str]], Any], tuple[int, dict[str, str], bytes]]


class Server:
    """A threaded HTTP server on 127.0.0.1 that logs every request and the bytes it sent."""

    def __init__(self, app: App) -> None:
        self.log: list[dict[str, Any]] = []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                parts = urlsplit(self.path)
                status, headers, body = app(parts.path, parse_qs(parts.query), self.headers)
                entry: dict[str, Any] = {"path": parts.path, "query": parse_qs(parts.query),
                                         "headers": dict(self.headers), "status": status, "sent": 0}
                server.log.append(entry)
                self.send_response(status)
                for name, value in headers.items():
                    self.send_header(name, value)
                if "Content-Length" not in headers:
                    self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                try:
                    for i in range(0, len(body), 4096):
                        self.wfile.write(body[i : i + 4096])
                        entry["sent"] += len(body[i : i + 4096])
                except (BrokenPipeError, ConnectionResetError):
                    pass
                finally:
                    entry["done"] = True

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def finished_log(self, timeout_s: float = 5.0) -> list[dict[str, Any]]:
        """Returns the request log once every handler has finished writing its response."""
        deadline = time.monotonic() + timeout_s
        while not all(entry.get("done") for entry in self.log) and time.monotonic() < deadline:
            time.sleep(0.005)
        return self.log

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def file_app(body: bytes, honour_range: bool) -> App:
    """Serves body at any path; with honour_range, answers "Range: bytes=N-" with 206/416."""

    def app(path: str, query: dict, headers: Any) -> tuple[int, dict[str, str], bytes]:
        if path == "/missing":
            return 404, {}, b"not found"
        match = re.fullmatch(r"bytes=(\d+)-", headers.get("Range") or "")
        if not (honour_range and match):
            return 200, {}, body
        start = int(match.group(1))
        if start >= len(body):
            return 416, {"Content-Range": f"bytes */{len(body)}"}, b""
        return 206, {"Content-Range": f"bytes {start}-{len(body) - 1}/{len(body)}"}, body[start:]

    return app


def roundtrip(cursor: dict | None) -> Any:
    """Passes a cursor through JSON, as a job store would."""
    return json.loads(json.dumps(cursor))


def read_all(
    source: Source, *, max_items: int, max_bytes: int | None = None, cursor: dict | None = None
) -> list[Batch]:
    """Reads a source to exhaustion, round-tripping every cursor through JSON."""
    batches: list[Batch] = []
    cursor = source.initial_cursor() if cursor is None else cursor
    while cursor is not None:
        batch = source.read_batch(roundtrip(cursor), max_items=max_items, max_bytes=max_bytes)
        batches.append(batch)
        cursor = batch.end_cursor
        assert len(batches) < 100_000, "source never ends"
    return batches


def check_batches(batches: list[Batch], expected: list, max_items: int, max_bytes: int | None) -> None:
    """Asserts batches hold exactly expected, in order, cut by the documented rules."""
    flat = [item for batch in batches for item in batch.items]
    assert flat == expected
    assert batches[-1].end_cursor is None
    assert all(b.end_cursor is not None for b in batches[:-1])
    assert all(b.items for b in batches[:-1]), "only the last batch may be empty"
    done = 0
    for batch in batches:
        assert batch.size_bytes == sum(item_size(i) for i in batch.items)
        assert len(batch.items) <= max_items
        if max_bytes is not None and len(batch.items) > 1:
            assert batch.size_bytes <= max_bytes
        done += len(batch.items)
        if batch.end_cursor is not None and done < len(expected):
            full = len(batch.items) == max_items
            overflow = max_bytes is not None and batch.size_bytes + item_size(expected[done]) > max_bytes
            assert full or overflow
        elif batch.end_cursor is not None:
            assert len(batch.items) == max_items, "a source may only miss the end on a full batch"
