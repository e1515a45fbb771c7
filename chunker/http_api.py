"""Paged JSON HTTP API source (offset, page, token, link and key pagination)."""

from __future__ import annotations

import json
from collections.abc import Generator
from typing import Any
from urllib.parse import urljoin

import requests

from chunker.batching import PAGE_BREAK, Entry
from chunker.cursors import offset_cursor
from chunker.errors import SourceReadError, SourceSpecError
from chunker.httputil import display_url, http_get, origin, request_error
from chunker.source import Source
from chunker.validation import Fields, is_int

#: Largest page body a reader holds (decoded bytes); a longer one fails the read, not retryable.
MAX_PAGE_BYTES = 32 * 1024 * 1024
_CHUNK_BYTES = 64 * 1024

# Per style: allowed pagination fields and their defaults.
_STYLES: dict[str, dict[str, Any]] = {
    "none": {},
    "offset": {"offset_param": "offset", "limit_param": "limit", "page_size": 100},
    "page": {"page_param": "page", "size_param": "per_page", "page_size": 100, "first_page": 1},
    "token": {"token_param": "page_token", "next_token_field": "next_page_token"},
    "link": {},
    "key": {"after_param": "starting_after", "key_field": "id", "limit_param": None, "page_size": None},
}
_CURSOR_TYPES = {"none": "offset", "offset": "offset", "page": "page", "token": "token", "link": "link",
                 "key": "key"}


def _validate_pagination(f: Fields) -> dict:
    """Checks the pagination dict and fills the defaults of its style."""
    style = f.get_str("style", "none")
    if style not in _STYLES:
        f.fail("style", f"must be one of {', '.join(_STYLES)}, got {style!r}")
    f.only({"style", *_STYLES[style]})
    out: dict[str, Any] = {"style": style}
    for key, default in _STYLES[style].items():
        if key == "page_size":
            out[key] = f.get_int(key, default, minimum=1)
        elif key == "first_page":
            out[key] = f.get_int(key, default, minimum=0)
        else:
            out[key] = f.get_str(key, default)
    if style == "key" and (out["limit_param"] is None) != (out["page_size"] is None):
        f.fail("page_size", "and 'pagination.limit_param' must be given together")
    return out


def _validate_mapping(f: Fields, key: str, *, params: bool) -> dict:
    """Checks the headers or params dict; never echoes values (they may be credentials)."""
    sub = f.sub(key, {})
    allowed, wanted = ((str, int, float, bool), "a string, number, boolean or a list of those")
    if not params:
        allowed, wanted = (str,), "a string"
    for name, value in sub.data.items():
        if not isinstance(name, str) or not name:
            f.fail(key, "keys must be non-empty strings")
        values = value if params and isinstance(value, list) else [value]
        if not all(isinstance(v, allowed) for v in values):
            sub.fail(name, f"must be {wanted}, got {type(value).__name__}")
    return dict(sub.data)


def validate_http_json(f: Fields) -> dict:
    """Checks an http_json spec and fills defaults."""
    f.only({"type", "url", "items_field", "headers", "params", "pagination"})
    spec = {
        "type": "http_json",
        "url": f.get_url("url"),
        "items_field": f.get_str("items_field", "data", allow_empty=True),
        "headers": _validate_mapping(f, "headers", params=False),
        "params": _validate_mapping(f, "params", params=True),
        "pagination": _validate_pagination(f.sub("pagination", {"style": "none"})),
    }
    for key, name in spec["pagination"].items():
        if key.endswith("_param") and name in spec["params"]:
            f.fail("params", f"must not set {name!r}: it is controlled by 'pagination.{key}'")
    return spec


def _dig(data: Any, path: str) -> tuple[bool, Any]:
    """Follows a dotted path through dicts; returns (found, value). "" is the data itself."""
    for part in path.split(".") if path else ():
        if not isinstance(data, dict) or part not in data:
            return False, None
        data = data[part]
    return True, data


def _page_bytes(resp: requests.Response, url: str) -> bytes:
    """The body of a page, read as it streams in; SourceReadError past MAX_PAGE_BYTES (never held whole)."""
    buf = bytearray()
    try:
        for chunk in resp.iter_content(_CHUNK_BYTES):
            buf += chunk
            if len(buf) > MAX_PAGE_BYTES:
                message = (f"GET {display_url(url)}: page is larger than {MAX_PAGE_BYTES} bytes; "
                           "ask for smaller pages (pagination page_size)")
                raise SourceReadError(message, retryable=False)
    except requests.RequestException as exc:
        raise request_error(exc, url) from None
    finally:
        resp.close()
    return bytes(buf)


