"""Exceptions raised by the chunker package."""

from __future__ import annotations


class ChunkerError(Exception):
    """Base class for every error raised by chunker."""


class SourceSpecError(ChunkerError, ValueError):
    """A source spec, cursor or read argument is invalid; the message names the field."""


class SourceReadError(ChunkerError):
    """Reading from a source failed.

    Attributes:
        retryable: True for transient failures (network errors, timeouts, HTTP 429/5xx)
            where retrying the same read may succeed; False for 4xx and bad data.
        retry_after_s: Server-requested delay from a Retry-After header, if any.
    """

    def __init__(self, message: str, *, retryable: bool, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retryable = retryable
        self.retry_after_s = retry_after_s
