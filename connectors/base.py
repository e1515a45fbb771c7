"""The connector interface: trigger a stage on a platform, read its callback, poll a run, classify failures.

Pure: no Flask, no RQ, no Redis. The gateway builds a :class:`StageCall` from the ledger's lease, calls
``trigger``, and acts on the :class:`Outcome`:

- ``Done``: the platform answered with the stage's result (sync mode): commit it or take the failure path.
- ``Accepted``: the platform took the call and will post the answer to ``callback_url`` (callback mode).
- ``Running``: the platform gave a run id to poll; the gateway calls ``poll(call, handle)`` later.

Failures raise :class:`PlatformError` with a :class:`Retry` class: ``RETRYABLE`` (always),
``IF_IDEMPOTENT`` (the flow ran and failed, possibly after side effects: retry only if the stage is
idempotent), ``UNKNOWN`` (the request was delivered but its outcome is unknown: a read timeout, a dropped
connection, a 5xx from a gateway in front of a run that may go on; idempotent stages retry, others first
try to learn the outcome from the platform ids, else fail as ``outcome_unknown``), or ``FATAL``. A failure
that says the *target* is unavailable rather than this call failing (connection refused, DNS failure, 429,
503, a webhook not registered yet while the platform boots) also sets ``outage``: the gateway then cools
the target down and gives the batch back without spending an attempt. Every error and outcome carries the
platform's own ids (execution id, run id, debug_url, log id) in ``platform_ids`` for the batch log. An
``UNKNOWN`` error that comes with a run id the platform gave also carries ``handle``: exactly the dict
``poll(call, handle, session)`` accepts, so the gateway can learn the outcome by polling instead of running
the flow again.

A run that stops to wait for a person raises :class:`WaitingHuman` (a FATAL ``waiting_human``
``PlatformError``): its ``resume`` is a JSON handle that ``Connector.resume(call, handle, decision, session)``
takes once a person decided (:class:`Decision`), or None with ``how`` saying where a person answers it.
``resume`` returns the same outcomes as ``trigger``/``poll`` (docs/connectors-failure-modes.md, "Resuming a
run that waits for a person").

Long calls show life through ``StageCall.on_progress`` (a Dify event stream calls it on every event, ping
included, at most once a second), where the gateway heartbeats the lease.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import hmac
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import requests
import urllib3

WAITING_HUMAN = "waiting_human"
"""Error type (``PlatformError.code``) of a run that stopped to wait for a person: an n8n Wait or "send and
wait" node without a time limit (or one past the stage's max_run), a Dify human-input node, a Coze
question/input node. batchgate cannot answer it; the batch fails with this type and the platform's prompt."""
OUTPUT_TRIMMED = "output_trimmed"
"""Error type of a run that succeeded but whose platform cut its output (Coze ``is_output_trimmed``): a cut
result is never committed."""

ENVELOPE_FIELDS = ("job_id", "seq", "stage", "attempt", "idempotency_key", "cursor", "items",
                   "items_url", "input", "params", "callback_url")


class Retry(enum.Enum):
    """What a failure allows."""

    RETRYABLE = "retryable"
    IF_IDEMPOTENT = "retryable_if_idempotent"
    UNKNOWN = "outcome_unknown"
    FATAL = "fatal"


