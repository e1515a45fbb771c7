"""Line-oriented file sources (jsonl, csv) read from a local path or streamed over HTTP.

Cursors are offset cursors carrying the byte position of the next record, so resuming
seeks (local files) or sends a Range request (URLs) instead of re-reading the start.
"""

from __future__ import annotations

import csv
import json
import re
from collections.abc import Generator, Iterable, Iterator
from contextlib import closing
from typing import Any, NamedTuple

import requests

from chunker.batching import Entry, ReadFailure
from chunker.cursors import offset_cursor
from chunker.errors import SourceReadError
from chunker.httputil import display_url, http_get, request_error
from chunker.localfiles import UNCONFINED, FileAccess, ensure_csv_field_limit, open_file
from chunker.source import Source
from chunker.validation import Fields

_CHUNK_BYTES = 64 * 1024
_BOM = b"\xef\xbb\xbf"
_CONTENT_RANGE = re.compile(r"bytes\s+(\d+)-")


def validate_file_spec(f: Fields, source_type: str) -> dict:
    """Checks a jsonl/csv spec: exactly one of "path" or "url", plus csv options."""
    allowed = {"type", "path", "url", "max_record_bytes"}
    allowed |= {"delimiter", "header"} if source_type == "csv" else set()
    f.only(allowed)
    if ("path" in f.data) == ("url" in f.data):
        f.fail("path", "or 'url' must be given (exactly one of them)")
    spec: dict[str, Any] = {"type": source_type}
    if "path" in f.data:
        spec["path"] = f.get_str("path")
    else:
        spec["url"] = f.get_url("url")
    if source_type == "csv":
        delimiter = f.get_str("delimiter", ",")
        if len(delimiter) != 1 or delimiter in '\r\n"':
            f.fail("delimiter", f"must be one character, not a quote or newline, got {delimiter!r}")
        spec["delimiter"] = delimiter
        spec["header"] = f.get_bool("header", True)
    if "max_record_bytes" in f.data:  # absent: localfiles.DEFAULT_MAX_RECORD_BYTES (not filled in)
        spec["max_record_bytes"] = f.get_int("max_record_bytes", minimum=1)
    return spec


def _file_chunks(path: str, byte: int, access: FileAccess) -> Generator[bytes, None, None]:
    """Yields the bytes of a local file from position byte on, opened as access allows (localfiles)."""
    fd, _ = open_file(path, access)
    try:
        with open(fd, "rb", buffering=0) as fh:
            fh.seek(byte)
            while chunk := fh.read(_CHUNK_BYTES):
                yield chunk
    except OSError as exc:
        permanent = (FileNotFoundError, PermissionError, IsADirectoryError, NotADirectoryError)
        reason = exc.strerror or type(exc).__name__
        retryable = not isinstance(exc, permanent)
        raise SourceReadError(f"cannot read {path}: {reason}", retryable=retryable) from None


def _range_start(resp: requests.Response, url: str) -> int:
    """Returns the first byte position of a 206 response."""
    match = _CONTENT_RANGE.match(resp.headers.get("Content-Range", ""))
    if not match:
        raise SourceReadError(f"GET {display_url(url)}: 206 without a valid Content-Range", retryable=False)
    return int(match.group(1))


def _http_chunks(
    session: requests.Session, url: str, byte: int, timeout_s: float
) -> Generator[bytes, None, None]:
    """Streams the body of url from position byte on, using Range when the server honours it."""
    headers = {"Accept-Encoding": "identity"}
    if byte:
        headers["Range"] = f"bytes={byte}-"
    resp = http_get(session, url, timeout_s=timeout_s, headers=headers, stream=True, accept=(416,))
    try:
        if resp.status_code == 416:  # range starts at or past the end: nothing left
            return
        skip = byte - _range_start(resp, url) if resp.status_code == 206 else byte
        if skip < 0:
            message = f"GET {display_url(url)}: server sent a range starting after byte {byte}"
            raise SourceReadError(message, retryable=False)
        for chunk in resp.iter_content(_CHUNK_BYTES):
            if skip >= len(chunk):
                skip -= len(chunk)
                continue
            yield chunk[skip:] if skip else chunk
            skip = 0
    except requests.RequestException as exc:
        raise request_error(exc, url) from None
    finally:
        resp.close()


class _LineTooLong(Exception):
    """A line (or csv record) is longer than the source's max_record_bytes."""


