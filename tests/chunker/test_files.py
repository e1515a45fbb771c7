"""Tests for jsonl and csv sources, local and streamed from a real local HTTP server."""

from __future__ import annotations

import csv
import io
import json
import tracemalloc

import pytest

from chunker import SourceReadError, open_source, validate_spec
from tests.chunker.helpers import read_all, roundtrip

JSONL_ITEMS = [{"id": i, "name": "ñame-" + "é" * (i % 4)} for i in range(30)]
JSONL_ITEMS += ["text", 42, None, [1, {"x": []}]]


def make_jsonl(items: list) -> bytes:
    """Encodes items as JSONL with a BOM, blank lines, CRLF endings and no final newline."""
    lines = []
    for i, item in enumerate(items):
        lines.append(json.dumps(item, ensure_ascii=False) + ("\r\n" if i % 3 else "\n"))
        if i % 5 == 0:
            lines.append("\n   \n")
    return b"\xef\xbb\xbf" + "".join(lines).rstrip("\n").encode()


CSV_ROWS = [["id", "text", "note"]] + [
    [str(i), f"row {i}, with comma" if i % 2 else "multi\nline \"quoted\"\r\ntext", "é" * (i % 3)]
    for i in range(25)
]


def make_csv(rows: list[list[str]], delimiter: str = ",") -> bytes:
    """Encodes rows as CSV with CRLF endings and a blank line in the middle."""
    out = io.StringIO(newline="")
    writer = csv.writer(out, delimiter=delimiter)
    writer.writerows(rows[:5])
    out.write("\r\n")
    writer.writerows(rows[5:])
    return out.getvalue().encode()


CSV_DICTS = [dict(zip(CSV_ROWS[0], row)) for row in CSV_ROWS[1:]]
LIMITS = [(1, None), (4, None), (34, None), (100, None), (3, 60), (50, 1)]


@pytest.fixture
def jsonl_path(tmp_path):
    """A local JSONL file holding JSONL_ITEMS."""
    path = tmp_path / "items.jsonl"
    path.write_bytes(make_jsonl(JSONL_ITEMS))
    return str(path)


@pytest.fixture
def csv_path(tmp_path):
    """A local CSV file holding CSV_ROWS."""
    path = tmp_path / "rows.csv"
    path.write_bytes(make_csv(CSV_ROWS))
    return str(path)


@pytest.mark.parametrize(("max_items", "max_bytes"), LIMITS)
def test_local_jsonl_reads_everything_once(check_source, jsonl_path, max_items, max_bytes):
    spec = {"type": "jsonl", "path": jsonl_path}
    check_source(lambda: open_source(spec), JSONL_ITEMS, max_items, max_bytes)


def test_jsonl_cursor_bytes_point_at_the_next_record(jsonl_path):
    data = open(jsonl_path, "rb").read()
    batches = read_all(open_source({"type": "jsonl", "path": jsonl_path}), max_items=3)
    done = 0
    for batch in batches[:-1]:
        done += len(batch.items)
        rest = [line for line in data[batch.end_cursor["byte"] :].splitlines() if line.strip()]
        assert json.loads(rest[0]) == JSONL_ITEMS[done]
        assert batch.end_cursor["offset"] == done


def test_jsonl_cursor_without_byte_scans_from_start(jsonl_path):
    source = open_source({"type": "jsonl", "path": jsonl_path})
    batch = source.read_batch({"type": "offset", "offset": 10}, max_items=5, max_bytes=None)
    assert batch.items == JSONL_ITEMS[10:15]
    again = source.read_batch(batch.end_cursor, max_items=100, max_bytes=None)
    assert again.items == JSONL_ITEMS[15:] and again.end_cursor is None


