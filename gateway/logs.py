"""Logging for every batchgate process: text for a terminal (the default), or one JSON object per line.

``BATCHGATE_LOG_FORMAT=json`` gives lines a log shipper parses without patterns: ``ts`` (UTC, ISO 8601
with milliseconds), ``level``, ``logger``, ``msg``, ``exc`` when there is one, and the job's fields where
they apply -- ``job_id``, ``seq``, ``stage``, ``attempt``, ``tenant`` -- taken from, in order: the
``extra`` of the call, the context bound around the work (:func:`bind`: an API request on a job, a
worker's stage call, a supervisor's pass over one job), and ``key=value`` pairs in the message (how the
code's messages have always named them).

Secrets never leave a process through its log: every configured credential value (bearer tokens,
platform secrets, the signing key, Redis URLs with passwords) is replaced by ``[redacted]`` in the final
line, whatever path put it there (a message, an argument, a traceback), and signed tokens in URL paths
(callbacks, blobs, decision links) are cut to their first characters.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import sys
import time
from collections.abc import Iterable, Iterator
from typing import Any

FIELDS = ("job_id", "seq", "stage", "attempt", "tenant")
_CONTEXT: contextvars.ContextVar[dict[str, Any] | None] = contextvars.ContextVar("batchgate_log", default=None)
_PAIRS = re.compile(r"\b(job_id|seq|stage|attempt|tenant)=([^\s,;)]+)")
#: a signed token in a path: /v1/callbacks/<t>, /v1/blobs/<t>, /decide/<t> (only the first 6 chars kept)
SIGNED_PATH = re.compile(r"(/(?:v1/callbacks|v1/blobs|decide)/)([A-Za-z0-9_.~%-]{6})[A-Za-z0-9_.~%-]*")
REDACTED = "[redacted]"
MIN_SECRET = 6  # shorter values are not searched for (they would redact ordinary words)


@contextlib.contextmanager
def bind(**fields: Any) -> Iterator[None]:
    """Add ``fields`` (job_id, seq, stage, attempt, tenant) to every line logged inside the block, in this
    thread or task only."""
    token = _CONTEXT.set({**(_CONTEXT.get() or {}), **{k: v for k, v in fields.items() if v is not None}})
    try:
        yield
    finally:
        _CONTEXT.reset(token)


def redact_paths(text: str) -> str:
    return SIGNED_PATH.sub(lambda m: f"{m.group(1)}{m.group(2)}…", text)


class Redactor:
    """Replaces each known secret value in a string."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        values = sorted({s for s in secrets if s and len(s) >= MIN_SECRET}, key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, values))) if values else None

    def __call__(self, text: str) -> str:
        if self.pattern is not None:
            text = self.pattern.sub(REDACTED, text)
        return redact_paths(text)


def job_fields(record: logging.LogRecord, message: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in _PAIRS.findall(message):
        out.setdefault(key, int(value) if key in ("seq", "attempt") and value.isdigit() else value)
    out.update(_CONTEXT.get() or {})
    for key in FIELDS:
        if key in record.__dict__:
            out[key] = record.__dict__[key]
    return {k: out[k] for k in FIELDS if k in out}


class JsonFormatter(logging.Formatter):
    def __init__(self, redactor: Redactor) -> None:
        super().__init__()
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        message = record.getMessage()
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
                  + f".{int(record.msecs):03d}Z",
            "level": record.levelname, "logger": record.name, "msg": message,
            **job_fields(record, message)}
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        for key in ("method", "path", "status", "duration_ms", "remote", "bytes"):  # access log
            if key in record.__dict__:
                line[key] = record.__dict__[key]
        return self.redactor(json.dumps(line, default=str, ensure_ascii=False))


class TextFormatter(logging.Formatter):
    def __init__(self, redactor: Redactor) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s %(message)s")
        self.redactor = redactor

    def format(self, record: logging.LogRecord) -> str:
        return self.redactor(super().format(record))


class _Handler(logging.StreamHandler):
    """batchgate's own root handler (configure replaces it, never another's). It writes to whatever
    ``sys.stderr`` is at each line, as logging's last-resort handler does, never to a stream that was
    stderr once (a test's capture, closed since, would turn every later line into a logging error)."""

    def __init__(self) -> None:
        super().__init__()

    @property
    def stream(self):  # type: ignore[override]
        return sys.stderr

    @stream.setter
    def stream(self, value) -> None:
        pass


def formatter(fmt: str, secrets: Iterable[str] = ()) -> logging.Formatter:
    redactor = Redactor(secrets)
    return JsonFormatter(redactor) if fmt == "json" else TextFormatter(redactor)


def configure(level: str = "INFO", fmt: str = "text", secrets: Iterable[str] = ()) -> logging.Handler:
    """Root logging to stderr in ``fmt`` ("text" or "json") at ``level``, redacting ``secrets``."""
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Handler)]:
        root.removeHandler(old)
    handler = _Handler()
    handler.setFormatter(formatter(fmt, secrets))
    root.addHandler(handler)
    root.setLevel(level.upper())
    return handler


def secret_values(settings: Any) -> list[str]:
    """Every credential value a Settings holds (tokens, platform secrets, signing key, Redis URLs and
    their passwords), for the redactor."""
    out: list[str] = list(settings.tokens)
    for per_tenant in settings.secrets.values():
        out += [v.get_secret_value() for v in per_tenant.values()]
    for field in ("signing_key", "redis_url", "queue_redis_url", "metrics_token"):
        value = getattr(settings, field, None)
        if value is not None:
            raw = value.get_secret_value()
            out.append(raw)
            if (m := re.search(r"://[^:/@]*:([^@]+)@", raw)) is not None:
                out.append(m.group(1))
    return out