class PlatformError(Exception):
    """A stage call failed; ``retry`` says whether trying again can help."""

    def __init__(self, message: str, retry: Retry, *, retry_after_s: float | None = None,
                 status: int | None = None, code: str | None = None,
                 platform_ids: dict[str, str] | None = None, outage: bool = False,
                 handle: dict[str, Any] | None = None, booting: bool = False,
                 prompt: str | None = None, usage: Usage | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.retry = retry
        self.retry_after_s = retry_after_s
        self.status = status
        self.code = code
        self.platform_ids = platform_ids or {}
        #: the target is unavailable (not this call's own failure): cool the target down, spend no attempt
        self.outage = outage
        #: with ``outage``: the platform answers but is still starting (n8n's "starting up", "Database is
        #: not ready", a webhook not registered yet): it is coming back, so the gateway probes within seconds
        self.booting = booting
        #: with UNKNOWN: the poll handle of the run the platform created (``connector.poll`` accepts it), so
        #: the outcome can be learnt by polling rather than by running the flow again; None when no run id
        self.handle = handle
        #: with code WAITING_HUMAN: what the platform asks the person (clipped), when its API tells
        self.prompt = prompt
        #: what the platform reported the failed run cost (a Dify run that failed after its LLM nodes ran)
        self.usage = usage

    def retryable_for(self, stage_idempotent: bool) -> bool:
        """Whether the gateway may try again, given the stage's idempotency."""
        return self.retry is Retry.RETRYABLE or (
            self.retry in (Retry.IF_IDEMPOTENT, Retry.UNKNOWN) and stage_idempotent)


class WaitingHuman(PlatformError):
    """A run stopped to wait for a person (FATAL ``waiting_human`` unless someone resumes it).

    ``resume`` is the JSON-serialisable handle ``Connector.resume`` takes (``platform`` names the connector;
    ``execution_id``/``workflow_run_id``/``execute_id`` lets ``poll`` watch the run), or None when the
    platform's API cannot resume this wait; ``how`` then says where a person answers it (always set).
    """

    def __init__(self, message: str, *, prompt: str | None, resume: dict[str, Any] | None, how: str,
                 platform_ids: dict[str, str] | None = None, watch: dict[str, Any] | None = None) -> None:
        super().__init__(message, Retry.FATAL, code=WAITING_HUMAN, platform_ids=platform_ids, prompt=prompt)
        self.resume = resume
        self.how = how
        #: the handle ``poll`` takes to watch this run (the gateway keeps it, so the batch's next attempt
        #: asks the run for its outcome instead of starting the flow again); None when the run has no id
        self.watch = watch


@dataclass(frozen=True)
class Decision:
    """What a person decided about a waiting run, as ``Connector.resume`` passes it on."""

    approved: bool
    comment: str | None = None
    #: the person's answer or edited output (form values, a question's answer); None: nothing given
    output: Any = None
    #: who decided (shown to the platform where it keeps a submitter)
    actor: str | None = None

    @property
    def word(self) -> str:
        return "approve" if self.approved else "reject"


@dataclass(frozen=True)
class Usage:
    """What a platform reported a call cost: tokens, price (decimal text, as platforms send it) and its
    currency; None where it reports nothing. n8n reports none (its calls are counted by duration only)."""

    tokens: int | None = None
    price: str | None = None
    currency: str | None = None

    @classmethod
    def parse(cls, tokens: Any = None, price: Any = None, currency: Any = None) -> Usage | None:
        """A Usage from a platform's raw fields, dropping what is not a count, an amount or a currency
        code; None when nothing is left."""
        n = tokens if isinstance(tokens, int) and not isinstance(tokens, bool) and tokens >= 0 else None
        if isinstance(tokens, str) and tokens.isdigit():
            n = int(tokens)
        amount = None
        if isinstance(price, (int, float, str)) and not isinstance(price, bool):
            try:
                value = float(price)
            except ValueError:
                value = -1.0
            if 0 <= value < 1e12:
                amount = f"{value:.10g}"
        code = None
        if isinstance(currency, str) and currency.strip().isalpha():
            code = currency.strip().upper()[:8]
        if n is None and amount is None:
            return None
        return cls(n, amount, code)

    def public(self) -> dict[str, Any]:
        """The JSON form (the pull ``complete`` body's ``usage`` and the cost ledger's input)."""
        return {"tokens": self.tokens, "price": self.price, "currency": self.currency}


@dataclass(frozen=True)
class Answer:
    """A stage's result, from a sync response, a callback or a finished poll (the public contract)."""

    succeeded: bool
    output: Any = None
    next_cursor: Any = None
    has_next_cursor: bool = False
    error_message: str | None = None
    error_retryable: bool = True
    #: the platform waits for a person (``{"status": "waiting_human", "prompt": ...}``): the gateway
    #: opens an approval showing ``prompt`` instead of committing or failing
    waiting: bool = False
    prompt: Any = None
    #: what the platform reported the call cost (a callback body's optional ``usage``, a Dify run's
    #: ``total_tokens``...); None: nothing reported
    usage: Usage | None = None

    @classmethod
    def parse(cls, body: Any) -> Answer:
        """Read ``{"status", "output", "next_cursor"?, "error": {...}, "usage"?}`` (see parse_body);
        ``usage`` is ``{"tokens", "price", "currency"}``, each optional."""
        answer = cls.parse_body(body)
        raw = body.get("usage")
        if isinstance(raw, dict):
            usage = Usage.parse(raw.get("tokens"), raw.get("price"), raw.get("currency"))
            if usage is not None:
                answer = dataclasses.replace(answer, usage=usage)
        return answer

    @classmethod
    def parse_body(cls, body: Any) -> Answer:
        """Read ``{"status", "output", "next_cursor"?, "error": {"message", "retryable"}}``, or
        ``{"status": "waiting_human", "prompt"}``.

        Raises ValueError with a precise message when the body does not follow the contract.
        """
        if not isinstance(body, dict):
            raise ValueError("answer must be a JSON object")
        status = body.get("status")
        if status == "waiting_human":
            return cls(False, waiting=True, prompt=body.get("prompt"))
        if status not in ("succeeded", "failed"):
            raise ValueError('answer.status must be "succeeded", "failed" or "waiting_human"')
        if status == "failed":
            error = body.get("error") or {}
            if not isinstance(error, dict):
                raise ValueError("answer.error must be an object")
            retryable = error.get("retryable", True)
            if not isinstance(retryable, bool):
                raise ValueError("answer.error.retryable must be a boolean")
            return cls(False, error_message=str(error.get("message") or "platform reported failure")[:2000],
                       error_retryable=retryable)
        return cls(True, output=body.get("output"), next_cursor=body.get("next_cursor"),
                   has_next_cursor="next_cursor" in body)


@dataclass(frozen=True)
class StageCall:
    """Everything a connector needs to run one stage attempt of one batch."""

    envelope: dict[str, Any]
    target: dict[str, Any]
    secrets: dict[str, str] = field(default_factory=dict, repr=False)  # never in a log or traceback
    timeout_s: float = 30.0
    signing_key: bytes = field(default=b"", repr=False)
    idempotent: bool = False
    #: called (no arguments, at most once a second) while a long call shows life, e.g. on each Dify stream
    #: event; the gateway heartbeats the lease there. Exceptions it raises are logged and ignored.
    on_progress: Callable[[], None] | None = field(default=None, repr=False, compare=False)
    #: unix time at which this attempt's ``max_run`` ends (its platform call + max_run), when known: a run
    #: that will not resume before it (an n8n execution waiting past it) is not polled on
    run_deadline_s: float | None = None

    @property
    def idempotency_key(self) -> str:
        return self.envelope["idempotency_key"]

    @property
    def callback_mode(self) -> bool:
        return self.target.get("mode") == "callback"

    def secret(self, field_name: str) -> str | None:
        """The secret a ``*_secret`` target field names, resolved by the gateway from its settings."""
        return self.secrets.get(field_name)


@dataclass(frozen=True)
class Done:
    answer: Answer
    platform_ids: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Accepted:
    platform_ids: dict[str, str] = field(default_factory=dict)
    #: the run the platform started, in the form ``poll`` takes, when it named one and can be asked: if
    #: the callback never comes, the next attempt asks about this run before triggering the flow again
    handle: dict[str, Any] | None = None


@dataclass(frozen=True)
class Running:
    handle: dict[str, Any]
    platform_ids: dict[str, str] = field(default_factory=dict)
    #: the platform's own word for the run's state (n8n ``waiting``, Dify ``running``...): the batch log
    #: records a poll only when this changes
    status: str = field(default="running", compare=False)


Outcome = Done | Accepted | Running


class Connector(Protocol):
    """One platform."""

    def trigger(self, call: StageCall, session: requests.Session) -> Outcome: ...

    def poll(self, call: StageCall, handle: dict[str, Any], session: requests.Session) -> Outcome: ...


class Resumable(Protocol):
    """A connector that can resume a run waiting for a person (n8n, Dify, Coze)."""

    def resume(self, call: StageCall, handle: dict[str, Any], decision: Decision,
               session: requests.Session) -> Outcome: ...


def signed_headers(call: StageCall, body: bytes, now: float | None = None) -> dict[str, str]:
    """Headers on every outbound call: idempotency key, job/seq/stage/attempt, HMAC signature.

    ``Batchgate-Signature: t=<unix seconds>,v1=<hex hmac-sha256 of "<t>.<body>">`` (the scheme Stripe
    and others use); a platform verifies it with the shared signing secret.
    """
    env = call.envelope
    ts = str(int(now if now is not None else time.time()))
    mac = hmac.new(call.signing_key, ts.encode() + b"." + body, hashlib.sha256).hexdigest()
    return {
        "Content-Type": "application/json",
        "Idempotency-Key": call.idempotency_key,
        "Batchgate-Job-Id": str(env["job_id"]),
        "Batchgate-Seq": str(env["seq"]),
        "Batchgate-Stage": str(env["stage"]),
        "Batchgate-Attempt": str(env["attempt"]),
        "Batchgate-Signature": f"t={ts},v1={mac}",
    }


def verify_signature(header: str, body: bytes, key: bytes, tolerance_s: float = 300,
                     now: float | None = None) -> bool:
    """Check a ``Batchgate-Signature`` header (for platforms and tests)."""
    try:
        parts = dict(p.split("=", 1) for p in header.split(","))
        ts = int(parts["t"])
    except (ValueError, KeyError):
        return False
    if abs((now if now is not None else time.time()) - ts) > tolerance_s:
        return False
    expected = hmac.new(key, str(ts).encode() + b"." + body, hashlib.sha256).hexdigest()
    return hmac.compare_digest(expected, parts.get("v1", ""))


def encode(payload: Any) -> bytes:
    """Request body bytes, as signed."""
    return json.dumps(payload, separators=(",", ":"), ensure_ascii=False).encode()


def retry_after_s(resp: requests.Response) -> float | None:
    """Retry-After in seconds from now (delta-seconds, or an HTTP date, which is always GMT), or None when
    absent or not valid. Parsed by urllib3, as chunker.httputil does."""
    value = resp.headers.get("Retry-After")
    if not value:
        return None
    try:
        return float(_RETRY_AFTER.parse_retry_after(value))
    except urllib3.exceptions.InvalidHeader:
        return None


_RETRY_AFTER = urllib3.util.Retry()


def classify_http(resp: requests.Response, *, poll: bool = False) -> Retry:
    """The shared HTTP status classification.

    429: RETRYABLE (an outage, see :func:`is_outage`). A 503 that a proxy in front answered without
    forwarding the call (:func:`never_forwarded`): RETRYABLE, nothing ran. Any other 5xx on a call that
    starts a run (``poll`` False): UNKNOWN, the request was delivered and the run may go on behind a gateway
    that gave up (a bare 503 too, which is also an outage). 5xx on a poll (a read without side effects):
    RETRYABLE. Anything else: FATAL.
    """
    status = resp.status_code
    if status == 429 or never_forwarded(resp):
        return Retry.RETRYABLE
    if status >= 500:
        return Retry.RETRYABLE if poll else Retry.UNKNOWN
    return Retry.FATAL


NOT_FORWARDED_503 = re.compile(
    r"^no healthy upstream$"
    r"|^upstream connect error or disconnect/reset before headers\. reset reason: "
    r"(?:remote )?(?:connection failure|overflow)"
    r"|<center>nginx</center>", re.IGNORECASE)
"""Bodies of a 503 that the proxy in front wrote without passing the call on: Envoy's "no healthy
upstream", its connect failure and circuit-breaker overflow (not "connection termination" or "remote reset",
which may come after the request went through, nor "retried and the latest reset reason", whose earlier
tries may have reached the platform), and nginx's own error page (its 503s are limit_req/limit_conn
refusals; an upstream's 503 is passed through with the upstream's body)."""


def never_forwarded(resp: requests.Response) -> bool:
    """Whether a 503 provably never reached the platform: a proxy refused it (:data:`NOT_FORWARDED_503`)."""
    if resp.status_code != 503:
        return False
    try:
        text = (resp.text or "").strip()[:2000]
    except (requests.RequestException, RuntimeError):  # a body already consumed or cut
        return False
    return bool(NOT_FORWARDED_503.search(text))


def is_outage(status: int | None) -> bool:
    """Whether an HTTP status says the target is unavailable (429, 503) rather than this call failing."""
    return status in (429, 503)


def map_fields(mapping: dict[str, str] | None, envelope: dict[str, Any],
               default: dict[str, Any]) -> dict[str, Any]:
    """Build platform variables from the envelope: ``{"resumes": "items", "job": "params.title"}``.

    Values are dotted paths into the envelope; ``$json`` serialises the whole envelope as a string
    (for platforms whose inputs are strings). With no mapping, ``default`` is used.
    """
    if not mapping:
        return default
    out: dict[str, Any] = {}
    for name, path in mapping.items():
        if path == "$json":
            out[name] = json.dumps(envelope, ensure_ascii=False)
            continue
        value: Any = envelope
        for part in path.split("."):
            value = value.get(part) if isinstance(value, dict) else None
        out[name] = value
    return out