def _content_length(buf: bytes | bytearray, start: int = 0, end: int | None = None) -> int:
    """Length of the line buf[start:end] without its b"\\n" or b"\\r\\n" terminator."""
    end = len(buf) if end is None else end
    if end > start and buf[end - 1] == 0x0A:
        end -= 1
        if end > start and buf[end - 1] == 0x0D:
            end -= 1
    return end - start


def _split_lines(chunks: Generator[bytes, None, None], limit: int) -> Generator[bytes, None, None]:
    """Yields lines including their b"\\n" terminator (the last line may lack one).

    Raises _LineTooLong once a line is longer than limit bytes (terminator excluded): the buffer
    never holds more than limit + 1 bytes of one line plus one chunk, whatever the stream holds.
    """
    buf = bytearray()
    with closing(chunks):
        for chunk in chunks:
            scan = len(buf)
            buf += chunk
            start = 0
            while (nl := buf.find(b"\n", scan)) >= 0:
                if _content_length(buf, start, nl + 1) > limit:
                    raise _LineTooLong
                yield bytes(buf[start : nl + 1])
                start = scan = nl + 1
            del buf[:start]
            if len(buf) > limit + 1:  # no newline within limit + 1 bytes (a CR may precede the LF)
                raise _LineTooLong
    if buf:
        if _content_length(buf) > limit:
            raise _LineTooLong
        yield bytes(buf)


class _Pos:
    """Mutable read position: records passed, byte offset and physical lines passed."""

    def __init__(self, offset: int, byte: int, line: int | None) -> None:
        self.offset, self.byte, self.line = offset, byte, line

    def advance(self, raw: bytes) -> tuple[bytes, str]:
        """Moves past one physical line; returns its payload (BOM stripped) and its location."""
        start, self.byte = self.byte, self.byte + len(raw)
        where = f"byte {start}"
        if self.line is not None:
            self.line += 1
            where = f"line {self.line} ({where})"
        return (raw[len(_BOM) :] if start == 0 and raw.startswith(_BOM) else raw), where

    def cursor(self) -> dict:
        """Returns the cursor of the current position."""
        return offset_cursor(self.offset, self.byte, self.line)

    def next_where(self) -> str:
        """Returns the location of the next physical line, without moving."""
        return f"byte {self.byte}" if self.line is None else f"line {self.line + 1} (byte {self.byte})"


def _resume(cursor: dict) -> tuple[_Pos, int]:
    """Returns where to start reading and how many records to skip first."""
    if "byte" in cursor:
        return _Pos(cursor["offset"], cursor["byte"], cursor.get("line")), 0
    return _Pos(0, 0, 0), cursor["offset"]  # no byte position: scan from the start


class _FileSource(Source):
    """Shared plumbing for jsonl and csv sources."""

    def __init__(self, spec: dict, session: requests.Session | None, timeout_s: float,
                 *, access: FileAccess = UNCONFINED) -> None:
        self._path: str | None = spec.get("path")
        self._url: str | None = spec.get("url")
        self._where = self._path if self._path is not None else display_url(self._url or "")
        self._session = session
        self._timeout_s = timeout_s
        self._access = access
        self._limit: int = access.record_limit(spec)

    def initial_cursor(self) -> dict:
        """Returns the start of the file."""
        return offset_cursor(0, 0, 0)

    def _lines(self, byte: int) -> Generator[bytes, None, None]:
        """Returns the lines of the file from position byte on."""
        if self._path is not None:
            return _split_lines(_file_chunks(self._path, byte, self._access), self._limit)
        if self._session is None:
            self._session = requests.Session()
        return _split_lines(_http_chunks(self._session, self._url or "", byte, self._timeout_s), self._limit)

    def _failure(self, where: str, problem: str) -> ReadFailure:
        """Returns a non-retryable failure naming the file and location."""
        message = f"{self.source_type} {self._where}, {where}: {problem}"
        return ReadFailure(SourceReadError(message, retryable=False))

    def _too_long(self, where: str, what: str) -> ReadFailure:
        """Returns the failure for a line or record longer than max_record_bytes (never its content)."""
        return self._failure(where, f"{what} is longer than max_record_bytes ({self._limit} bytes)")


