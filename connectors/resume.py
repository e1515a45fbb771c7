"""Resume a platform run that waits for a person, and follow it to its end.

The gateway keeps the ``WaitingHuman.resume`` handle with the approval it opens; once a person decides,
:func:`resume` passes the decision to the connector the handle names (``handle["platform"]``), which
resumes the run through the platform's API and returns what its ``trigger`` would: ``Done``, ``Running``
(poll it with ``connector.poll``), or a raised ``PlatformError`` (``WaitingHuman`` again when the run goes
on to another wait). :func:`follow` polls a ``Running`` outcome until it ends, for callers that hold no
lease to schedule polls with. Resuming is idempotent as far as each platform allows: a run that already
resumed is read, not resumed again (docs/connectors-failure-modes.md, "Resuming a run that waits for a
person").
"""

from __future__ import annotations

import time
from typing import Any

import requests

from connectors import CONNECTORS
from connectors.base import Decision, Outcome, PlatformError, Retry, Running, StageCall


def connector_for(platform: Any) -> Any:
    """The connector that resumes runs of ``platform``.

    Raises:
        PlatformError: FATAL for a platform whose connector cannot resume runs.
    """
    connector = CONNECTORS.get(platform) if isinstance(platform, str) else None
    if connector is None or not hasattr(connector, "resume"):
        raise PlatformError(f"batchgate cannot resume runs of platform {platform!r}", Retry.FATAL)
    return connector


def resume(call: StageCall, handle: dict[str, Any], decision: Decision, session: requests.Session) -> Outcome:
    """Resume the run ``handle`` names with ``decision`` (module docstring)."""
    return connector_for(handle.get("platform")).resume(call, handle, decision, session)


def follow(connector: Any, call: StageCall, outcome: Outcome, session: requests.Session, *,
           timeout_s: float, interval_s: float = 1.0, max_interval_s: float = 10.0) -> Outcome:
    """Poll a ``Running`` outcome until it is something else or ``timeout_s`` passes (then ``Running``).

    Polls whose answer did not come (RETRYABLE) are tried again; anything else a poll raises is raised.
    """
    deadline = time.monotonic() + timeout_s
    wait = interval_s
    while isinstance(outcome, Running) and time.monotonic() < deadline:
        time.sleep(min(wait, max(0.0, deadline - time.monotonic())))
        wait = min(wait * 2, max_interval_s)
        try:
            outcome = connector.poll(call, outcome.handle, session)
        except PlatformError as err:
            if err.retry is not Retry.RETRYABLE:
                raise
    return outcome
