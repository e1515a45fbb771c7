"""Ledger Lua scripts: one .lua file per operation, each prefixed with lib.lua, registered once per client."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources
from typing import Any, Protocol

import redis
from redis.commands.core import Script

from gateway import tracing

OPERATIONS = (
    "plan", "lease", "heartbeat", "complete", "fail", "expire", "reopen", "replan", "set_status", "selfcheck",
    "slot", "cancel", "begin", "source_fail", "breaker", "outage", "unwait", "handle", "decide",
    "open_approval",
    "compact", "rest",  # result sinks (docs/design.md "Result sinks and compaction")
)


def source(name: str) -> str:
    """The full text of one script: the shared helpers, then the operation."""
    lua = resources.files("gateway.ledger") / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class Observer(Protocol):
    """Hears of every script run that names a job's record (jobindex.JobIndex)."""

    def job_in(self, keys: list) -> str | None: ...

    def run(self, script: Script, job_id: str, keys: list, args: list) -> Any: ...


class Observed:
    """A registered script whose runs on a job go through the observer (the job index follows every
    status change this way, present scripts and future ones alike). Called like a redis-py Script."""

    def __init__(self, script: Script, observer: Observer) -> None:
        self.script = script
        self.observer = observer

    def __call__(self, keys: list | tuple = (), args: list | tuple = (), client: Any = None) -> Any:
        job_id = self.observer.job_in(keys) if client is None else None
        if job_id is None:
            return self.script(keys=keys, args=args, client=client)
        if not tracing.enabled():
            return self.observer.run(self.script, job_id, list(keys), list(args))
        # the observer sends the script by its sha in its own round trip: the span is taken here
        with tracing.span(getattr(self.script, "name", "ledger.script"), kind="client",
                          **{"db.system": "redis"}):
            return self.observer.run(self.script, job_id, list(keys), list(args))


@dataclass(frozen=True)
class Scripts:
    """The registered scripts of one Redis client, by operation name."""

    plan: Script
    lease: Script
    heartbeat: Script
    complete: Script
    fail: Script
    expire: Script
    reopen: Script
    replan: Script
    set_status: Script
    selfcheck: Script
    slot: Script
    cancel: Script
    begin: Script
    source_fail: Script
    breaker: Script
    outage: Script
    unwait: Script
    handle: Script
    decide: Script
    open_approval: Script
    compact: Script
    rest: Script

    @classmethod
    def register(cls, client: redis.Redis, observer: Observer | None = None) -> Scripts:
        """Register every operation's script with ``client`` (EVALSHA, loaded on first use); with an
        ``observer``, each run that names a job's record goes through it (Observed)."""
        made = {name: Traced(name, client.register_script(source(name))) for name in OPERATIONS}
        if observer is not None:  # outermost: ``.script`` stays the bare (traced) script
            made = {name: Observed(script, observer) for name, script in made.items()}
        return cls(**made)


class Traced:
    """A script whose runs are spans (``ledger.<operation>``) when tracing is on (gateway/tracing.py)."""

    def __init__(self, name: str, script: Any) -> None:
        self.name = f"ledger.{name}"
        self.script = script

    def __call__(self, keys: list | tuple = (), args: list | tuple = (), client: Any = None) -> Any:
        if not tracing.enabled():
            return self.script(keys=keys, args=args, client=client)
        with tracing.span(self.name, kind="client", **{"db.system": "redis"}):
            return self.script(keys=keys, args=args, client=client)

    def __getattr__(self, attr: str) -> Any:  # sha, script text, ... of the wrapped script
        return getattr(self.script, attr)
