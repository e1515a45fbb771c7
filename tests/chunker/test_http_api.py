"""Tests for the paged http_json source against a real local HTTP server."""

from __future__ import annotations

import json
import socket
import time
from datetime import UTC, datetime, timedelta
from email.utils import format_datetime
from typing import Any

import pytest
import requests
import responses

from chunker import SourceReadError, open_source
from tests.chunker.helpers import read_all

RECORDS = [{"id": i, "name": f"rec-{i}-é"} for i in range(1, 238)]  # 237 records
API_KEY = "k-123-secret"


def page(records: list, start: int, size: int) -> list:
    """Returns one page of records."""
    return records[start : start + size]


def api(path: str, q: dict[str, list[str]], headers: Any) -> tuple[int, dict[str, str], bytes]:
    """A fake API serving RECORDS with every pagination style; requires the X-Api-Key header."""
    arg = {k: v[-1] for k, v in q.items()}
    if headers.get("X-Api-Key") != API_KEY:
        return 401, {}, b'{"error": "unauthorised"}'
    extra: dict[str, str] = {}
    if path == "/offset":
        body: Any = {"data": page(RECORDS, int(arg["offset"]), int(arg["limit"]))}
    elif path == "/page":
        size = int(arg["per_page"])
        body = {"data": page(RECORDS, (int(arg["page"]) - 1) * size, size)}
    elif path == "/page0":  # zero-based pages, custom parameter names
        body = {"data": page(RECORDS, int(arg["p"]) * int(arg["n"]), int(arg["n"]))}
    elif path == "/token":
        start = int(arg.get("page_token", "t0")[1:])
        end = start + 40
        next_token = f"t{end}" if end < 237 else None
        body = {"result": {"items": page(RECORDS, start, 40)}, "meta": {"next": next_token}}
    elif path == "/link":
        start, size = int(arg.get("start", 0)), int(arg["per_page"])
        body = page(RECORDS, start, size)
        if start + size < 237:
            extra["Link"] = f'</link?start={start + size}&per_page={size}>; rel="next", </link>; rel="first"'
    elif path == "/key":
        after = int(arg.get("starting_after", 0))
        limit = int(arg.get("limit", 45))
        body = {"data": [r for r in RECORDS if r["id"] > after][:limit]}
    elif path == "/single":
        body = {"data": RECORDS[:30]}
    else:
        return 404, {}, b"{}"
    return 200, {"Content-Type": "application/json", **extra}, json.dumps(body).encode()


STYLES = {
    "offset": ("/offset", {"pagination": {"style": "offset", "page_size": 50}}),
    "page": ("/page", {"pagination": {"style": "page", "page_size": 30}}),
    "page0": ("/page0", {"pagination": {"style": "page", "page_param": "p", "size_param": "n",
                                        "page_size": 25, "first_page": 0}}),
    "token": ("/token", {"items_field": "result.items",
                         "pagination": {"style": "token", "next_token_field": "meta.next"}}),
    "link": ("/link", {"items_field": "", "params": {"per_page": 60}, "pagination": {"style": "link"}}),
    "key": ("/key", {"pagination": {"style": "key", "limit_param": "limit", "page_size": 45}}),
    "key-no-limit": ("/key", {"pagination": {"style": "key"}}),
}


@pytest.fixture
def api_server(serve):
    """A server running the fake paginated API."""
    return serve(api)


def spec_for(server, style: str) -> dict:
    """Returns the http_json spec for a pagination style of the fake API."""
    path, extra = STYLES[style]
    return {"type": "http_json", "url": server.url + path, "headers": {"X-Api-Key": API_KEY}, **extra}


@pytest.mark.parametrize(("max_items", "max_bytes"),
                         [(7, None), (45, None), (60, None), (100, None), (500, None), (20, 400)])
@pytest.mark.parametrize("style", STYLES)
def test_every_pagination_style_reads_all_records_once(check_source, api_server, style, max_items, max_bytes):
    spec = spec_for(api_server, style)
    check_source(lambda: open_source(spec), RECORDS, max_items, max_bytes)


def test_unpaginated_api_reads_one_response(check_source, api_server):
    spec = {"type": "http_json", "url": api_server.url + "/single", "headers": {"X-Api-Key": API_KEY}}
    check_source(lambda: open_source(spec), RECORDS[:30], 7)


def test_batch_ending_on_a_page_boundary_does_not_fetch_the_next_page(api_server):
    source = open_source(spec_for(api_server, "offset"))
    batches = read_all(source, max_items=50)
    assert [len(b.items) for b in batches] == [50, 50, 50, 50, 37]
    assert len(api_server.log) == 5


