"""A local Redis Cluster for tests: 3 masters and 3 replicas on free loopback ports.

Built from the same redis-server binary the other tests use (``find_redis_server``), each node with
``cluster-enabled yes``, its own ``cluster-config-file`` and AOF (``appendonly yes``), in its own
folder. The cluster is made by commands through redis-py (CLUSTER ADDSLOTS, MEET, REPLICATE), not by
``redis-cli --cluster create``, so it needs nothing beside the server binary.
"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import redis

from gateway.ledger.embedded import find_redis_server, free_port

SLOTS = 16384


class LocalCluster:
    """``masters`` masters with ``replicas`` replicas each; ``start()`` waits for cluster_state:ok."""

    def __init__(self, base_dir: Path, masters: int = 3, replicas: int = 1) -> None:
        self.base_dir = Path(base_dir)
        self.masters = masters
        self.replicas = replicas
        self.ports: list[int] = []
        self.procs: dict[int, subprocess.Popen] = {}

    @property
    def url(self) -> str:
        """Every node as a startup node: a process starting while one is down (killed in a failover
        test) still joins."""
        return f"redis+cluster://{','.join(f'127.0.0.1:{port}' for port in self.ports)}/0"

    @property
    def master_ports(self) -> list[int]:
        return self.ports[:self.masters]

    def node(self, port: int) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=port, decode_responses=True, socket_timeout=10)

    def _spawn(self, port: int) -> None:
        folder = self.base_dir / f"node-{port}"
        folder.mkdir(parents=True, exist_ok=True)
        args = [find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--dir", str(folder),
                "--cluster-enabled", "yes", "--cluster-config-file", f"nodes-{port}.conf",
                "--cluster-node-timeout", "2000", "--appendonly", "yes", "--appendfsync", "everysec",
                "--save", "", "--daemonize", "no", "--logfile", "redis.log", "--protected-mode", "yes"]
        self.procs[port] = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                            start_new_session=True, env={"LC_ALL": "C"})

    def _wait(self, check, what: str, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if check():
                    return
            except redis.RedisError:
                pass
            for port, proc in self.procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server on {port} exited with {proc.returncode}; see "
                                       f"{self.base_dir / f'node-{port}' / 'redis.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"local cluster: {what} not reached in {timeout_s}s")
            time.sleep(0.05)

    def start(self, timeout_s: float = 30.0) -> LocalCluster:
        try:
            return self._start(timeout_s)
        except BaseException:
            self.stop()
            raise

    def _start(self, timeout_s: float) -> LocalCluster:
        count = self.masters * (1 + self.replicas)
        while len(self.ports) < count:
            port = free_port()
            # the cluster bus listens on port + 10000: both must be free
            if port + 10000 < 65536 and port not in self.ports:
                self.ports.append(port)
        for port in self.ports:
            self._spawn(port)
        nodes = {port: self.node(port) for port in self.ports}
        self._wait(lambda: all(n.ping() for n in nodes.values()), "every node answering", timeout_s)
        per = SLOTS // self.masters
        for i, port in enumerate(self.master_ports):
            first, last = i * per, (SLOTS - 1 if i == self.masters - 1 else (i + 1) * per - 1)
            for start in range(first, last + 1, 1000):
                nodes[port].execute_command("CLUSTER ADDSLOTS", *range(start, min(start + 1000, last + 1)))
        for port in self.ports[1:]:
            nodes[port].execute_command("CLUSTER MEET", "127.0.0.1", self.ports[0])
        ids = {port: nodes[port].execute_command("CLUSTER MYID") for port in self.ports}

        def known_by_all() -> bool:
            return all(len(_node_lines(n)) == count for n in nodes.values())

        self._wait(known_by_all, "every node knowing every other", timeout_s)
        for j, port in enumerate(self.ports[self.masters:]):
            master = self.master_ports[j % self.masters]
            self._wait(lambda p=port, m=master: _replicate(nodes[p], ids[m]), f"{port} replicating",
                       timeout_s)

        def ok() -> bool:
            for n in nodes.values():
                if n.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                    return False
            for port in self.ports[self.masters:]:
                if nodes[port].info("replication").get("master_link_status") != "up":
                    return False
            # every node's slot map names each master's replica (what a cluster client reads)
            return all(len(ranges) == self.masters and all(len(r) == 3 + self.replicas for r in ranges)
                       for ranges in map(_slot_map, nodes.values()))

        self._wait(ok, "cluster_state:ok with every replica linked", timeout_s)
        for n in nodes.values():
            n.close()
        return self

    def kill(self, port: int) -> None:
        """SIGKILL one node (a crash: what it had not replicated is gone with it)."""
        self.procs[port].kill()
        self.procs[port].wait()

    def restart(self, port: int) -> None:
        """Start a killed node again on its port and folder: it rejoins (as a replica if it was failed
        over) from its nodes.conf and AOF."""
        self._spawn(port)

    def client(self):
        from redis.cluster import RedisCluster

        return RedisCluster(host="127.0.0.1", port=self.ports[0], decode_responses=True)

    def live_masters(self) -> list[int]:
        """The ports of the masters now (after a failover, not ``master_ports``)."""
        for port, proc in self.procs.items():
            if proc.poll() is None:
                with self.node(port) as n:
                    try:
                        return sorted({int(r[2][1]) for r in _slot_map(n)})
                    except redis.RedisError:
                        continue
        raise RuntimeError("local cluster: no node answers")

    def flushall(self) -> None:
        for port in self.live_masters():
            with self.node(port) as n:
                n.flushall()

    def wait_replicated(self, timeout_s: float = 60.0) -> None:
        """Until every node agrees on cluster_state:ok and each master has a linked replica again
        (after a failover and the old master's restart)."""
        def ok() -> bool:
            masters = self.live_masters()
            for port, proc in self.procs.items():
                if proc.poll() is None:
                    with self.node(port) as n:
                        if n.execute_command("CLUSTER INFO").get("cluster_state") != "ok":
                            return False
            for port in masters:
                with self.node(port) as n:
                    if int(n.info("replication").get("connected_slaves", 0)) < self.replicas:
                        return False
            return True

        self._wait(ok, "the cluster healed", timeout_s)

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs.values():
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _node_lines(client: redis.Redis) -> list[str]:
    return list(client.execute_command("CLUSTER NODES"))  # redis-py parses it: address -> node


def _replicate(client: redis.Redis, master_id: str) -> bool:
    try:
        client.execute_command("CLUSTER REPLICATE", master_id)
        return True
    except redis.ResponseError:  # "Unknown node" until the gossip reached it
        return False


def _slot_map(client: redis.Redis) -> dict:
    return client.execute_command("CLUSTER SLOTS")  # [first, last, master, replica...] per range
