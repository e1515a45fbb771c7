"""Child processes of the all-in-one command: the API under gunicorn, the supervisor, the worker."""

from __future__ import annotations

import ctypes
import hashlib
import hmac
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import requests

from gateway.ledger.embedded import STATE_FILE, DataDirInUse, EmbeddedRedis, recorded_url
from gateway.settings import CREDENTIAL_FIELDS, DEV_TOKEN_FILE, Settings, write_config_file

TOKEN_FILE = DEV_TOKEN_FILE
CONFIG_FILE_PREFIX = "child-config-"  # + keyed hash of the content + .json, in the data dir
INSTANCE_ENV = "BATCHGATE_INSTANCE_ID"  # /healthz echoes it: `up` knows its own API answered


def dev_token(data_dir: Path) -> str:
    """The all-in-one's bearer token: read from ``data_dir``, created (mode 0600) on first use."""
    path = Path(data_dir) / TOKEN_FILE
    if path.exists():
        return path.read_text().strip()
    path.parent.mkdir(parents=True, exist_ok=True)
    token = "bg_" + secrets.token_urlsafe(24)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(token)
    return token


def tokens_or_dev_token(settings: Settings) -> dict[str, str]:
    """``BATCHGATE_TOKENS``, else the development token of tenant ``default`` (created on first use, its
    path printed): ``up`` and a ``serve`` beside it on the same data folder take the same token."""
    if settings.tokens:
        return dict(settings.tokens)
    token = dev_token(settings.data_dir)
    print(f"batchgate: no BATCHGATE_TOKENS set; a development token for tenant 'default' is in "
          f"{(Path(settings.data_dir) / TOKEN_FILE).resolve()}", flush=True)
    return {token: "default"}


#: Environment variables that hold credentials (settings.CREDENTIAL_FIELDS, the CLI's bearer token, a
#: parent's own config file): a child never inherits them, it reads its credentials from its config file.
CREDENTIAL_ENV = frozenset({*(f"BATCHGATE_{name.upper()}" for name in CREDENTIAL_FIELDS),
                            "BATCHGATE_TOKEN", "BATCHGATE_CONFIG_FILE"})


def child_env(settings: Settings, redis_url: str, tokens: dict[str, str]) -> dict[str, str]:
    """Environment for children: the same Redis, the same tokens, the same settings, no credential.

    Anyone who can read a process's environment (``/proc/<pid>/environ`` is readable by every process
    of the same user, ``ps e`` shows it) would read bearer tokens, platform secrets, the signing key and
    a Redis password there. So the credentials (and whatever the parent's own config file held) go to a
    JSON file in the data dir, mode 0600 in a 0700 directory, that the environment only names
    (``BATCHGATE_CONFIG_FILE``); Settings reads it under the environment. The file's name is a keyed
    hash of its content, so concurrent callers with other settings never overwrite each other's file.
    """
    env = {k: v for k, v in os.environ.items() if k.upper() not in CREDENTIAL_ENV}
    values = {**settings.config_file_values(), **settings.credential_values(),
              "redis_url": redis_url, "tokens": dict(tokens),
              "signing_key": settings.signing_secret().decode()}
    content = json.dumps(values, sort_keys=True, separators=(",", ":")).encode()
    name = hmac.new(settings.signing_secret(), content, hashlib.sha256).hexdigest()[:16]
    data_dir = Path(settings.data_dir).resolve()
    path = write_config_file(data_dir, values, f"{CONFIG_FILE_PREFIX}{name}.json")
    env["BATCHGATE_CONFIG_FILE"] = str(path)
    env["BATCHGATE_KEY_PREFIX"] = settings.key_prefix
    env["BATCHGATE_RECOVERY"] = settings.recovery
    env["BATCHGATE_DATA_DIR"] = str(data_dir)
    env[INSTANCE_ENV] = secrets.token_hex(8)
    env.update(safe_path_env(env))
    return env


