"""A small HTTP client for tests: bearer token set, JSON in and out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import requests
from werkzeug.serving import make_server


def serve_app(app: Any) -> tuple[str, Callable[[], None]]:
    """Serve a WSGI app on a free loopback port in a thread; returns (base url, stop)."""
    server = make_server("127.0.0.1", 0, app, threaded=True)
    # serve_forever's default 0.5 s poll would make every shutdown cost half a second
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.02},
                              daemon=True)
    thread.start()

    def stop() -> None:
        server.shutdown()
        thread.join()

    return f"http://127.0.0.1:{server.server_port}", stop


class ApiClient:
    """Calls the gateway over a real socket as a platform's HTTP node would."""

    def __init__(self, base: str, token: str | None) -> None:
        self.base = base
        self.session = requests.Session()
        if token:
            self.session.headers["Authorization"] = f"Bearer {token}"

    def as_token(self, token: str | None) -> ApiClient:
        return ApiClient(self.base, token)

    def request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        return self.session.request(method, self.base + path, timeout=30, **kwargs)

    def get(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("GET", path, **kwargs)

    def post(self, path: str, json: Any = None, **kwargs: Any) -> requests.Response:
        return self.request("POST", path, json=json, **kwargs)

    def delete(self, path: str, **kwargs: Any) -> requests.Response:
        return self.request("DELETE", path, **kwargs)


@contextmanager
def gunicorn_api(redis_url: str, data_dir: Any, tokens: dict[str, str], workers: int = 2,
                 flow: dict | None = None, supervisor: bool = False, **env: str) -> Iterator[str]:
    """``batchgate``'s API under a real gunicorn (``workers`` processes) on ``redis_url``; yields its
    base URL once healthy, with ``flow`` registered (by the first token's tenant) when given; with
    ``supervisor``, a `batchgate supervisor` beside it, so /readyz answers 200."""
    from gateway.ledger.embedded import free_port
    from gateway.runtime import procs
    from gateway.settings import Settings

    child_env = {**procs.child_env(Settings(data_dir=data_dir), redis_url, tokens), **env}
    port = free_port()
    proc = procs.start_api(child_env, "127.0.0.1", port, workers=workers)
    sup = procs.start_supervisor(child_env) if supervisor else None
    base = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(base, proc=proc)
        deadline = time.monotonic() + 30
        while sup is not None and requests.get(f"{base}/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline and sup.poll() is None, "the supervisor never made /readyz ready"
            time.sleep(0.1)
        if flow is not None:
            auth = {"Authorization": f"Bearer {next(iter(tokens))}"}
            assert requests.post(f"{base}/v1/flows", json=flow, headers=auth, timeout=30).status_code == 201
        yield base
    finally:
        procs.stop_all([proc, sup])
