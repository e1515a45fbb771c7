"""Typed field access for spec and cursor dicts, with errors that name the field."""

from __future__ import annotations

import reprlib
from typing import Any, NoReturn
from urllib.parse import urlsplit

from chunker.errors import SourceSpecError

REQUIRED: Any = object()

_REPR = reprlib.Repr()
_REPR.maxstring = 40
_REPR.maxother = 40


def describe(value: Any) -> str:
    """Returns a short description of a value for error messages (cheap even for huge lists)."""
    return f"{_REPR.repr(value)} ({type(value).__name__})"


def is_int(value: Any) -> bool:
    """Returns True for real integers (bool excluded)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_http_url(url: Any, label: str) -> str:
    """Checks that url is an absolute http(s) URL; never echoes the URL (it may hold secrets)."""
    if not isinstance(url, str) or not url:
        raise SourceSpecError(f"{label} must be a non-empty string, got {type(url).__name__}")
    try:
        parts = urlsplit(url)
        host, _ = parts.hostname, parts.port  # .port raises ValueError for a bad port
    except ValueError:
        raise SourceSpecError(f"{label} is not a valid URL") from None
    if parts.scheme not in ("http", "https"):
        raise SourceSpecError(f"{label} must be an http or https URL, got scheme {parts.scheme!r}")
    if not host:
        raise SourceSpecError(f"{label} must be an absolute URL with a host")
    return url


class Fields:
    """Reads typed fields from a dict, raising SourceSpecError that names the bad field.

    Args:
        data: The dict to read.
        what: What the dict is, e.g. "source spec" or "cursor".
        prefix: Dotted prefix for nested dicts, e.g. "pagination.".
    """

    def __init__(self, data: Any, what: str, prefix: str = "") -> None:
        if not isinstance(data, dict):
            where = f"{what} field {prefix.rstrip('.')!r}" if prefix else what
            raise SourceSpecError(f"{where} must be a dict, got {describe(data)}")
        self.data = data
        self.what = what
        self.prefix = prefix

    def label(self, key: str) -> str:
        """Returns the human-readable name of a field."""
        return f"{self.what} field {self.prefix + key!r}"

    def fail(self, key: str, problem: str) -> NoReturn:
        """Raises SourceSpecError for a field."""
        raise SourceSpecError(f"{self.label(key)} {problem}")

    def only(self, allowed: set[str]) -> None:
        """Rejects keys outside allowed (catches typos such as 'item_field')."""
        unknown = sorted(str(k) for k in self.data if k not in allowed)
        if unknown:
            raise SourceSpecError(
                f"{self.what} has unknown field(s) {', '.join(repr(self.prefix + k) for k in unknown)};"
                f" allowed: {', '.join(sorted(allowed))}"
            )

    def missing(self, key: str, default: Any) -> bool:
        """Returns True if key is absent and has a default; raises if it is required."""
        if key in self.data:
            return False
        if default is REQUIRED:
            self.fail(key, "is required")
        return True

    def get_int(self, key: str, default: Any = REQUIRED, minimum: int | None = None) -> Any:
        """Returns an int field (or the default when absent)."""
        if self.missing(key, default):
            return default
        value = self.data[key]
        if not is_int(value):
            self.fail(key, f"must be an integer, got {describe(value)}")
        if minimum is not None and value < minimum:
            self.fail(key, f"must be >= {minimum}, got {value}")
        return value

    def get_str(self, key: str, default: Any = REQUIRED, allow_empty: bool = False) -> Any:
        """Returns a str field (or the default when absent)."""
        if self.missing(key, default):
            return default
        value = self.data[key]
        if not isinstance(value, str):
            self.fail(key, f"must be a string, got {describe(value)}")
        if not value and not allow_empty:
            self.fail(key, "must not be empty")
        return value

    def get_bool(self, key: str, default: bool) -> bool:
        """Returns a bool field (or the default when absent)."""
        value = self.data.get(key, default)
        if not isinstance(value, bool):
            self.fail(key, f"must be true or false, got {describe(value)}")
        return value

    def get_url(self, key: str) -> str:
        """Returns a required http(s) URL field."""
        self.missing(key, REQUIRED)
        return check_http_url(self.data[key], self.label(key))

    def sub(self, key: str, default: Any = REQUIRED) -> Fields:
        """Returns a Fields view over a nested dict field."""
        value = default if self.missing(key, default) else self.data[key]
        return Fields(value, self.what, f"{self.prefix}{key}.")