def python(*args: str) -> list[str]:
    """A command line for this interpreter that never imports from the directory it starts in.

    ``python -m X`` puts the current directory first on ``sys.path``: a ``numbers.py`` (or any module
    name the standard library or batchgate imports) in the folder ``batchgate up`` or ``serve`` was
    started from would run inside every child, which reads every credential. ``-P`` (3.11) leaves that
    entry out and nothing else. ``-I`` was not chosen: it also drops ``PYTHONPATH`` and the user's
    site-packages (``pip install --user``), which an operator may rely on to find batchgate at all.
    """
    return [sys.executable, "-P", *args]


def safe_path_env(env: dict[str, str]) -> dict[str, str]:
    """``PYTHONSAFEPATH=1`` (what ``-P`` sets, inherited by anything a child starts with Python), and
    batchgate's own source folder on ``PYTHONPATH`` when this process found it through the current
    directory only (a checkout run in place, not installed): that folder, named, not whatever the
    current directory is."""
    out = {"PYTHONSAFEPATH": "1"}
    root = str(Path(__file__).resolve().parents[2])
    if not sys.flags.safe_path and root == os.path.realpath(os.getcwd()):
        paths = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        out["PYTHONPATH"] = os.pathsep.join([*paths, root]) if root not in paths else env["PYTHONPATH"]
    return out


#: gateway/runtime/gunicorn_conf.py, loaded by path (``--config <file>``): a ``python:`` module name
#: would be looked up through gunicorn's sys.path, which then starts with the current directory.
GUNICORN_CONF = str(Path(__file__).with_name("gunicorn_conf.py"))


def reserve_port(host: str, port: int) -> list[socket.socket]:
    """Bind ``host:port`` as gunicorn will (SO_REUSEADDR); OSError if something listens there.

    The caller closes the sockets right before starting the API; until then ``free_port()`` (the
    embedded Redis's port) cannot hand out this port.
    """
    held: list[socket.socket] = []
    try:
        for family, kind, proto, _, addr in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                               flags=socket.AI_PASSIVE):
            sock = socket.socket(family, kind, proto)
            held.append(sock)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            sock.bind(addr)
    except OSError:
        for sock in held:
            sock.close()
        raise
    return held


PR_SET_PDEATHSIG = 1
_forking_pid = [0]


def _prctl() -> Callable[..., int] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


def tie_forks_to_this_process() -> bool:
    """Linux: every child this process forks from now on (RQ's scheduler, multiprocessing, a
    ``preexec_fn`` child) gets SIGTERM from the kernel when this process dies, even by SIGKILL; a child
    whose parent died before it could ask exits at once. False elsewhere (nothing is tied there: a
    process manager that stops the whole group or cgroup is needed).

    The kernel sends the signal when the *thread* that forked exits: batchgate forks only from threads
    that live as long as the process (the worker's first poll thread, the main thread).
    """
    prctl = _prctl()
    if prctl is None:
        return False

    def before() -> None:
        _forking_pid[0] = os.getpid()

    def in_child() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != _forking_pid[0]:  # the parent died before prctl: nobody would stop this child
            os._exit(1)

    os.register_at_fork(before=before, after_in_child=in_child)
    return True


def die_with_parent() -> Callable[[], None] | None:
    """Linux: a ``preexec_fn`` after which the kernel SIGTERMs the child when this process dies,
    even by SIGKILL (children run in their own sessions, so nothing else would stop them).

    Only for a single-threaded parent (``batchgate up``): the signal follows the forking thread.
    None elsewhere.
    """
    prctl = _prctl()  # looked up here, not in the forked child
    if prctl is None:
        return None
    parent = os.getpid()

    def preexec() -> None:
        prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0)
        if os.getppid() != parent:  # the parent died before prctl: nobody would stop this child
            os._exit(1)

    return preexec


def _spawn(args: list[str], env: dict[str, str], tied: bool) -> subprocess.Popen:
    return subprocess.Popen(args, env=env, start_new_session=True,
                            preexec_fn=die_with_parent() if tied else None)


