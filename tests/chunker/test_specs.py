"""Tests for spec and cursor validation: precise SourceSpecError messages, no I/O."""

from __future__ import annotations

import builtins

import pytest
import requests

from chunker import ChunkerError, SourceSpecError, open_source, validate_cursor, validate_spec

URL = "https://api.test/v1/items"

BAD_SPECS = [
    ([1, 2], "source spec must be a dict"),
    ({}, "field 'type' is required"),
    ({"type": "ftp"}, "field 'type' must be one of inline, sequence, jsonl, csv, http_json, got 'ftp'"),
    ({"type": "inline"}, "field 'items' is required"),
    ({"type": "inline", "items": "abc"}, "field 'items' must be a list"),
    ({"type": "inline", "items": [], "itms": []}, "unknown field(s) 'itms'"),
    ({"type": "sequence"}, "field 'count' is required"),
    ({"type": "sequence", "count": -1}, "field 'count' must be >= 0, got -1"),
    ({"type": "sequence", "count": True}, "field 'count' must be an integer, got True (bool)"),
    ({"type": "sequence", "count": 3, "start": "0"}, "field 'start' must be an integer"),
    ({"type": "jsonl"}, "field 'path' or 'url' must be given (exactly one of them)"),
    ({"type": "jsonl", "path": "a", "url": URL}, "exactly one of them"),
    ({"type": "jsonl", "path": ""}, "field 'path' must not be empty"),
    ({"type": "jsonl", "url": "file:///etc/passwd"},
     "field 'url' must be an http or https URL, got scheme 'file'"),
    ({"type": "jsonl", "url": "http:///nohost"}, "field 'url' must be an absolute URL with a host"),
    ({"type": "jsonl", "path": "a", "header": True}, "unknown field(s) 'header'"),
    ({"type": "csv", "path": "a", "delimiter": ";;"}, "field 'delimiter' must be one character, not a quote or newline"),
    ({"type": "csv", "path": "a", "header": "yes"}, "field 'header' must be true or false"),
    ({"type": "http_json"}, "field 'url' is required"),
    ({"type": "http_json", "url": "ftp://x/y"}, "field 'url' must be an http or https URL"),
    ({"type": "http_json", "url": URL, "items_field": 3}, "field 'items_field' must be a string"),
    ({"type": "http_json", "url": URL, "headers": []}, "field 'headers' must be a dict"),
    ({"type": "http_json", "url": URL, "params": {"q": None}}, "field 'params.q' must be a string, number"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "cursor"}},
     "field 'pagination.style' must be one of none, offset, page, token, link, key, got 'cursor'"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "offset", "page_size": 0}},
     "field 'pagination.page_size' must be >= 1, got 0"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "page", "page_param": ""}},
     "field 'pagination.page_param' must not be empty"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "token", "page_size": 5}},
     "unknown field(s) 'pagination.page_size'"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "key", "page_size": 5}},
     "field 'pagination.page_size' and 'pagination.limit_param' must be given together"),
    ({"type": "http_json", "url": URL, "params": {"limit": 5}, "pagination": {"style": "offset"}},
     "field 'params' must not set 'limit': it is controlled by 'pagination.limit_param'"),
]


@pytest.mark.parametrize(("spec", "message"), BAD_SPECS)
def test_bad_specs_name_the_field(spec, message):
    with pytest.raises(SourceSpecError) as info:
        validate_spec(spec)
    assert message in str(info.value)
    with pytest.raises(SourceSpecError):
        open_source(spec)


def test_spec_errors_are_value_errors_and_chunker_errors():
    with pytest.raises(ValueError):
        validate_spec({"type": "nope"})
    assert issubclass(SourceSpecError, ChunkerError)


def test_header_and_url_secrets_are_not_echoed():
    with pytest.raises(SourceSpecError) as info:
        validate_spec({"type": "http_json", "url": URL, "headers": {"X-Key": 987654321}})
    assert "headers.X-Key" in str(info.value) and "987654321" not in str(info.value)
    with pytest.raises(SourceSpecError) as info:
        validate_spec({"type": "jsonl", "url": "ftp://user:pw@host/f?key=s3cret"})
    assert "s3cret" not in str(info.value) and "pw" not in str(info.value)


def test_validate_spec_fills_defaults_and_copies():
    spec = {"type": "csv", "url": URL}
    assert validate_spec(spec) == {"type": "csv", "url": URL, "delimiter": ",", "header": True}
    assert spec == {"type": "csv", "url": URL}
    assert validate_spec({"type": "sequence", "count": 5}) == {"type": "sequence", "count": 5, "start": 0}
    assert validate_spec({"type": "http_json", "url": URL, "pagination": {"style": "page"}}) == {
        "type": "http_json", "url": URL, "items_field": "data", "headers": {}, "params": {},
        "pagination": {"style": "page", "page_param": "page", "size_param": "per_page", "page_size": 100,
                       "first_page": 1},
    }
    assert validate_spec({"type": "http_json", "url": URL})["pagination"] == {"style": "none"}