class HttpJsonSource(Source):
    """Items from a JSON HTTP API, following its pagination; a batch may span pages."""

    source_type = "http_json"

    def __init__(self, spec: dict, session: requests.Session | None, timeout_s: float) -> None:
        self._spec = spec
        self._pg: dict[str, Any] = spec["pagination"]
        self._style: str = self._pg["style"]
        self.cursor_type = _CURSOR_TYPES[self._style]
        self._session = session
        self._timeout_s = timeout_s

    def initial_cursor(self) -> dict:
        """Returns the cursor of the first page."""
        if self.cursor_type == "page":
            return {"type": "page", "page": self._pg["first_page"], "skip": 0}
        if self.cursor_type == "token":
            return {"type": "token", "token": None, "skip": 0}
        if self.cursor_type == "link":
            return {"type": "link", "url": self._spec["url"], "skip": 0}
        if self.cursor_type == "key":
            return {"type": "key", "after": None, "skip": 0}
        return offset_cursor(0)

    def check_cursor(self, cursor: dict) -> dict:
        """Rejects pages before first_page and links to another origin (headers may be secret)."""
        if self.cursor_type == "offset":
            return offset_cursor(cursor["offset"])
        if self._style == "page" and cursor["page"] < self._pg["first_page"]:
            raise SourceSpecError(f"cursor field 'page' must be >= first_page {self._pg['first_page']}")
        if self._style == "link" and origin(cursor["url"]) != origin(self._spec["url"]):
            raise SourceSpecError("cursor field 'url' must have the same scheme, host and port as the"
                                  " spec url")
        return cursor

    def _entries(self, cursor: dict, max_items: int) -> Generator[Entry, None, None]:
        current: dict | None = cursor
        while current is not None:
            items, nxt = self._fetch(current)
            last = len(items) - 1
            for i in range(self._skip(current), len(items)):
                yield items[i], nxt if (i == last and nxt is not None) else self._after(current, items, i)
            if nxt is not None:
                yield PAGE_BREAK, None
            current = nxt

    def _skip(self, cursor: dict) -> int:
        """Returns how many items of the page at cursor are already consumed."""
        if self._style == "none":
            return cursor["offset"]
        return cursor.get("skip", 0)

    def _after(self, cursor: dict, items: list, i: int) -> dict:
        """Returns the cursor just after items[i] of the page read from cursor."""
        if self._style == "none":
            return offset_cursor(i + 1)
        if self._style == "offset":
            return offset_cursor(cursor["offset"] + i + 1)
        if self._style == "key":
            return {"type": "key", "after": self._key(items[i]), "skip": 0}
        return {**cursor, "skip": i + 1}

    def _request(self, cursor: dict) -> tuple[str, dict]:
        """Returns the URL and query parameters for the page at cursor."""
        pg, params = self._pg, dict(self._spec["params"])
        if self._style == "link":
            # The spec params go on the first request; next links carry their own query string.
            return cursor["url"], params if cursor["url"] == self._spec["url"] else {}
        if self._style == "offset":
            params.update({pg["offset_param"]: cursor["offset"], pg["limit_param"]: pg["page_size"]})
        elif self._style == "page":
            params.update({pg["page_param"]: cursor["page"], pg["size_param"]: pg["page_size"]})
        elif self._style == "token" and cursor["token"] is not None:
            params[pg["token_param"]] = cursor["token"]
        elif self._style == "key":
            if cursor["after"] is not None:
                params[pg["after_param"]] = cursor["after"]
            if pg["limit_param"]:
                params[pg["limit_param"]] = pg["page_size"]
        return self._spec["url"], params

    def _fetch(self, cursor: dict) -> tuple[list, dict | None]:
        """Fetches the page at cursor; returns its items and the next page's cursor (None at the end)."""
        url, params = self._request(cursor)
        if self._session is None:
            self._session = requests.Session()
        resp = http_get(self._session, url, timeout_s=self._timeout_s, params=params,
                        headers=self._spec["headers"], stream=True)
        try:
            body = json.loads(_page_bytes(resp, url))
        except ValueError:
            message = f"GET {display_url(url)}: response is not valid JSON"
            raise SourceReadError(message, retryable=False) from None
        found, items = _dig(body, self._spec["items_field"])
        if not found or not isinstance(items, list):
            field = self._spec["items_field"] or "(the body)"
            message = f"GET {display_url(url)}: items field {field!r} missing or not a list"
            raise SourceReadError(message, retryable=False)
        nxt = self._next(cursor, items, resp, body)
        if nxt is not None and {**nxt, "skip": 0} == {**cursor, "skip": 0}:
            raise SourceReadError(f"GET {display_url(url)}: pagination did not advance", retryable=False)
        return items, nxt

    def _next(self, cursor: dict, items: list, resp: requests.Response, body: Any) -> dict | None:
        """Returns the cursor of the page after this one, or None if this is the last page."""
        pg, style = self._pg, self._style
        full = len(items) >= pg["page_size"] if pg.get("page_size") else bool(items)
        if style == "offset":
            return offset_cursor(cursor["offset"] + len(items)) if full else None
        if style == "page":
            return {"type": "page", "page": cursor["page"] + 1, "skip": 0} if full else None
        if style == "key":
            return {"type": "key", "after": self._key(items[-1]), "skip": 0} if full else None
        if style == "token":
            token = _dig(body, pg["next_token_field"])[1]
            if token is None or token == "":
                return None
            if not (isinstance(token, str) or is_int(token)):
                message = (f"GET {display_url(resp.url)}: next token field {pg['next_token_field']!r}"
                           f" holds a {type(token).__name__}, not a string")
                raise SourceReadError(message, retryable=False)
            return {"type": "token", "token": str(token), "skip": 0}
        if style == "link" and "next" in resp.links:
            return {"type": "link", "url": self._follow(resp), "skip": 0}
        return None

    def _follow(self, resp: requests.Response) -> str:
        """Resolves the rel="next" link, refusing other origins (request headers may be secret)."""
        url = urljoin(resp.url, resp.links["next"].get("url", ""))
        if origin(url) != origin(self._spec["url"]):
            message = f"GET {display_url(resp.url)}: next link leads to another origin; not following it"
            raise SourceReadError(message, retryable=False)
        return url

    def _key(self, item: Any) -> str | int:
        """Returns the key-pagination key of an item."""
        found, key = _dig(item, self._pg["key_field"])
        if not found or not (isinstance(key, str) or is_int(key)):
            message = (f"item has no string or integer key field {self._pg['key_field']!r}"
                       f" in {display_url(self._spec['url'])}")
            raise SourceReadError(message, retryable=False)
        return key
