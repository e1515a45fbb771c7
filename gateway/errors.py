"""The error tree: one root, two branches that say what to do, leaves that name the cause."""

from __future__ import annotations

from datetime import timedelta
from typing import Any


#: Longest piece of a request (an id, a name) an error message repeats; longer ones are cut.
ECHO_MAX = 200


def shown(value: object, limit: int = ECHO_MAX) -> str:
    """``value`` as text for an error message, cut to ``limit`` characters with an ellipsis."""
    text = str(value)
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


class BatchgateError(Exception):
    """Root of every error batchgate raises on purpose."""

    status = 500
    title = "Internal error"
    type_slug = "internal"

    def __init__(self, detail: str = "", **extra: Any) -> None:
        super().__init__(detail or self.title)
        self.detail = detail or self.title
        self.extra = extra

    def problem(self) -> dict[str, Any]:
        """The RFC 9457 problem document for this error."""
        body = {
            "type": f"https://batchgate.dev/problems/{self.type_slug}",
            "title": self.title,
            "status": self.status,
            "detail": self.detail,
        }
        body.update(self.extra)
        return body


class RetryableError(BatchgateError):
    """Try again later; ``retry_after`` says when, if known."""

    status = 503
    title = "Temporarily unavailable"
    type_slug = "retryable"

    def __init__(self, detail: str = "", retry_after: timedelta | None = None, **extra: Any):
        super().__init__(detail, **extra)
        self.retry_after = retry_after


class NotReady(RetryableError):
    """/readyz: a check failed; ``checks`` says which and why."""

    title = "Not ready"
    type_slug = "not-ready"


class FatalError(BatchgateError):
    """Do not retry: the request or the state must change first."""

    status = 400
    title = "Bad request"
    type_slug = "bad-request"


class InvalidRequest(FatalError):
    """The request body, query or headers failed validation."""

    status = 422
    title = "Invalid request"
    type_slug = "invalid-request"


class MalformedBody(FatalError):
    """The body is not JSON, or not the JSON object expected."""

    status = 400
    title = "Malformed body"
    type_slug = "malformed-body"


class UnsupportedMediaType(FatalError):
    """A body that is not ``application/json`` (or ``application/*+json``)."""

    status = 415
    title = "Unsupported media type"
    type_slug = "unsupported-media-type"


class BodyTooLarge(FatalError):
    """The body exceeds the configured size limit."""

    status = 413
    title = "Body too large"
    type_slug = "body-too-large"


class Unauthorized(FatalError):
    """No bearer token, or one batchgate does not know."""

    status = 401
    title = "Unauthorized"
    type_slug = "unauthorized"


class Forbidden(FatalError):
    """The caller is known but may not do this (e.g. not one of an approval's approvers)."""

    status = 403
    title = "Forbidden"
    type_slug = "forbidden"


class NotFound(FatalError):
    """No such resource for this tenant."""

    status = 404
    title = "Not found"
    type_slug = "not-found"


class Conflict(FatalError):
    """The resource's state does not allow the request."""

    status = 409
    title = "Conflict"
    type_slug = "conflict"


class StaleLease(Conflict):
    """The lease token is not the batch's current one: another attempt owns it."""

    title = "Stale lease"
    type_slug = "stale-lease"


class JobCancelled(Conflict):
    """The job is cancelled: it takes no more answers and cannot be resumed."""

    title = "Job cancelled"
    type_slug = "job-cancelled"


class FlowConflict(Conflict):
    """The same flow id and version is registered with other content."""

    title = "Flow version already registered with other content"
    type_slug = "flow-conflict"


class FlowVersionMismatch(Conflict):
    """The job's recorded flow hash no longer matches the registered definition."""

    title = "Flow version mismatch"
    type_slug = "flow-version-mismatch"


class CorruptRecord(Conflict):
    """A stored record failed its checksum; it is marked and will not run."""

    title = "Corrupt record"
    type_slug = "corrupt-record"


class IdempotencyInFlight(Conflict):
    """A request with this Idempotency-Key is still being processed."""

    title = "Request with this Idempotency-Key is in flight"
    type_slug = "idempotency-in-flight"


class IdempotencyMismatch(FatalError):
    """The Idempotency-Key was used before with another request body."""

    status = 422
    title = "Idempotency-Key reused with a different body"
    type_slug = "idempotency-mismatch"


class SourceUnavailable(RetryableError):
    """The job's item source could not be read right now."""

    title = "Source unavailable"
    type_slug = "source-unavailable"


class RunTooLong(Conflict):
    """The attempt ran past its stage's ``max_run``: the ledger has already failed it (the retry class
    decided: retried only for an idempotent stage), so its lease token is void and nothing more is to
    be reported for it. ``outcome`` is 'retry' or 'failed'."""

    title = "Run exceeded max_run"
    type_slug = "run-too-long"


class LedgerUnavailable(RetryableError):
    """The ledger's Redis cannot be reached (down, restarting, loading its data): retry later."""

    title = "Ledger unavailable"
    type_slug = "ledger-unavailable"


class QuotaExceeded(RetryableError):
    """A tenant quota (active jobs, job creations per minute, leases per second) refuses the request:
    nothing was written; ``quota``, ``limit`` and ``retry_after_s`` say which, how much and when."""

    status = 429
    title = "Quota exceeded"
    type_slug = "quota-exceeded"
