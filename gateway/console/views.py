"""The console's blueprint with every page registered on it (what the app factory imports), and the
template filters its pages share."""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Any

from gateway.console import approvals as _approvals  # noqa: F401  (the approvals inbox, its nav item)
from gateway.console import jobs as _jobs  # noqa: F401  (registers the job pages on bp)
from gateway.console.auth import NAV, bp

__all__ = ["NAV", "bp"]
JSON_SHOWN = 300  # characters of a cursor or an output shown inline


@bp.app_template_filter("console_when")
def when(ms: int | None) -> str:
    """Epoch milliseconds as a UTC time, to the second."""
    if not ms:
        return ""
    return datetime.fromtimestamp(ms / 1000, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@bp.app_template_filter("console_iso")
def iso(value: str | None, utc: bool = True) -> str:
    """An API timestamp (``2026-12-03T08:30:00.123Z``) as the console shows times, to the second
    (``utc`` False: without the zone, for a column whose header names it)."""
    if not value:
        return ""
    return value[:19].replace("T", " ") + (" UTC" if utc else "")


@bp.app_template_filter("console_json")
def as_json(value: Any, limit: int | None = JSON_SHOWN) -> str:
    """A value as compact JSON, cut to ``limit`` characters (None: whole, e.g. a form's value)."""
    text = json.dumps(value, ensure_ascii=False, separators=(",", ":"), default=str)
    return text if limit is None or len(text) <= limit else text[:limit - 1] + "\u2026"


@bp.app_template_filter("console_pretty")
def pretty(value: Any, limit: int = 4000) -> str:
    """A value as indented JSON (a stage's output), cut to ``limit`` characters."""
    text = json.dumps(value, ensure_ascii=False, indent=2, default=str)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


@bp.app_template_filter("console_duration")
def duration(seconds: float | None) -> str:
    """Seconds as "42 s", "7 min" or "3 h 05 min"."""
    if seconds is None:
        return ""
    s = int(seconds)
    if s < 120:
        return f"{s} s"
    if s < 7200:
        return f"{s // 60} min"
    return f"{s // 3600} h {s % 3600 // 60:02d} min"


@bp.app_template_filter("console_pct")
def percent(fraction: float | None) -> str:
    return "" if fraction is None else f"{fraction * 100:.0f}%"
