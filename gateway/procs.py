"""Child processes of the all-in-one command: the API under gunicorn and the supervisor."""

from __future__ import annotations

import json
import os
import secrets
import signal
import subprocess
import sys
import time
from pathlib import Path

import requests

from gateway.settings import Settings

TOKEN_FILE = "dev-token"


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


def child_env(settings: Settings, redis_url: str, tokens: dict[str, str]) -> dict[str, str]:
    """Environment for children: the same Redis, the same tokens, the same settings."""
    env = dict(os.environ)
    env["BATCHGATE_REDIS_URL"] = redis_url
    env["BATCHGATE_TOKENS"] = json.dumps(tokens)
    env["BATCHGATE_KEY_PREFIX"] = settings.key_prefix
    env["BATCHGATE_RECOVERY"] = settings.recovery
    env["BATCHGATE_SIGNING_KEY"] = settings.signing_secret().decode()
    env["BATCHGATE_DATA_DIR"] = str(Path(settings.data_dir).resolve())
    return env


def start_api(env: dict[str, str], host: str, port: int, workers: int = 2) -> subprocess.Popen:
    """gunicorn serving the app factory, as the Dockerfile does."""
    args = [sys.executable, "-m", "gunicorn", "--bind", f"{host}:{port}", "--workers", str(workers),
            "--threads", "4", "--log-level", "warning", "--graceful-timeout", "5",
            "gateway.app:create_app()"]
    return subprocess.Popen(args, env=env, start_new_session=True)


def start_supervisor(env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "supervisor"], env=env,
                            start_new_session=True)


def start_worker(env: dict[str, str]) -> subprocess.Popen:
    """``batchgate worker``: RQ worker for push-mode stages."""
    return subprocess.Popen([sys.executable, "-m", "gateway.cli", "worker"], env=env,
                            start_new_session=True)


def wait_healthy(base_url: str, timeout_s: float = 20.0) -> None:
    """Block until GET /healthz answers 200."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if requests.get(f"{base_url}/healthz", timeout=1).status_code == 200:
                return
        except requests.RequestException:
            pass
        time.sleep(0.1)
    raise RuntimeError(f"batchgate API at {base_url} did not become healthy")


def stop(proc: subprocess.Popen | None, timeout_s: float = 10.0) -> None:
    """SIGTERM the process group, then SIGKILL if it lingers."""
    if proc is None or proc.poll() is not None:
        return
    try:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    except ProcessLookupError:
        pass
