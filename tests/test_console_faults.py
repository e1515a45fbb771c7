"""The console when Redis goes away: a 503 page while it is down (never a 500), the same session after
it comes back with its data, and a request to sign in again when it came back without it."""

from __future__ import annotations

import re
import shutil

import pytest
import requests

from gateway.ledger.embedded import EmbeddedRedis, client_for
from gateway.settings import Settings
from tests.conftest import TOKEN


@pytest.fixture
def own_redis(tmp_path):
    """A Redis this test may kill and restart (the session fixture's is shared)."""
    server = EmbeddedRedis(tmp_path / "redis")
    url = server.start()
    yield server, url
    server.stop()


def test_a_session_survives_a_redis_restart_and_a_lost_dataset_asks_to_sign_in(own_redis, tmp_path):
    from gateway.api.app import create_app
    from tests.http import serve_app

    server, url = own_redis
    client = client_for(url)
    settings = Settings(redis_url=url, data_dir=tmp_path / "data", tokens={TOKEN: "acme"})
    base, stop = serve_app(create_app(settings, client))
    try:
        http = requests.Session()
        assert http.post(f"{base}/console/sign-in", data={"token": TOKEN}, timeout=10).status_code == 200
        page = http.get(f"{base}/console/jobs", timeout=10)
        csrf = re.search(r'name="csrf" value="([^"]+)"', page.text).group(1)

        server.kill()  # a crash: the session was written to the AOF before the answer
        for method, path, data in (("GET", "/console/jobs", None), ("GET", "/console/sign-in", None),
                                   ("POST", "/console/sign-out", {"csrf": csrf})):
            resp = http.request(method, f"{base}{path}", data=data, timeout=10, allow_redirects=False)
            assert resp.status_code == 503, (path, resp.status_code, resp.text[:300])
            assert "text/html" in resp.headers["Content-Type"] and resp.headers["Retry-After"] == "2"
            assert "cannot be reached" in resp.text

        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        resp = http.get(f"{base}/console/jobs", timeout=10, allow_redirects=False)
        assert resp.status_code == 200 and "tenant <strong>acme</strong>" in resp.text  # still signed in

        server.stop()  # back without its data (a new, empty Redis): the session is gone
        shutil.rmtree(tmp_path / "redis")
        server = EmbeddedRedis(tmp_path / "redis")
        assert server.start() == url
        resp = http.get(f"{base}/console/jobs", timeout=10, allow_redirects=False)
        assert resp.status_code == 303 and "/console/sign-in" in resp.headers["Location"]
        resp = http.get(f"{base}/console/jobs", timeout=10)
        assert resp.status_code == 200 and 'id="token"' in resp.text
    finally:
        stop()
        server.stop()
