"""The deployment's generation: start-up recovery is decided once, before any process runs a job.

A generation is a stretch of time in which at least one batchgate process (an API worker, a push
worker, a supervisor) was alive on this ledger. Each of them joins it at its first contact with Redis
and renews its membership while it lives (``boot.lua`` on ``<p>:boot``). A process that finds no other
member alive starts the next generation: every process before it stopped or crashed, so this is a
restart, and the jobs it left running must be recovered (``auto``) or held (``record``) before anything
runs them. The first generation on a ledger has nothing before it and is decided at once.

Exactly one member holds the claim to decide: it runs the recovery pass over the jobs created before
the generation began (``gen_ms``, Redis's clock) and records the decision. Every member waits for the
decision before it leases, feeds, pumps or serves a request for a job, so whatever order processes
start in, none runs a job left running by the crash before its hold is decided; and since the
generation begins before any of them can create a job, a job created after the restart is never taken
for one left running by the crash.

Dead members. A member that has not renewed for MEMBER_TTL_MS is dead. Members on this host are
checked at once, by pid and process start time: a SIGKILLed ``batchgate up`` started again a moment
later is a restart, not a join. Members on other hosts are known dead only by their TTL: a whole
deployment killed and restarted on other hosts within MEMBER_TTL_MS joins the old generation (no
recovery pass; the supervisor still expires dead leases as their deadlines pass). A clean stop
leaves at once (supervisor, worker).
"""

from __future__ import annotations

import logging
import os
import secrets
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import redis

from gateway.ledger.keys import Keys
from gateway.ledger.scripts import source

log = logging.getLogger(__name__)

MEMBER_TTL_MS = 30_000  # a member not renewed for this long is dead
RENEW_S = 5.0  # a member renews at most this often (when it next asks whether it may run jobs)
CLAIM_MS = 60_000  # a decider that died mid-pass is replaced after this long
WAIT_STEP_S = 0.05


def _stat(pid: int) -> list[str] | None:
    """Fields of /proc/<pid>/stat after the command name (state first); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None


def member_id(role: str) -> str:
    """``host|pid|start time|role-token``: unique per process start, checkable on its own host."""
    pid = os.getpid()
    fields = _stat(pid)
    started = fields[19] if fields and len(fields) > 19 else ""
    return f"{socket.gethostname()}|{pid}|{started}|{role}-{secrets.token_hex(4)}"


def gone(member: str) -> bool:
    """Whether ``member`` ran on this host and its process is gone (or is another process now)."""
    host, _, rest = member.partition("|")
    pid_s, _, rest = rest.partition("|")
    started = rest.partition("|")[0]
    if host != socket.gethostname() or not pid_s.isdigit():
        return False
    try:
        os.kill(int(pid_s), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        pass  # alive, another user's: the start time below tells
    fields = _stat(int(pid_s))
    if fields is None:
        return False  # no /proc (not Linux): alive as far as we can tell
    return fields[0] in ("Z", "X") or (bool(started) and len(fields) > 19 and fields[19] != started)


class Generation:
    """This process's membership of the generation; ``decide(gen_ms)`` runs the recovery pass."""

    def __init__(self, client: redis.Redis, keys: Keys, role: str,
                 decide: Callable[[int], Any] | None = None) -> None:
        self.r = client
        self.key = keys.boot
        self.role = role
        self.decide = decide
        self.script = client.register_script(source("boot"))
        self.member: str | None = None  # made at the first join: after a fork, in the process that joins
        self.gen = ""
        self.gen_ms = 0
        self.decided = False
        self._renewed = float("-inf")
        self._lock = threading.Lock()

    def ready(self, wait_s: float = 0.0) -> bool:
        """Whether this process may run jobs now: joined (renewed every RENEW_S) and recovery decided, by
        this process (the pass runs here, now) or by another (waited for up to ``wait_s``).

        Redis errors propagate; the next call picks up where this one stopped.
        """
        with self._lock:  # threads of one process share it; one of them runs the pass
            if self.decided and time.monotonic() - self._renewed < RENEW_S:
                return True
            deadline = time.monotonic() + wait_s
            while True:
                state = self._call("join")
                if state == "decide":
                    return self._decide()
                if state == "ready":
                    return True
                if time.monotonic() >= deadline:
                    return False
                time.sleep(WAIT_STEP_S)

    def leave(self) -> None:
        """A clean stop: this process is no member any more (a crash leaves by TTL or pid check)."""
        if self.member is None:
            return
        try:
            self.script(keys=[self.key], args=["leave", self.member, MEMBER_TTL_MS, CLAIM_MS, self.gen])
        except redis.RedisError:
            pass

    def _call(self, op: str) -> str:
        first = self.member is None
        if first:
            self.member = member_id(self.role)
        dead = [m[2:] for m in self.r.hkeys(self.key) if m.startswith("m:") and gone(m[2:])] if first else []
        res = self.script(keys=[self.key], args=[op, self.member, MEMBER_TTL_MS, CLAIM_MS, self.gen, *dead])
        if op != "join":
            return res[0]
        state, gen, gen_ms = res[0], str(res[1]), int(res[2])
        if gen != self.gen:
            log.info("generation %s (began at %s ms) joined as %s: %s", gen, gen_ms, self.role, state)
        self.gen, self.gen_ms = gen, gen_ms
        self.decided = state == "ready"
        self._renewed = time.monotonic()
        return state

    def _decide(self) -> bool:
        log.warning("restart found (generation %s): recovering jobs created before %s ms, as %s",
                    self.gen, self.gen_ms, self.role)
        if self.decide is not None:
            self.decide(self.gen_ms)
        self.decided = self._call("decided") == "ok"
        return self.decided
