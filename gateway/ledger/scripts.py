"""Ledger Lua scripts: one .lua file per operation, each prefixed with lib.lua, registered once per client."""

from __future__ import annotations

from dataclasses import dataclass
from importlib import resources

import redis
from redis.commands.core import Script

OPERATIONS = (
    "plan", "lease", "heartbeat", "complete", "fail", "expire", "reopen", "replan", "set_status", "selfcheck",
    "slot", "cancel", "begin", "source_fail", "outage", "unwait", "handle",
)


def source(name: str) -> str:
    """The full text of one script: the shared helpers, then the operation."""
    lua = resources.files("gateway.ledger") / "lua"
    return (lua / "lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


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
    outage: Script
    unwait: Script
    handle: Script

    @classmethod
    def register(cls, client: redis.Redis) -> Scripts:
        """Register every operation's script with ``client`` (EVALSHA, loaded on first use)."""
        return cls(**{name: client.register_script(source(name)) for name in OPERATIONS})
