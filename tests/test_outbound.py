"""The outbound guard on real connections: sources, targets, redirects, DNS rebinding, TLS names.

Every server here listens on 127.0.0.1 and is started by the test. Refusals of other addresses are shown by
the guard's decision (tests/test_urlguard.py) or by host names a patched resolver maps to 127.0.0.1: no
packet leaves the machine.
"""

from __future__ import annotations

import json
import shutil
import socket
import ssl
import subprocess
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
import requests
from pydantic import SecretStr

from gateway.net import urlguard
from gateway.push.dispatch import Dispatcher
from gateway.ledger.ledger import Ledger
from gateway.net.outbound import MAX_REDIRECTS, RefusedURL, guarded_session
from gateway.net.urlguard import Allowlist

MARKER = "BODY-MARKER-7c1e"  # in every body a refused server would serve; must reach no response
SECRET = "hook-secret-4f9a2b"
LOOPBACK = Allowlist.parse(["127.0.0.1/32"])


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


Reply = tuple[int, dict[str, str], bytes]


@dataclass
class Recorder:
    """A threaded HTTP(S) server on 127.0.0.1 that logs every request and answers with ``respond``."""

    respond: Callable[[Seen, int], Reply]
    tls: ssl.SSLContext | None = None
    log: list[Seen] = field(default_factory=list)

    def __post_init__(self) -> None:
        recorder = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_one(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                seen = Seen(self.command, self.path, {k.lower(): v for k, v in self.headers.items()},
                            self.rfile.read(length) if length else b"")
                recorder.log.append(seen)
                status, headers, body = recorder.respond(seen, len(recorder.log))
                self.send_response(status)
                for name, value in {"Content-Length": str(len(body)), **headers}.items():
                    self.send_header(name, value)
                self.end_headers()
                self.wfile.write(body)

            do_GET = do_POST = do_PUT = do_HEAD = handle_one

            def log_message(self, *args: Any) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        if self.tls is not None:
            self.httpd.socket = self.tls.wrap_socket(self.httpd.socket, server_side=True)
        self.port = self.httpd.server_address[1]
        self.thread = threading.Thread(target=self.httpd.serve_forever, args=(0.02,), daemon=True)
        self.thread.start()

    def url(self, host: str = "127.0.0.1", scheme: str = "http") -> str:
        return f"{scheme}://{host}:{self.port}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers: list[Recorder] = []

    def start(respond: Callable[[Seen, int], Reply] | Reply, tls: ssl.SSLContext | None = None) -> Recorder:
        fn = respond if callable(respond) else (lambda seen, n: respond)
        servers.append(Recorder(fn, tls))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


class Resolver:
    """Answers for chosen names (each call takes the next answer; the last one repeats), counting calls."""

    def __init__(self, real: Callable[..., Any]) -> None:
        self.real = real
        self.answers: dict[str, list[list[str]]] = {}
        self.calls: Counter[str] = Counter()

    def map(self, name: str, *answers: str | list[str]) -> None:
        self.answers[name] = [[a] if isinstance(a, str) else list(a) for a in answers]

    def __call__(self, host: Any, port: Any, family: int = 0, type: int = 0, proto: int = 0,
                 flags: int = 0) -> list[tuple]:
        name = str(host).lower()
        if name not in self.answers:
            return self.real(host, port, family, type, proto, flags)
        self.calls[name] += 1
        queue = self.answers[name]
        ips = queue.pop(0) if len(queue) > 1 else queue[0]
        return [(socket.AF_INET6 if ":" in ip else socket.AF_INET, socket.SOCK_STREAM, 6, "",
                 (ip, int(port), 0, 0) if ":" in ip else (ip, int(port))) for ip in ips]


@pytest.fixture
def resolver(monkeypatch):
    fake = Resolver(socket.getaddrinfo)
    monkeypatch.setattr(urlguard.socket, "getaddrinfo", fake)
    return fake


def redirect(location: str, status: int = 307) -> Reply:
    return status, {"Location": location}, b""


def ok(body: str = "ok", content_type: str = "text/plain") -> Reply:
    return 200, {"Content-Type": content_type}, body.encode()


# -- the session ------------------------------------------------------------------------------------------

@pytest.mark.parametrize("host", ["127.0.0.1", "2130706433", "0x7f000001", "0177.0.0.1", "127.1",
                                  "localhost"])
def test_a_loopback_server_is_never_contacted(serve, host):
    server = serve(ok(MARKER))
    with pytest.raises(RefusedURL) as err:
        guarded_session().get(server.url(host), timeout=5)
    assert "loopback" in err.value.refusal
    assert server.log == []


def test_an_allowed_network_is_reached(serve):
    server = serve(ok(MARKER))
    assert guarded_session(LOOPBACK).get(server.url() + "/x", timeout=5).text == MARKER
    assert [s.path for s in server.log] == ["/x"]


@pytest.mark.parametrize("status", [301, 302, 303, 307, 308])
@pytest.mark.parametrize("refused_host", ["127.0.0.1", "localhost", "2130706433"])
def test_an_allowed_host_redirecting_to_a_refused_one_is_not_followed(serve, resolver, status, refused_host):
    target = serve(ok(MARKER))
    start = serve(redirect(target.url(refused_host) + "/secret", status))
    resolver.map("allowed.test", "127.0.0.1")
    session = guarded_session(Allowlist.parse(["allowed.test"]))
    with pytest.raises(RefusedURL) as err:
        session.get(start.url("allowed.test") + "/start", timeout=5)
    assert "loopback" in err.value.refusal
    assert len(start.log) == 1 and target.log == []


def test_a_redirect_to_another_origin_drops_every_credential(serve):
    second = serve(ok("done"))
    first = serve(redirect(second.url() + "/next"))
    headers = {"Authorization": "Bearer " + SECRET, "X-N8N-API-KEY": SECRET, "X-Hook-Key": SECRET,
               "Cookie": f"s={SECRET}", "Batchgate-Signature": "t=1,v1=abc", "Idempotency-Key": "j:0:s",
               "Content-Type": "application/json"}
    resp = guarded_session(LOOPBACK).post(first.url() + "/hook", data=b'{"items": [1]}', headers=headers,
                                          timeout=5)
    assert resp.text == "done" and len(resp.history) == 1
    assert first.log[0].headers["x-hook-key"] == SECRET
    hop = second.log[0]
    assert (hop.method, hop.path, hop.body) == ("POST", "/next", b'{"items": [1]}')  # 307 keeps the body
    assert hop.headers["content-type"] == "application/json"
    for name in ("authorization", "x-n8n-api-key", "x-hook-key", "cookie", "batchgate-signature",
                 "idempotency-key"):
        assert name not in hop.headers
    assert SECRET not in json.dumps(hop.headers)


def test_a_redirect_within_the_origin_keeps_the_headers(serve):
    server = serve(lambda seen, n: redirect("/b") if seen.path == "/a" else ok("b"))
    resp = guarded_session(LOOPBACK).get(server.url() + "/a", headers={"X-Hook-Key": SECRET}, timeout=5)
    assert resp.text == "b"
    assert [s.headers.get("x-hook-key") for s in server.log] == [SECRET, SECRET]


def test_a_303_continues_as_a_get_without_the_body(serve):
    second = serve(ok("done"))
    first = serve(redirect(second.url() + "/result", 303))
    guarded_session(LOOPBACK).post(first.url(), data=b"payload", timeout=5)
    assert (second.log[0].method, second.log[0].body) == ("GET", b"")


def test_at_most_five_redirects_are_followed(serve):
    def hops(limit: int) -> Callable[[Seen, int], Reply]:
        return lambda seen, n: (redirect(f"/{int(seen.path[1:]) + 1}")
                                if int(seen.path[1:]) < limit else ok("end"))

    five = serve(hops(MAX_REDIRECTS))
    assert guarded_session(LOOPBACK).get(five.url() + "/0", timeout=5).text == "end"
    assert len(five.log) == 1 + MAX_REDIRECTS
    endless = serve(hops(10**6))
    with pytest.raises(requests.TooManyRedirects):
        guarded_session(LOOPBACK).get(endless.url() + "/0", timeout=5)
    assert len(endless.log) == 1 + MAX_REDIRECTS


def test_the_address_checked_is_the_address_connected_to(serve, resolver):
    """DNS rebinding: the name answers an admitted address once, then a refused one. The connection goes
    to the address that was checked; the host is looked up once per connection, never again."""
    server = serve(ok(MARKER))
    resolver.map("rebind.test", "127.0.0.1", "127.0.0.2")
    session = guarded_session(LOOPBACK)
    resp = session.get(server.url("rebind.test") + "/a", timeout=5)
    assert resp.text == MARKER and resolver.calls["rebind.test"] == 1
    assert server.log[0].headers["host"] == f"rebind.test:{server.port}"  # Host is the URL's host
    # a new connection resolves again and checks what it gets: now a refused address, not contacted
    with pytest.raises(RefusedURL, match="127.0.0.2"):
        guarded_session(LOOPBACK).get(server.url("rebind.test") + "/b", timeout=5)
    assert resolver.calls["rebind.test"] == 2 and [s.path for s in server.log] == ["/a"]


def test_a_name_answering_a_refused_address_among_admitted_ones_is_refused(serve, resolver):
    server = serve(ok(MARKER))
    resolver.map("mixed.test", ["127.0.0.1", "10.0.0.1"])
    with pytest.raises(RefusedURL, match="10.0.0.1, a private address"):
        guarded_session(LOOPBACK).get(server.url("mixed.test"), timeout=5)
    assert server.log == []


def test_proxies_from_the_environment_are_not_used(serve, monkeypatch):
    proxy = serve(ok("from the proxy"))
    server = serve(ok("direct"))
    monkeypatch.setenv("HTTP_PROXY", proxy.url())
    monkeypatch.setenv("http_proxy", proxy.url())
    assert guarded_session(LOOPBACK).get(server.url(), timeout=5).text == "direct"
    assert proxy.log == []


@pytest.fixture(scope="module")
def certificate(tmp_path_factory):
    """A self-signed certificate for allowed.test (the only name it is valid for)."""
    if shutil.which("openssl") is None:
        pytest.skip("openssl is not installed")
    folder = tmp_path_factory.mktemp("tls")
    cert, key = folder / "cert.pem", folder / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out",
                    str(cert), "-days", "1", "-subj", "/CN=allowed.test", "-addext",
                    "subjectAltName=DNS:allowed.test"], check=True, capture_output=True)
    return cert, key


