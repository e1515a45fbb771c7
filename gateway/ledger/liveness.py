"""Liveness of the long-running processes: supervisors and push workers beat, readiness reads the beats.

Each process of a role writes ``<name> -> <ms now>`` into one hash per role (``<p>:alive:<role>``), its
name being ``<host>:<pid>`` (in a container the host is the container's id, so a healthcheck run inside
the container finds its own process by host). A beat is one HSET; a reader counts a beat as fresh when
it is younger than its ``max_age``. Stale fields are removed by readers now and then, so a hash holds
about one field per live process. One global key per role is fine at any size (a field per process,
one write a second each); on a cluster it lives in one slot like any single key.
"""

from __future__ import annotations

import os
import socket
import time
from dataclasses import dataclass

import redis

from gateway.ledger.keys import Keys

ROLES = ("supervisor", "worker")
FORGET_AFTER_S = 3600.0  # a beat this old is a process long gone: readers drop it


def process_name() -> str:
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class Beat:
    name: str
    age_s: float


class Liveness:
    """Writes and reads the beats of one role; one instance per process and role."""

    def __init__(self, client: redis.Redis, keys: Keys, role: str, every_s: float = 1.0) -> None:
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}")
        self.r, self.key, self.every_s = client, keys.alive(role), every_s
        self.name = process_name()
        self._last = 0.0

    def beat(self, force: bool = False) -> bool:
        """Record that this process is alive (at most once per ``every_s`` unless forced); True if written.
        Redis errors propagate: a process that cannot reach Redis is not alive for anyone reading."""
        now = time.monotonic()
        if not force and now - self._last < self.every_s:
            return False
        self.r.hset(self.key, self.name, int(time.time() * 1000))
        self._last = now
        return True

    def gone(self) -> None:
        """A clean stop: forget this process's beat at once."""
        self.r.hdel(self.key, self.name)

    def beats(self, host: str | None = None) -> list[Beat]:
        """Every recorded beat (of ``host``'s processes only, if given), youngest first."""
        now_ms = time.time() * 1000
        out, stale = [], []
        for name, ms in self.r.hgetall(self.key).items():
            age = max(0.0, (now_ms - int(ms)) / 1000)
            if age > FORGET_AFTER_S:
                stale.append(name)
            elif host is None or name.rsplit(":", 1)[0] == host:
                out.append(Beat(name, age))
        if stale:
            self.r.hdel(self.key, *stale)
        return sorted(out, key=lambda b: b.age_s)

    def fresh(self, max_age_s: float, host: str | None = None) -> list[Beat]:
        return [b for b in self.beats(host) if b.age_s <= max_age_s]