class JsonlSource(_FileSource):
    """One JSON value per line; blank lines are skipped."""

    source_type = "jsonl"

    def _entries(self, cursor: dict, max_items: int) -> Generator[Entry, None, None]:
        pos, skip = _resume(cursor)
        with closing(self._lines(pos.byte)) as lines:
            try:
                for raw in lines:
                    payload, where = pos.advance(raw)
                    payload = payload.strip()
                    if not payload:
                        continue
                    pos.offset += 1
                    if pos.offset <= skip:
                        continue
                    try:
                        item = json.loads(payload)
                    except ValueError as exc:  # includes UnicodeDecodeError
                        yield self._failure(where, f"invalid JSON: {exc}"), None
                        return
                    yield item, pos.cursor()
            except _LineTooLong:
                yield self._too_long(pos.next_where(), "line"), None


class _Header(NamedTuple):
    """A CSV header row and the position of the first data record after it."""

    names: list[str]
    byte: int
    line: int | None


class CsvSource(_FileSource):
    """CSV records as dicts (header row) or lists; quoted fields may contain newlines."""

    source_type = "csv"

    def __init__(self, spec: dict, session: requests.Session | None, timeout_s: float,
                 *, access: FileAccess = UNCONFINED) -> None:
        super().__init__(spec, session, timeout_s, access=access)
        self._delimiter: str = spec["delimiter"]
        self._has_header: bool = spec["header"]
        self._header: _Header | None = None

    def _rows(self, pos: _Pos) -> Generator[tuple[list[str] | ReadFailure, str], None, None]:
        """Yields (row, location) for non-empty records from pos on, advancing pos.

        A record (its physical lines together) longer than max_record_bytes fails before the csv
        module holds more than that; the csv field size limit is raised to stay out of the way.
        """
        where = ""
        record_bytes = 0

        def text_lines(lines: Iterable[bytes]) -> Iterator[str]:
            """Decodes lines for the csv module, tracking where each record starts and its size."""
            nonlocal where, record_bytes
            for raw in lines:
                if record_bytes + _content_length(raw) > self._limit:
                    raise _LineTooLong
                record_bytes += len(raw)
                payload, line_where = pos.advance(raw)
                where = where or line_where
                yield payload.decode("utf-8")

        ensure_csv_field_limit(self._limit)
        with closing(self._lines(pos.byte)) as lines:
            reader = csv.reader(text_lines(lines), delimiter=self._delimiter)
            while True:
                where, record_bytes = "", 0
                try:
                    row = next(reader)
                except StopIteration:
                    return
                except _LineTooLong:
                    where = where or pos.next_where()
                    yield self._too_long(where, "record"), where
                    return
                except (csv.Error, UnicodeDecodeError) as exc:
                    yield self._failure(where, f"invalid CSV: {exc}"), where
                    return
                if row:
                    yield row, where

    def _take_header(self, rows: Iterator[tuple[Any, str]], pos: _Pos) -> _Header:
        """Consumes the header row from rows; pos must be the position rows advance."""
        for row, where in rows:
            if isinstance(row, ReadFailure):
                raise row.error
            if len(set(row)) != len(row):
                raise self._failure(where, "header has duplicate column names").error
            return _Header(row, pos.byte, pos.line)
        return _Header([], pos.byte, pos.line)

    def _entries(self, cursor: dict, max_items: int) -> Generator[Entry, None, None]:
        pos, skip = _resume(cursor)
        if self._has_header and self._header is None and pos.byte > 0:
            head = _Pos(0, 0, 0)
            with closing(self._rows(head)) as head_rows:
                self._header = self._take_header(head_rows, head)
        if self._header is not None and pos.byte < self._header.byte:
            pos.byte, pos.line = self._header.byte, self._header.line
        with closing(self._rows(pos)) as rows:
            if self._has_header and self._header is None:  # reading from byte 0: header comes first
                self._header = self._take_header(rows, pos)
            for row, where in rows:
                if isinstance(row, ReadFailure):
                    yield row, None
                    return
                pos.offset += 1
                if pos.offset <= skip:
                    continue
                yield self._item(row, where), pos.cursor()

    def _item(self, row: list[str], where: str) -> Any:
        """Returns a row as a dict keyed by the header, or as a list without one."""
        if self._header is None:
            return row
        if len(row) != len(self._header.names):
            expected = len(self._header.names)
            return self._failure(where, f"row has {len(row)} fields but the header has {expected}")
        return dict(zip(self._header.names, row, strict=True))