def test_tls_keeps_the_url_host_as_server_name_while_connecting_to_the_checked_address(
        serve, resolver, certificate):
    cert, key = certificate
    names: list[str | None] = []
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    context.sni_callback = lambda sock, name, ctx: names.append(name)
    server = serve(ok(MARKER), tls=context)
    resolver.map("allowed.test", "127.0.0.1")
    resolver.map("other.test", "127.0.0.1")
    session = guarded_session(LOOPBACK)
    assert session.get(server.url("allowed.test", "https"), verify=str(cert), timeout=5).text == MARKER
    assert names == ["allowed.test"] and server.log[0].headers["host"] == f"allowed.test:{server.port}"
    with pytest.raises(requests.exceptions.SSLError):  # the certificate is checked against the URL's host
        session.get(server.url("other.test", "https"), verify=str(cert), timeout=5)
    assert len(server.log) == 1


# -- sources through the API ------------------------------------------------------------------------------

SOURCE_BODIES = {
    "http_json": (json.dumps({"data": [{"secret": MARKER}]}), "application/json"),
    "jsonl": (json.dumps({"secret": MARKER}) + "\n", "application/x-ndjson"),
    "csv": (f"secret\n{MARKER}\n", "text/csv"),
}


def source_server(serve, kind: str) -> Recorder:
    body, content_type = SOURCE_BODIES[kind]
    return serve(ok(body, content_type))


