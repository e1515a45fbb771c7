"""Every Redis client batchgate makes has connect and read timeouts: a half-open connection (the peer
stops answering without closing, as after a partition or a failover) is a TimeoutError, not a hang."""

from __future__ import annotations

import socket
import threading
import time

import pytest
import redis

from gateway.ledger.embedded import client_for, queue_client_for
from gateway.settings import Settings


class FreezingProxy:
    """A TCP proxy on 127.0.0.1 to ``port`` that stops forwarding (both ways) once frozen, keeping every
    connection open: what a client sees of a half-open connection."""

    def __init__(self, port: int) -> None:
        self.target = port
        self.frozen = threading.Event()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.sockets: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(("127.0.0.1", self.target))
            self.sockets += [client, upstream]
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        while True:
            try:
                data = src.recv(65536)
            except OSError:
                return
            if not data:
                return
            if self.forwards(src, dst, data):
                dst.sendall(data)

    def forwards(self, src: socket.socket, dst: socket.socket, data: bytes) -> bool:
        return not self.frozen.is_set()  # frozen: swallowed, nothing goes on, nothing is closed

    def close(self) -> None:
        self.listener.close()
        for sock in self.sockets:
            sock.close()


@pytest.fixture
def tcp_redis(tmp_path):
    """A redis-server on a loopback TCP port (the embedded one listens on a unix socket only)."""
    import subprocess

    from gateway.ledger.embedded import find_redis_server, free_port

    port = free_port()
    proc = subprocess.Popen([find_redis_server(), "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--dir", str(tmp_path)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while True:
        try:
            redis.Redis(port=port).ping()
            break
        except redis.ConnectionError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)
    yield port
    proc.terminate()
    proc.wait(10)


def test_a_half_open_connection_is_a_timeout_not_a_hang(tcp_redis):
    proxy = FreezingProxy(tcp_redis)
    try:
        settings = Settings(redis_url=f"redis://127.0.0.1:{proxy.port}/0", redis_read_timeout=0.5)
        client = client_for(settings.redis_url.get_secret_value(), settings)
        client.set("k", "v")
        assert client.get("k") == "v"
        proxy.frozen.set()
        start = time.monotonic()
        with pytest.raises(redis.TimeoutError):
            client.get("k")
        assert time.monotonic() - start < 5
    finally:
        proxy.close()


def test_every_client_has_connect_and_read_timeouts_and_a_health_check(tcp_redis):
    settings = Settings(redis_url=f"redis://127.0.0.1:{tcp_redis}/0")
    ledger = client_for(settings.redis_url.get_secret_value(), settings).connection_pool.connection_kwargs
    assert (ledger["socket_connect_timeout"], ledger["socket_timeout"]) == (5.0, 30.0)
    assert ledger["health_check_interval"] == 30
    queue = queue_client_for(settings).connection_pool.connection_kwargs
    assert queue["socket_connect_timeout"] == 5.0
    assert queue["socket_timeout"] >= 60  # longer than RQ's BLPOP wait (gateway/push/worker.py)
    assert client_for("redis://127.0.0.1:1/0").connection_pool.connection_kwargs["socket_timeout"] == 30.0


def test_cluster_mode_without_a_queue_redis_refuses_to_start_naming_the_setting():
    from gateway.ledger.embedded import ClusterQueueMissing, NoLedgerRedis, connect

    for settings in (Settings(redis_url="redis+cluster://127.0.0.1:1"),
                     Settings(redis_url="redis://127.0.0.1:1", redis_cluster=True)):
        with pytest.raises(NoLedgerRedis, match="BATCHGATE_QUEUE_REDIS_URL"):
            connect(settings)
        with pytest.raises(ClusterQueueMissing, match="BATCHGATE_QUEUE_REDIS_URL"):
            queue_client_for(settings)


class ReplyLosingProxy(FreezingProxy):
    """A proxy that, once armed, forwards the next script call (EVALSHA) but swallows every reply on that
    connection from then on (the connection stays open): the call ran in Redis and its client times out
    waiting for the answer."""

    def __init__(self, port: int) -> None:
        self.armed = threading.Event()
        self.deaf: set[int] = set()  # the client sockets whose replies are swallowed
        super().__init__(port)

    def forwards(self, src: socket.socket, dst: socket.socket, data: bytes) -> bool:
        if src.getpeername()[1] == self.target:  # a reply (upstream -> client)
            return id(dst) not in self.deaf
        if self.armed.is_set() and b"EVALSHA" in data.upper():
            self.armed.clear()
            self.deaf.add(id(src))
        return True


def test_a_commit_whose_reply_is_lost_is_sent_again_and_answered_once(tcp_redis, tmp_path):
    """The read timeout after a complete that did commit: the ledger sends the call again with its
    journal key, gets the first answer (committed, not a 409 and not a duplicate), and the batch is
    committed once: one stage_completed, one done batch."""
    from gateway.ledger.flows import FlowRegistry, parse_flow
    from gateway.ledger.jobs import JobRequest, JobService
    from gateway.ledger.ledger import Ledger

    proxy = ReplyLosingProxy(tcp_redis)
    try:
        settings = Settings(redis_url=f"redis://127.0.0.1:{proxy.port}/0", redis_read_timeout=0.5,
                            data_dir=tmp_path)
        client = client_for(settings.redis_url.get_secret_value(), settings)
        ledger = Ledger(client, settings)
        service = JobService(ledger, FlowRegistry(client, ledger.keys))
        service.flows.register("acme", parse_flow({"id": "f", "version": "1", "batching": {"max_items": 2},
                                                   "stages": [{"name": "s"}],
                                                   "source": {"type": "sequence", "count": 4}}))
        job_id = service.create("acme", JobRequest(flow_id="f"))["job_id"]
        warm = ledger.lease(job_id)  # Redis has every script of a step loaded from here on
        ledger.complete(job_id, warm.seq, warm.lease_token, {"ok": True})
        lease = ledger.lease(job_id)
        proxy.armed.set()
        started = time.monotonic()
        done = ledger.complete(job_id, lease.seq, lease.lease_token, {"ok": True})
        assert time.monotonic() - started >= 0.5  # it did wait out a read timeout
        assert done["status"] == "committed" and done["duplicate"] is False and not proxy.armed.is_set()
        log = client.xrange(ledger.keys.job(job_id).log)
        completed = [e for _, e in log if e.get("event") == "stage_completed"]
        assert [e["seq"] for e in completed] == [str(warm.seq), str(lease.seq)]
        assert ledger.job_fields(job_id)["n_done"] == "2"
    finally:
        proxy.close()