def start_api(env: dict[str, str], host: str, port: int, workers: int = 2,
              tied: bool = False) -> subprocess.Popen:
    """gunicorn serving the app factory, as the Dockerfile does (``tied``: see die_with_parent)."""
    args = [*python("-m", "gunicorn"), "--config", GUNICORN_CONF,
            "--bind", f"{host}:{port}", "--workers", str(workers),
            "--threads", "4", "--log-level", "warning", "--graceful-timeout", "5",
            "gateway.app:create_app()"]
    return _spawn(args, env, tied)


def start_supervisor(env: dict[str, str], tied: bool = False) -> subprocess.Popen:
    return _spawn(python("-m", "gateway.runtime.cli", "supervisor"), env, tied)


#: Stage calls the worker ``batchgate up`` starts runs at once (they wait on platforms: I/O bound).
UP_WORKER_CONCURRENCY = 64


def start_worker(env: dict[str, str], tied: bool = False, concurrency: int | None = None) -> subprocess.Popen:
    """``batchgate worker``: RQ worker threads for push-mode stages (``--concurrency`` if given, else
    BATCHGATE_WORKER_CONCURRENCY from ``env``)."""
    extra = ["--concurrency", str(concurrency)] if concurrency else []
    return _spawn(python("-m", "gateway.runtime.cli", "worker", *extra), env, tied)


def wait_healthy(base_url: str, timeout_s: float = 20.0, *, instance_id: str | None = None,
                 proc: subprocess.Popen | None = None, cancel: threading.Event | None = None) -> None:
    """Block until GET /healthz answers 200 (from the API started with ``instance_id``, if given).

    RuntimeError if ``proc`` (the API) exits first, another server answers, or time runs out;
    returns early once ``cancel`` is set.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cancel is not None and cancel.is_set():
            return
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"the batchgate API exited with code {proc.returncode} before it "
                               f"answered at {base_url}")
        try:
            resp = requests.get(f"{base_url}/healthz", timeout=1)
        except requests.RequestException:
            resp = None
        if resp is not None and resp.status_code == 200:
            if instance_id is None:
                return
            try:
                answered = resp.json().get("instance")
            except (ValueError, AttributeError):
                answered = None
            if answered == instance_id:
                return
            raise RuntimeError(f"another server answers at {base_url} (not the API this batchgate "
                               f"started); choose another port")
        time.sleep(0.1)
    raise RuntimeError(f"batchgate API at {base_url} did not become healthy")


def _signal_group(proc: subprocess.Popen, sig: int) -> None:
    try:  # the group outlives its leader while members remain (gunicorn workers, RQ's work horse)
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(children: Iterable[subprocess.Popen | None], timeout_s: float = 10.0) -> None:
    """SIGTERM every child's process group at once, wait, SIGKILL the groups that linger."""
    children = [p for p in children if p is not None]
    for proc in children:
        _signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in children:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal_group(proc, signal.SIGKILL)
            proc.wait()


def stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    stop_all([proc], timeout_s)


def start_embedded(settings: Settings) -> EmbeddedRedis:
    """``batchgate up`` only: lock the data folder, start its redis-server (the caller stops it).

    The server is tied to the calling process: it gets SIGTERM (and fsyncs) if the caller dies.
    """
    embedded = EmbeddedRedis(settings.data_dir, fsync=settings.embedded_fsync,
                             preexec_fn=die_with_parent())
    embedded.lock()
    try:
        leftover = recorded_url(embedded.data_dir)
        if leftover is not None:  # not ours, and no `up` holds the lock: an orphan of a killed `up`
            pid = json.loads((embedded.data_dir / STATE_FILE).read_text()).get("pid")
            raise DataDirInUse(f"a redis-server (pid {pid}, {leftover}) left by an earlier "
                               f"`batchgate up` still serves data dir {embedded.data_dir}; stop it "
                               f"(kill {pid}) and start `batchgate up` again")
        embedded.start()
    except BaseException:
        embedded.stop()
        raise
    return embedded