def register(api, flow_id: str = "src", source: dict | None = None) -> None:
    flow = {"id": flow_id, "version": "1", "stages": [{"name": "s"}], "batching": {"max_items": 5}}
    if source is not None:
        flow["source"] = source
    resp = api.post("/v1/flows", json=flow)
    assert resp.status_code == 201, resp.text


def assert_no_marker(*responses: requests.Response) -> None:
    for resp in responses:
        assert MARKER not in resp.text


@pytest.mark.parametrize("kind", ["http_json", "jsonl", "csv"])
@pytest.mark.parametrize("host", ["127.0.0.1", "2130706433", "127.1"])
def test_a_job_source_on_loopback_is_refused_and_never_read(api, serve, kind, host):
    server = source_server(serve, kind)
    register(api)
    created = api.post("/v1/jobs", json={"flow_id": "src", "source": {"type": kind, "url": server.url(host)}})
    assert created.status_code == 422, created.text
    assert "refused" in created.json()["detail"] and "loopback" in created.json()["detail"]
    jobs = api.get("/v1/jobs")
    assert jobs.json() == {"jobs": []}
    assert server.log == []
    assert_no_marker(created, jobs)


def test_a_flow_source_on_loopback_is_refused_when_the_job_is_created(api, serve):
    server = source_server(serve, "http_json")
    register(api, "flowsrc", {"type": "http_json", "url": server.url() + "/items"})
    created = api.post("/v1/jobs", json={"flow_id": "flowsrc"})
    assert created.status_code == 422 and server.log == []
    assert_no_marker(created)