def test_large_batch_spans_pages_and_short_page_ends_the_source(api_server):
    source = open_source(spec_for(api_server, "page"))
    batch = source.read_batch(source.initial_cursor(), max_items=1000, max_bytes=None)
    assert batch.items == RECORDS and batch.end_cursor is None
    assert [e["query"]["page"] for e in api_server.log] == [[str(n)] for n in range(1, 9)]


def test_spec_params_go_on_the_first_link_request_only(api_server):
    source = open_source(spec_for(api_server, "link"))
    read_all(source, max_items=100)
    queries = [e["query"] for e in api_server.log]
    assert queries[:2] == [{"per_page": ["60"]}, {"start": ["60"], "per_page": ["60"]}]


def error_app(path: str, q: dict, headers: Any) -> tuple[int, dict[str, str], bytes]:
    """Serves failure modes: throttling, outages, slowness, bad bodies, bad pagination."""
    if path == "/busy":
        return 429, {"Retry-After": "7"}, b""
    if path == "/down":
        return 503, {}, b""
    if path == "/slow":
        time.sleep(0.5)
        return 200, {}, b'{"data": []}'
    if path == "/html":
        return 200, {"Content-Type": "text/html"}, b"<html>oops</html>"
    if path == "/shape":
        return 200, {}, b'{"items": []}'
    if path == "/stuck":
        return 200, {}, b'{"data": [1], "next_page_token": "same"}'
    if path == "/away":
        return 200, {"Link": '<http://example.com/steal>; rel="next"'}, b'{"data": [1]}'
    return 404, {}, b""


@pytest.mark.parametrize(("path", "retryable", "retry_after", "text"), [
    ("/busy", True, 7.0, "HTTP 429"),
    ("/down", True, None, "HTTP 503"),
    ("/nothing", False, None, "HTTP 404"),
    ("/slow", True, None, "Timeout"),
    ("/html", False, None, "not valid JSON"),
    ("/shape", False, None, "'data' missing"),
])
def test_http_errors_are_classified(serve, path, retryable, retry_after, text):
    server = serve(error_app)
    spec = {"type": "http_json", "url": f"{server.url}{path}?api_key=qs-secret",
            "headers": {"Authorization": "Bearer hdr-secret"}}
    source = open_source(spec, timeout_s=0.2)
    with pytest.raises(SourceReadError) as info:
        source.read_batch(source.initial_cursor(), max_items=10, max_bytes=None)
    err = info.value
    assert (err.retryable, err.retry_after_s) == (retryable, retry_after)
    assert text in str(err) and f"{server.url}{path}" in str(err)
    assert "secret" not in str(err)


def test_pagination_that_does_not_advance_is_an_error(serve):
    server = serve(error_app)
    spec = {"type": "http_json", "url": server.url + "/stuck", "pagination": {"style": "token"}}
    source = open_source(spec)
    with pytest.raises(SourceReadError, match="did not advance"):
        source.read_batch(source.initial_cursor(), max_items=10, max_bytes=None)


def test_next_link_to_another_origin_is_not_followed(serve):
    server = serve(error_app)
    source = open_source({"type": "http_json", "url": server.url + "/away", "pagination": {"style": "link"},
                          "headers": {"Authorization": "Bearer x"}})
    with pytest.raises(SourceReadError, match="another origin") as info:
        source.read_batch(source.initial_cursor(), max_items=10, max_bytes=None)
    assert not info.value.retryable


def test_connection_refused_is_retryable():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    spec = {"type": "http_json", "url": f"http://127.0.0.1:{port}/x?key=qs-secret"}
    source = open_source(spec, timeout_s=2)
    with pytest.raises(SourceReadError, match="ConnectionError") as info:
        source.read_batch(source.initial_cursor(), max_items=1, max_bytes=None)
    assert info.value.retryable and "secret" not in str(info.value)


@responses.activate
def test_retry_after_http_date_and_401_classification():
    when = datetime.now(UTC) + timedelta(seconds=120)
    retry_after = format_datetime(when, usegmt=True)
    responses.get("https://api.test/busy", status=503, headers={"Retry-After": retry_after})
    responses.get("https://api.test/auth", status=401)
    session = requests.Session()
    busy = open_source({"type": "http_json", "url": "https://api.test/busy"}, session=session)
    with pytest.raises(SourceReadError) as info:
        busy.read_batch(busy.initial_cursor(), max_items=1, max_bytes=None)
    assert info.value.retryable and 100 < info.value.retry_after_s <= 120
    auth = open_source({"type": "http_json", "url": "https://api.test/auth"}, session=session)
    with pytest.raises(SourceReadError) as info:
        auth.read_batch(auth.initial_cursor(), max_items=1, max_bytes=None)
    assert not info.value.retryable and info.value.retry_after_s is None
