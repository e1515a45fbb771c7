"""gunicorn hooks for the batchgate API (``batchgate serve`` and ``batchgate up``: ``--config <path of this file>``).

A gunicorn worker notices that its master died only on its next loop turn (its parent pid changed), and
then keeps the listening socket open while it finishes its connections, up to ``graceful_timeout`` (30 s
by default). After a SIGKILL of the master, a new ``batchgate serve`` on the same port therefore failed
with "Connection in use" for as long. Here:

- ``post_fork``: on Linux every worker asks the kernel for SIGTERM when its master dies, even by
  SIGKILL (``PR_SET_PDEATHSIG``), so it learns at once rather than on its next turn.
- ``post_worker_init``: that SIGTERM, in a worker whose master is gone, first shuts its listening
  sockets down (``shutdown(SHUT_RDWR)``: the port is free for a new bind at once; connections queued
  but never accepted get a reset, connections already accepted are untouched), then stops as gunicorn
  stops a worker: requests in flight finish within ``graceful_timeout``, nothing new is accepted.
  Not when the listening socket came from a service manager (systemd socket activation:
  ``LISTEN_FDS``, or ``--bind fd://N``): that socket is shared with the manager, which holds it across
  restarts so that connections arriving meanwhile wait in its backlog instead of being refused;
  shutting it down would break it for the next start.

- ``post_fork``, too: gunicorn answers a request it cannot parse itself, before the app sees it (a
  request line over ``limit_request_line``: 414; too many or too long headers: 431; a malformed line,
  header or chunk: 400; an unsupported transfer coding: 501), with an HTML page written by
  ``gunicorn.util.write_error``. gunicorn has no setting or hook to render these, so that one function is
  replaced in each worker by :func:`write_problem`: the same status, an RFC 9457
  ``application/problem+json`` body, the reason cut to 200 characters. If a gunicorn release drops the
  function the replacement is skipped and the HTML answers stay (README, "Errors").

Import path: gunicorn puts its working directory first on ``sys.path`` (``Application.chdir``, before
and after it reads this file), so a ``numbers.py`` in the folder ``serve`` or ``up`` started from would
be imported by the master and every worker. This file is loaded by path (``--config <file>``, never
looked up on that path), takes the entry out before anything else is imported, and keeps gunicorn's
second chdir from putting it back. With ``python -P`` (gateway/runtime/procs.py ``python``) nothing from
the working directory is ever imported.

``SO_REUSEPORT`` was not used: it would let a new server bind beside the orphans, but the kernel would
keep handing about half the new connections to their sockets, which no longer accept; and two servers
started on one port by mistake would both run, silently sharing it.
"""

from __future__ import annotations

import os
import sys

_CWD = os.path.realpath(os.getcwd())
_NAMED = {os.path.realpath(p) for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p}
if _CWD not in _NAMED:  # (procs.safe_path_env names a source checkout run in place explicitly)
    sys.path[:] = [p for p in sys.path if p and os.path.realpath(p) != _CWD]


def _chdir_only(self: object) -> None:
    os.chdir(self.cfg.chdir)  # type: ignore[attr-defined]  # gunicorn's, without the sys.path insert


try:
    from gunicorn.app.base import Application

    Application.chdir = _chdir_only  # type: ignore[method-assign]
except (ImportError, AttributeError):  # not under gunicorn's own runner
    pass

import ctypes  # noqa: E402 - after the path is safe
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
from typing import Any  # noqa: E402

PR_SET_PDEATHSIG = 1

# gunicorn >= 25.1 opens a control socket by default at one path per user ($XDG_RUNTIME_DIR or
# ~/.gunicorn/gunicorn.ctl): every server of the user (``up`` and ``serve`` side by side) would take it
# over from the one before, and the first to stop would remove the other's. batchgate does not use it.
control_socket_disable = True


#: Longest part of gunicorn's reason (it may quote the request line) repeated in a problem's detail.
DETAIL_MAX = 200
_SLUGS = {400: "bad-request", 403: "forbidden", 414: "uri-too-long", 417: "expectation-failed",
          431: "header-fields-too-large", 500: "internal", 501: "not-implemented"}


def problem_bytes(status: int, reason: str, detail: str) -> bytes:
    """A complete HTTP/1.1 answer carrying an RFC 9457 problem; the connection is closed after it."""
    if len(detail) > DETAIL_MAX:
        detail = detail[:DETAIL_MAX - 1] + "\u2026"
    body = json.dumps({"type": f"https://batchgate.dev/problems/{_SLUGS.get(status, 'bad-request')}",
                       "title": reason, "status": status, "detail": detail or reason}).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\nConnection: close\r\n"
            f"Content-Type: application/problem+json\r\nContent-Length: {len(body)}\r\n\r\n")
    return head.encode("latin-1", "replace") + body


def write_problem(sock: Any, status_int: int, reason: str, mesg: str) -> None:
    """gunicorn.util.write_error's signature, writing problem+json instead of HTML."""
    from gunicorn import util

    util.write_nonblock(sock, problem_bytes(int(status_int), str(reason), str(mesg)))


def use_problem_errors() -> bool:
    """Replace gunicorn's HTML error writer with :func:`write_problem`; False if gunicorn has none."""
    try:
        from gunicorn import util
    except ImportError:
        return False
    if not all(callable(getattr(util, name, None)) for name in ("write_error", "write_nonblock")):
        return False
    util.write_error = write_problem
    return True


def post_fork(server: Any, worker: Any) -> None:
    """In the new worker: problem+json for gunicorn's own errors; SIGTERM when the master dies (Linux)."""
    use_problem_errors()
    # a listening socket handed over by a service manager (systemd's LISTEN_FDS, or --bind fd://N) is
    # shared with it: it keeps the socket, and the connections that arrive, across our restarts
    worker.batchgate_shared_listener = bool(getattr(server, "systemd", False)) or any(
        isinstance(address, int) for address in getattr(server.cfg, "address", ()))
    if not sys.platform.startswith("linux"):
        return
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return
    prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
    if os.getppid() != server.pid:  # the master died before prctl: no signal will come
        os.kill(os.getpid(), signal.SIGTERM)


def post_worker_init(worker: Any) -> None:
    """SIGTERM in an orphaned worker gives the port back at once, then stops gracefully."""
    master = worker.ppid
    graceful = signal.getsignal(signal.SIGTERM)
    accept = getattr(worker, "accept", None)
    if callable(accept):  # the gthread worker: a listener shut down below makes accept() fail (EINVAL)
        def quiet_accept(*args: Any, **kwargs: Any) -> Any:  # (listener), or (server, listener) before 24
            try:
                return accept(*args, **kwargs)
            except OSError:
                if worker.alive:
                    raise
                return None

        worker.accept = quiet_accept

    def on_term(sig: int, frame: Any) -> None:
        # (a signal handler runs in the main thread between two steps of the accept loop, and the
        # graceful handler below clears worker.alive before the loop can see the shut listener)
        if os.getppid() != master and not getattr(worker, "batchgate_shared_listener", False):
            for listener in worker.sockets:
                try:
                    getattr(listener, "sock", listener).shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        if callable(graceful):
            graceful(sig, frame)

    signal.signal(signal.SIGTERM, on_term)


def child_exit(server: Any, worker: Any) -> None:
    """A worker is gone: its live gauges (calls in flight) stop counting in /metrics (multiprocess mode)."""
    from gateway.metrics import mark_dead

    mark_dead(worker.pid)
