"""Pooled HTTP connections that do not go stale, and the one retry that is provably safe.

The failure this prevents. A keep-alive server closes a connection that sat idle for its timeout (Node,
so n8n: 5 s; gunicorn: 2 s; uvicorn, Apache: 5 s). urllib3 checks a pooled connection before reuse
(``is_connection_dropped``: has the peer's FIN arrived?), but a close that lands between that check and
the moment the server reads the request is not seen: the request is written to a socket the server has
just closed, the server's TCP answers with a reset, and the client reads end-of-file before any byte of
answer. For a call that starts a paid run that looked like "delivered, the run may have happened", and a
stage that is not idempotent failed ``outcome_unknown`` for a request the platform never read (about one
n8n job in nine).

Two parts, both in the guarded session (gateway.net.outbound):

1. **Idle limit.** A pooled connection idle longer than the limit is closed instead of reused: the
   target's ``keepalive_idle`` (seconds; :data:`DEFAULT_IDLE_S` when unset; 0 = a new connection for every
   request), and never longer than the server's own ``Keep-Alive: timeout=N`` hint minus
   :data:`HINT_MARGIN_S` (as undici does). Below the server's timeout the race cannot happen.
2. **Proof of non-delivery, and one retry.** Before writing a request, the connection reads Linux
   ``TCP_INFO`` (bytes the peer acknowledged and received, state). When the request fails before any
   answer, it reads it again before the socket closes (:func:`delivery_verdict`): a reset with not one
   byte of the request acknowledged, or a reset with no FIN after bytes were acknowledged (the server
   closed its socket with them unread), means no application read the request and nothing ran. Such a
   failure is marked (:data:`NOT_DELIVERED`) on the exception; on a *reused* connection the request is
   sent once more on a fresh connection (Go's transport also retries only on a reused connection);
   anywhere else the connectors class it as never sent (an outage, no attempt spent). Where ``TCP_INFO``
   is missing (not Linux) nothing is marked and the old, cautious classes apply. docs/design.md
   ("Stale connections") compares this with what Go's transport and urllib3 do.
"""

from __future__ import annotations

import contextlib
import contextvars
import http.client
import logging
import re
import socket
import struct
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

from urllib3.util.wait import wait_for_read

from connectors.transport import NOT_DELIVERED

log = logging.getLogger(__name__)

DEFAULT_IDLE_S = 1.0
"""Longest idle time of a reused connection when the target sets none: below every common server
keep-alive timeout (gunicorn 2 s, Node/n8n 5 s, uvicorn 5 s, nginx 75 s)."""
HINT_MARGIN_S = 1.0
"""Taken off a server's ``Keep-Alive: timeout=N`` hint, for clock and network delays."""

# struct tcp_info (linux/tcp.h): tcpi_state u8 at 0, tcpi_unacked u32 at 24, tcpi_rtt u32 (us) at 68,
# tcpi_bytes_acked u64 at 120, tcpi_bytes_received u64 at 128 (both since Linux 4.1/4.2)
_TCPI_UNACKED_AT, _TCPI_RTT_AT, _TCPI_BYTES_AT, _TCPI_LEN = 24, 68, 120, 136
TCP_CLOSE_WAIT, TCP_CLOSE = 8, 7  # linux/tcp_states.h: the peer's FIN is here; reset (or fully closed)
VERDICT_WAIT_MIN_S = 0.02
VERDICT_WAIT_MAX_S = 1.0
"""How long a failed request waits for the peer's TCP to acknowledge or reset its bytes: four round
trips, within these bounds."""
_KEEP_ALIVE_TIMEOUT = re.compile(r"\btimeout\s*=\s*(\d+)", re.IGNORECASE)

_idle_limit: contextvars.ContextVar[float | None] = contextvars.ContextVar("keepalive_idle_s", default=None)
_fresh: contextvars.ContextVar[bool] = contextvars.ContextVar("keepalive_fresh", default=False)


@contextlib.contextmanager
def idle_limit(seconds: float | None) -> Iterator[None]:
    """Requests made in this block reuse no pooled connection idle longer than ``seconds`` (None: the
    default)."""
    token = _idle_limit.set(seconds)
    try:
        yield
    finally:
        _idle_limit.reset(token)


@contextlib.contextmanager
def fresh_connections() -> Iterator[None]:
    """Requests made in this block use a new connection each."""
    token = _fresh.set(True)
    try:
        yield
    finally:
        _fresh.reset(token)


class TcpState(NamedTuple):
    """What Linux ``TCP_INFO`` tells of a connection: its state, segments of ours not yet acknowledged,
    the smoothed round trip, bytes of ours the peer acknowledged, bytes received (a FIN counts 1)."""

    state: int
    unacked: int
    rtt_us: int
    acked: int
    received: int


def tcp_state(sock: Any) -> TcpState | None:
    """The :class:`TcpState` of a TCP socket; None where the kernel does not tell (another system, a
    kernel before 4.2, a closed socket)."""
    option = getattr(socket, "TCP_INFO", None)
    if option is None or sock is None:
        return None
    try:
        raw = sock.getsockopt(socket.IPPROTO_TCP, option, 256)
    except (OSError, ValueError):
        return None
    if len(raw) < _TCPI_LEN:
        return None
    (unacked,) = struct.unpack_from("=I", raw, _TCPI_UNACKED_AT)
    (rtt_us,) = struct.unpack_from("=I", raw, _TCPI_RTT_AT)
    return TcpState(raw[0], unacked, rtt_us, *struct.unpack_from("=QQ", raw, _TCPI_BYTES_AT))