SPECS = [
    {"type": "inline", "items": [1, 2]},
    {"type": "sequence", "count": 10**12},
    {"type": "jsonl", "path": "/nonexistent/file.jsonl"},
    {"type": "csv", "url": URL},
    {"type": "http_json", "url": URL, "pagination": {"style": "link"}},
]


def test_validate_and_open_do_no_io(monkeypatch):
    def forbidden(*args, **kwargs):
        raise AssertionError("I/O attempted")

    monkeypatch.setattr(builtins, "open", forbidden)
    monkeypatch.setattr(requests.Session, "request", forbidden)
    for spec in SPECS:
        source = open_source(validate_spec(spec))
        assert validate_cursor(source.initial_cursor()) == source.initial_cursor()


BAD_CURSORS = [
    ("offset", "cursor must be a dict"),
    ({"offset": 1}, "cursor field 'type' is required"),
    ({"type": "bookmark"},
     "cursor field 'type' must be one of offset, page, token, link, key, got 'bookmark'"),
    ({"type": "offset"}, "cursor field 'offset' is required"),
    ({"type": "offset", "offset": -3}, "cursor field 'offset' must be >= 0, got -3"),
    ({"type": "offset", "offset": 1.5}, "cursor field 'offset' must be an integer"),
    ({"type": "offset", "offset": 1, "byte": "9"}, "cursor field 'byte' must be an integer"),
    ({"type": "offset", "offset": 1, "page": 2}, "cursor has unknown field(s) 'page'"),
    ({"type": "page", "page": 1, "skip": -1}, "cursor field 'skip' must be >= 0"),
    ({"type": "token", "token": 5, "skip": 0}, "cursor field 'token' must be a string"),
    ({"type": "link", "url": "javascript:alert(1)", "skip": 0},
     "cursor field 'url' must be an http or https URL"),
    ({"type": "key", "after": [1], "skip": 0}, "cursor field 'after' must be a string, an integer or null"),
]


@pytest.mark.parametrize(("cursor", "message"), BAD_CURSORS)
def test_bad_cursors_are_rejected_by_validate_and_read(cursor, message):
    with pytest.raises(SourceSpecError) as info:
        validate_cursor(cursor)
    assert message in str(info.value)
    with pytest.raises(SourceSpecError):
        open_source({"type": "inline", "items": [1]}).read_batch(cursor, max_items=1, max_bytes=None)


def test_cursor_defaults_are_filled():
    assert validate_cursor({"type": "token"}) == {"type": "token", "token": None, "skip": 0}
    assert validate_cursor({"type": "key", "after": 7}) == {"type": "key", "after": 7, "skip": 0}


@pytest.mark.parametrize(("spec", "cursor", "message"), [
    ({"type": "inline", "items": [1]}, {"type": "page", "page": 1},
     "cursor of type 'page' cannot be used with source type 'inline', which uses 'offset' cursors"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "token"}}, {"type": "offset", "offset": 0},
     "which uses 'token' cursors"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "page"}}, {"type": "page", "page": 0},
     "'page' must be >= first_page 1"),
    ({"type": "http_json", "url": URL, "pagination": {"style": "link"}},
     {"type": "link", "url": "https://evil.test/v1/items", "skip": 0}, "same scheme, host and port"),
])
def test_cursor_must_fit_the_source(spec, cursor, message):
    with pytest.raises(SourceSpecError) as info:
        open_source(spec).read_batch(cursor, max_items=1, max_bytes=None)
    assert message in str(info.value)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"max_items": 0, "max_bytes": None}, "max_items must be an integer >= 1"),
    ({"max_items": "5", "max_bytes": None}, "max_items must be an integer >= 1"),
    ({"max_items": 5, "max_bytes": 0}, "max_bytes must be null or an integer >= 1"),
])
def test_bad_limits(kwargs, message):
    source = open_source({"type": "sequence", "count": 3})
    with pytest.raises(SourceSpecError, match=message):
        source.read_batch(source.initial_cursor(), **kwargs)


@pytest.mark.parametrize("timeout_s", [0, -1, float("nan"), "30", True])
def test_bad_timeout(timeout_s):
    with pytest.raises(SourceSpecError, match="timeout_s"):
        open_source({"type": "sequence", "count": 3}, timeout_s=timeout_s)


def test_validate_cursor_with_spec_checks_the_cursor_fits_the_source():
    inline = {"type": "inline"}  # items may be omitted: the gateway keeps them elsewhere
    assert validate_cursor({"type": "offset", "offset": 3}, inline) == {"type": "offset", "offset": 3}
    with pytest.raises(SourceSpecError, match="which uses 'offset' cursors"):
        validate_cursor({"type": "page", "page": 0, "skip": 0}, inline)
    link = {"type": "http_json", "url": URL, "pagination": {"style": "link"}}
    assert validate_cursor({"type": "link", "url": URL + "?after=5"}, link)["skip"] == 0
    with pytest.raises(SourceSpecError, match="same scheme, host and port"):
        validate_cursor({"type": "link", "url": "http://api.test/v1/items"}, link)
    with pytest.raises(SourceSpecError, match="exactly one of them"):
        validate_cursor({"type": "offset", "offset": 0}, {"type": "jsonl"})