@pytest.fixture
def api_allowing(settings, redis_client):
    """The gateway on a real socket with ``outbound_allow`` set; returns (ApiClient, settings)."""
    from gateway.api.app import create_app
    from tests.conftest import TOKEN
    from tests.http import ApiClient, serve_app

    stops = []

    def start(entries: list[str]):
        own = settings.model_copy(update={"outbound_allow": entries})
        base, stop = serve_app(create_app(own, redis_client))
        stops.append(stop)
        return ApiClient(base, TOKEN), own

    yield start
    for stop in stops:
        stop()


@pytest.mark.parametrize("kind", ["http_json", "jsonl", "csv"])
@pytest.mark.parametrize("status", [302, 307])
def test_a_source_on_an_allowed_host_redirecting_to_a_refused_one_is_refused(
        api_allowing, serve, resolver, kind, status):
    api, _ = api_allowing(["allowed.test"])
    refused = source_server(serve, kind)
    start = serve(redirect(refused.url() + "/items", status))
    resolver.map("allowed.test", "127.0.0.1")
    register(api)
    created = api.post("/v1/jobs", json={"flow_id": "src",
                                         "source": {"type": kind, "url": start.url("allowed.test")}})
    assert created.status_code == 422, created.text
    assert "refused" in created.json()["detail"]
    assert len(start.log) == 1 and refused.log == []
    assert_no_marker(created, api.get("/v1/jobs"))