def test_malformed_jsonl_line_fails_only_when_reached(tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('1\n2\n\n{"broken": \n5\n')
    source = open_source({"type": "jsonl", "path": str(path)})
    first = source.read_batch(source.initial_cursor(), max_items=2, max_bytes=None)
    assert first.items == [1, 2] and first.end_cursor is not None
    with pytest.raises(SourceReadError, match=r"line 4\b") as info:
        source.read_batch(roundtrip(first.end_cursor), max_items=2, max_bytes=None)
    assert info.value.retryable is False and str(path) in str(info.value)


def test_missing_file_is_not_retryable_and_not_touched_before_reading(tmp_path):
    spec = {"type": "jsonl", "path": str(tmp_path / "nope.jsonl")}
    assert validate_spec(spec) == spec
    source = open_source(spec)
    assert source.total_hint is None
    with pytest.raises(SourceReadError, match="nope.jsonl") as info:
        source.read_batch(source.initial_cursor(), max_items=5, max_bytes=None)
    assert info.value.retryable is False


@pytest.mark.parametrize(("max_items", "max_bytes"), LIMITS)
def test_local_csv_with_header_and_quoted_newlines(check_source, csv_path, max_items, max_bytes):
    check_source(lambda: open_source({"type": "csv", "path": csv_path}), CSV_DICTS, max_items, max_bytes)


def test_csv_cursor_bytes_point_at_the_next_record(csv_path):
    data = open(csv_path, "rb").read()
    batches = read_all(open_source({"type": "csv", "path": csv_path}), max_items=2)
    done = 0
    for batch in batches[:-1]:
        done += len(batch.items)
        text = data[batch.end_cursor["byte"] :].decode()
        rest = [row for row in csv.reader(io.StringIO(text, newline="")) if row]
        assert rest[0] == CSV_ROWS[1 + done]


def test_csv_without_header_and_other_delimiter(check_source, tmp_path):
    path = tmp_path / "rows.csv"
    path.write_bytes(make_csv(CSV_ROWS, delimiter=";"))
    spec = {"type": "csv", "path": str(path), "delimiter": ";", "header": False}
    check_source(lambda: open_source(spec), CSV_ROWS, 4)


def test_csv_row_with_wrong_field_count_names_the_line(tmp_path):
    path = tmp_path / "bad.csv"
    path.write_text('a,b\n1,2\n"x\ny",2,3\n')
    source = open_source({"type": "csv", "path": str(path)})
    with pytest.raises(SourceReadError, match=r"line 3\b.*3 fields") as info:
        source.read_batch(source.initial_cursor(), max_items=5, max_bytes=None)
    assert not info.value.retryable


def test_csv_duplicate_header_is_rejected(tmp_path):
    path = tmp_path / "dup.csv"
    path.write_text("a,a\n1,2\n")
    source = open_source({"type": "csv", "path": str(path)})
    with pytest.raises(SourceReadError, match="duplicate"):
        source.read_batch(source.initial_cursor(), max_items=5, max_bytes=None)


FILES = {
    "jsonl": ({"type": "jsonl"}, make_jsonl(JSONL_ITEMS), JSONL_ITEMS),
    "csv": ({"type": "csv"}, make_csv(CSV_ROWS), CSV_DICTS),
}


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
@pytest.mark.parametrize("kind", FILES)
def test_url_source_reads_and_resumes(check_source, file_server, kind, honour_range):
    base, body, expected = FILES[kind]
    server = file_server(body, honour_range)
    spec = {**base, "url": server.url + "/data?sig=secret"}
    check_source(lambda: open_source(spec), expected, 4, 400)
    assert all(entry["headers"].get("Accept-Encoding") == "identity" for entry in server.log)


@pytest.mark.parametrize("kind", FILES)
def test_resumed_url_read_uses_range_and_skips_the_start(file_server, kind):
    base, body, expected = FILES[kind]
    server = file_server(body, True)
    spec = {**base, "url": server.url + "/data"}
    first = open_source(spec).read_batch(open_source(spec).initial_cursor(), max_items=20, max_bytes=None)
    byte = first.end_cursor["byte"]
    server.log.clear()
    rest = read_all(open_source(spec), max_items=1000, cursor=roundtrip(first.end_cursor))
    assert [i for b in rest for i in b.items] == expected[20:]
    data_requests = [e for e in server.finished_log() if "Range" in e["headers"]]
    assert len(data_requests) == 1
    assert data_requests[0]["headers"]["Range"] == f"bytes={byte}-" and data_requests[0]["status"] == 206
    assert data_requests[0]["sent"] == len(body) - byte < len(body)
    if kind == "jsonl":
        assert len(server.log) == 1  # csv also fetches its header row from the start


@pytest.mark.parametrize("honour_range", [True, False], ids=["range", "no-range"])
def test_url_cursor_at_end_of_file_gives_empty_final_batch(file_server, honour_range):
    body = b"1\n2\n"
    server = file_server(body, honour_range)
    source = open_source({"type": "jsonl", "url": server.url + "/f"})
    batch = source.read_batch({"type": "offset", "offset": 2, "byte": len(body)}, max_items=5, max_bytes=None)
    assert (batch.items, batch.end_cursor) == ([], None)


def test_url_errors_are_classified_and_hide_the_query(file_server):
    server = file_server(b"1\n", True)
    source = open_source({"type": "csv", "url": server.url + "/missing?token=hunter2"})
    with pytest.raises(SourceReadError) as info:
        source.read_batch(source.initial_cursor(), max_items=5, max_bytes=None)
    assert not info.value.retryable
    assert "404" in str(info.value) and "/missing" in str(info.value) and "hunter2" not in str(info.value)


@pytest.mark.parametrize("chunk_bytes", [1, 7, 64 * 1024])
@pytest.mark.parametrize("kind", FILES)
def test_records_split_across_read_chunks(check_source, monkeypatch, tmp_path, file_server, kind, chunk_bytes):
    monkeypatch.setattr("chunker.files._CHUNK_BYTES", chunk_bytes)
    base, body, expected = FILES[kind]
    path = tmp_path / "data"
    path.write_bytes(body)
    check_source(lambda: open_source({**base, "path": str(path)}), expected, 5)
    server = file_server(body, True)
    check_source(lambda: open_source({**base, "url": server.url + "/data"}), expected, 9, 300)


def test_large_file_crossing_many_chunks(check_source, tmp_path):
    items = [{"n": i, "pad": "é" * (i % 97)} for i in range(3000)]
    path = tmp_path / "big.jsonl"
    path.write_text("".join(json.dumps(item, ensure_ascii=False) + "\n" for item in items), encoding="utf-8")
    assert path.stat().st_size > 3 * 64 * 1024
    check_source(lambda: open_source({"type": "jsonl", "path": str(path)}), items, 700)


def test_url_stream_is_not_read_into_memory(file_server):
    line = json.dumps({"pad": "x" * 200}).encode() + b"\n"
    body = line * 100_000  # about 20 MB
    server = file_server(body, False)
    source = open_source({"type": "jsonl", "url": server.url + "/big"})
    tracemalloc.start()
    try:
        batch = source.read_batch(source.initial_cursor(), max_items=10, max_bytes=None)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert len(batch.items) == 10 and batch.end_cursor["byte"] == 10 * len(line)
    assert peak < 2_000_000, f"peak {peak} bytes: the body was buffered"


def test_connection_dropped_mid_stream_is_retryable(serve):
    def truncating(path, query, headers):
        """Promises 10000 bytes, sends 6 and closes."""
        return 200, {"Content-Length": "10000"}, b"1\n2\n3\n"

    source = open_source({"type": "jsonl", "url": serve(truncating).url + "/cut?sig=secret"})
    with pytest.raises(SourceReadError) as info:
        source.read_batch(source.initial_cursor(), max_items=100, max_bytes=None)
    assert info.value.retryable and "secret" not in str(info.value)
