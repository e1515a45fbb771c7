"""MULTI on a plain Redis or a Redis Cluster: ``multi(client)`` is where batchgate asks for a transaction.

On a plain Redis it is redis-py's transactional pipeline, unchanged. On a Redis Cluster a MULTI must stay
in one slot, and batchgate's transactions often join a job's keys (hash tag ``{<job>}``) with global
ones (the tenant's roster, the active set, the tenant's job index, tagged ``{<tenant>}``). There the
commands are grouped by slot and each group runs as its own MULTI, groups in the order their first
command was queued: what shares a slot (one job's keys, one tenant's index) still changes at one
instant; across slots the steps are separate, and docs/design.md (Cluster) says why each such split is
safe (the global structures are rebuildable from the job keys and written idempotently).
"""

from __future__ import annotations

from typing import Any

#: Commands whose every argument is a key: split across slots, one command per slot.
_ALL_KEYS = {"delete", "unlink", "exists", "touch"}


def is_cluster_client(client: Any) -> bool:
    from redis.cluster import RedisCluster

    return isinstance(client, RedisCluster)


def multi(client: Any) -> Any:
    """A transactional pipeline: redis-py's on a plain Redis, a SlotMulti on a cluster."""
    if is_cluster_client(client):
        return SlotMulti(client)
    return client.pipeline(transaction=True)


class SlotMulti:
    """Queues pipeline commands and runs them as one MULTI per slot (see the module docstring).

    ``execute()`` answers one reply per queued command, in queue order; a command whose keys span slots
    (only ``delete``-like ones are allowed to) answers the sum of its parts."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._queued: list[tuple[str, tuple, dict]] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)

        def queue(*args: Any, **kwargs: Any) -> SlotMulti:
            self._queued.append((name, args, kwargs))
            return self

        return queue

    def __len__(self) -> int:
        return len(self._queued)

    def __enter__(self) -> SlotMulti:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.reset()

    def reset(self) -> None:
        self._queued = []

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        groups: dict[int, list[tuple[int, str, tuple, dict]]] = {}
        for i, (name, args, kwargs) in enumerate(self._queued):
            if name in _ALL_KEYS and len(args) > 1:
                for key in args:
                    groups.setdefault(self.client.keyslot(key), []).append((i, name, (key,), kwargs))
            else:
                groups.setdefault(self.client.keyslot(args[0]), []).append((i, name, args, kwargs))
        replies: list[Any] = [None] * len(self._queued)
        split = {i for i, (name, args, _) in enumerate(self._queued) if name in _ALL_KEYS and len(args) > 1}
        for i in split:
            replies[i] = 0
        try:
            for group in groups.values():  # dicts keep insertion order: first queued, first run
                pipe = self.client.pipeline(transaction=True)
                for _, name, args, kwargs in group:
                    getattr(pipe, name)(*args, **kwargs)
                for (i, *_), reply in zip(group, pipe.execute(raise_on_error=raise_on_error)):
                    if i in split:
                        replies[i] += reply if isinstance(reply, int) else 0
                    else:
                        replies[i] = reply
        finally:
            self.reset()
        return replies