def test_a_source_that_starts_redirecting_later_is_refused_at_lease(api_allowing, serve, resolver):
    """Read at creation, then redirected to a refused host: the lease reads through the same guard."""
    api, _ = api_allowing(["allowed.test"])
    refused = source_server(serve, "jsonl")
    start = serve(lambda seen, n: ok('{"n": 1}\n') if n == 1 else redirect(refused.url() + "/items"))
    resolver.map("allowed.test", "127.0.0.1")
    register(api)
    created = api.post("/v1/jobs", json={"flow_id": "src",
                                         "source": {"type": "jsonl", "url": start.url("allowed.test")}})
    assert created.status_code == 201, created.text
    job_id = created.json()["job_id"]
    lease = api.post(f"/v1/jobs/{job_id}/lease")
    assert lease.status_code == 503, lease.text  # a source error: retried under the policy, then fails
    view = api.get(f"/v1/jobs/{job_id}")
    assert "refused" in (view.json().get("source_error") or "")
    assert len(start.log) == 2 and refused.log == []
    assert_no_marker(lease, view, api.get(f"/v1/jobs/{job_id}/log"))


# -- push targets through the dispatcher --------------------------------------------------------------------

def push_target(url: str) -> dict:
    return {"type": "http", "url": url, "mode": "sync", "auth_secret": "hook_key",
            "auth_header": "X-Hook-Key", "auth_scheme": ""}


def run_first_attempt(settings, redis_client, make_job, allow: list[str], url: str):
    own = settings.model_copy(update={"outbound_allow": allow,
                                      "secrets": {"acme": {"hook_key": SecretStr(SECRET)}}})
    ledger = Ledger(redis_client, own)
    dispatcher = Dispatcher.build(own, ledger)
    job_id = make_job(items=[1, 2, 3], max_items=3, stage_defs=[
        {"name": "process", "retry": {"initial_interval": 0.05, "maximum_attempts": 1},
         "target": push_target(url)}])
    lease = ledger.lease_stages(job_id, [0])
    dispatcher.run_leased(ledger.spec(job_id), lease)
    events = [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log)]
    return ledger.batch_record(job_id, lease.seq), events


def test_a_target_redirect_to_another_origin_does_not_carry_the_secret(settings, redis_client, make_job,
                                                                        serve):
    answer = json.dumps({"status": "succeeded", "output": {"n": 3}})
    second = serve(ok(answer, "application/json"))
    first = serve(redirect(second.url() + "/moved"))
    batch, events = run_first_attempt(settings, redis_client, make_job, ["127.0.0.1/32"],
                                      first.url() + "/hook")
    assert batch["status"] == "completed" and json.loads(batch["out:0"]) == {"n": 3}, (batch, events)
    assert first.log[0].headers["x-hook-key"] == SECRET and "batchgate-signature" in first.log[0].headers
    hop = second.log[0]
    assert hop.method == "POST" and json.loads(hop.body)["items"] == [1, 2, 3]
    assert "x-hook-key" not in hop.headers and "batchgate-signature" not in hop.headers
    assert SECRET not in json.dumps(hop.headers)


def test_a_target_redirect_to_a_refused_host_is_a_fatal_error(settings, redis_client, make_job, serve,
                                                              resolver):
    refused = serve(ok(json.dumps({"status": "succeeded", "output": MARKER}), "application/json"))
    first = serve(redirect(refused.url() + "/internal"))
    resolver.map("allowed.test", "127.0.0.1")
    batch, events = run_first_attempt(settings, redis_client, make_job, ["allowed.test"],
                                      first.url("allowed.test") + "/hook")
    assert len(first.log) == 1 and refused.log == []
    errors = [e for e in events if e.get("event") == "platform_error"]
    assert errors and errors[0]["retry"] == "fatal" and "refused" in errors[0]["error"]
    assert batch["status"] == "failed"


def test_a_target_redirecting_forever_stops_after_five_hops(settings, redis_client, make_job, serve):
    endless = serve(lambda seen, n: redirect(f"/hop{n}"))
    batch, events = run_first_attempt(settings, redis_client, make_job, ["127.0.0.1/32"],
                                      endless.url() + "/hook")
    assert len(endless.log) == 1 + MAX_REDIRECTS
    errors = [e for e in events if e.get("event") == "platform_error"]
    assert errors and errors[0]["retry"] == "fatal" and "TooManyRedirects" in errors[0]["error"]
