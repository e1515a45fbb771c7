"""A small HTTP client for tests: bearer token set, JSON in and out."""

from __future__ import annotations

import threading
from collections.abc import Callable
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