def delivery_verdict(before: TcpState, sock: Any) -> bool | None:
    """Whether a request written after ``before`` was provably NOT read by the peer's application
    (True), may have been (False), or the kernel cannot tell (None).

    Waits briefly, when the peer has closed (its FIN is here) and our bytes are still unacknowledged,
    for its TCP to either acknowledge them or reset the connection. Then:

    - reset, and not one byte of the request acknowledged: the request never reached the peer's socket
      before the socket was gone;
    - reset, bytes acknowledged, and no FIN: the peer closed its socket with our bytes unread (a socket
      closed with unread data sends a reset instead of a FIN: RFC 2525 2.17, what Linux does), so the
      request was not read in full;
    - anything else (a FIN after the bytes were acknowledged, a timeout, no reset): it may have run.
    """
    after = tcp_state(sock)
    if after is None:
        return None
    if after.state == TCP_CLOSE_WAIT and after.acked == before.acked and after.unacked:
        deadline = time.monotonic() + min(max(4 * after.rtt_us / 1e6, VERDICT_WAIT_MIN_S), VERDICT_WAIT_MAX_S)
        while after.state == TCP_CLOSE_WAIT and after.acked == before.acked and time.monotonic() < deadline:
            time.sleep(0.002)
            after = tcp_state(sock) or after
    if after.state != TCP_CLOSE:
        return False
    if after.acked == before.acked:
        return True
    return after.received == before.received


class ProvenDeliveryMixin:
    """For an urllib3 HTTPConnection: the acknowledged-bytes proof and the server's keep-alive hint.

    ``_bg_uses`` counts requests on the current socket; ``_bg_before`` holds the TCP counters taken
    before this request was written; ``_bg_verdict`` is the reading after a failure ("reused"/"fresh"
    when not delivered, "" when it may have been).
    """

    _bg_uses = 0
    _bg_reused = False
    _bg_before: TcpState | None = None
    _bg_verdict: str | None = None
    _bg_hint_s: float | None = None

    def connect(self) -> None:
        self._bg_uses = 0
        self._bg_hint_s = None
        super().connect()  # type: ignore[misc]

    def request(self, *args: Any, **kwargs: Any) -> None:
        conn: Any = self
        self._bg_verdict = None
        if conn.sock is not None and self._bg_uses > 0 and wait_for_read(conn.sock, timeout=0.0):
            conn.close()  # the server closed it since the pool's check (readable = its FIN): a new one
        self._bg_reused = conn.sock is not None and self._bg_uses > 0
        if conn.sock is None:
            conn.connect()  # as http.client would inside the request, but before the counters are read
        self._bg_before = tcp_state(conn.sock)
        self._bg_uses += 1
        try:
            super().request(*args, **kwargs)  # type: ignore[misc]
        except OSError as exc:  # urllib3 passes EPIPE/ECONNRESET on; others end the request here
            self._mark(exc)
            raise

    def getresponse(self) -> Any:
        try:
            resp = super().getresponse()  # type: ignore[misc]
        except (OSError, http.client.HTTPException) as exc:
            self._mark(exc)
            raise
        self._bg_before = None
        hint = _KEEP_ALIVE_TIMEOUT.search(resp.headers.get("Keep-Alive") or "")
        self._bg_hint_s = float(hint.group(1)) if hint else None
        return resp

    def close(self) -> None:
        self._judge()  # http.client closes the socket before raising: read the counters first
        super().close()  # type: ignore[misc]

    def _judge(self) -> None:
        if self._bg_before is None or self._bg_verdict is not None:
            return
        before, self._bg_before = self._bg_before, None
        sock = getattr(self, "sock", None)
        proven = delivery_verdict(before, sock)
        self._bg_verdict = ("reused" if self._bg_reused else "fresh") if proven else ""
        after = tcp_state(sock)
        log.debug("request failed before an answer on a %s connection: %s (tcp state %s, %s bytes of it "
                  "acknowledged, %s received)", "reused" if self._bg_reused else "new",
                  {True: "not read by the server", False: "may have been read", None: "cannot tell"}[proven],
                  after and after.state, after and after.acked - before.acked,
                  after and after.received - before.received)

    def _mark(self, exc: BaseException) -> None:
        self._judge()
        if self._bg_verdict:
            setattr(exc, NOT_DELIVERED, self._bg_verdict)


class IdleLimitPoolMixin:
    """For an urllib3 connection pool: a pooled connection idle past the limit is not reused."""

    def _get_conn(self, timeout: float | None = None) -> Any:
        conn = super()._get_conn(timeout)  # type: ignore[misc]
        if conn is not None and getattr(conn, "sock", None) is not None:
            idle_s = time.monotonic() - getattr(conn, "_bg_idle_since", 0.0)
            if _fresh.get() or idle_s > reuse_limit_s(conn):
                conn.close()  # the next request on it opens a new socket
        return conn

    def _put_conn(self, conn: Any) -> None:
        if conn is not None:
            conn._bg_idle_since = time.monotonic()
        super()._put_conn(conn)  # type: ignore[misc]


def reuse_limit_s(conn: Any) -> float:
    """How long ``conn`` may have been idle and still be reused now."""
    limit = _idle_limit.get()
    limit = DEFAULT_IDLE_S if limit is None else limit
    hint = getattr(conn, "_bg_hint_s", None)
    if hint is not None:
        limit = min(limit, hint - HINT_MARGIN_S)
    return limit


def replayable(body: Any) -> bool:
    """Whether a prepared request's body can be sent again (bytes, text or nothing; not a stream)."""
    return body is None or isinstance(body, (bytes, str))
