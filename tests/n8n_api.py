"""n8n's public API as the real-n8n tests call it (tests/test_n8n_*_real.py)."""

from __future__ import annotations

import time

import requests


def public_api(session: requests.Session, base: str, method: str, path: str, **kwargs) -> requests.Response:
    """A call of the public API of the n8n at ``base``. Right after a start n8n registers the API's routes
    one by one (seen: GET /credentials or GET /workflows answering while the POST was still Express's 404
    "Cannot POST"), so such a 404 is asked again for a while."""
    deadline = time.monotonic() + 60
    while True:
        resp = session.request(method, f"{base}/api/v1{path}", timeout=30, **kwargs)
        if not (resp.status_code == 404 and "<pre>Cannot " in resp.text) or time.monotonic() > deadline:
            return resp
        time.sleep(0.5)
