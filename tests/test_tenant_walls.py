"""Tenant walls and bad input at the edge (issue 15, item 8), each seen from outside.

- Tenant names are checked at start (one charset, no ``:``), and a flow id or version that could name a
  key of another tenant (``acme`` + ``x:f`` = ``acme:x`` + ``f``) reaches no key: 404 or 422.
- A chunked body over the limit is a 413, even where the part up to the limit is valid JSON.
- A body holding a callback URL (a bearer credential) is never re-sent to another origin on a redirect.
- A genuine signed token lacking its fields is a 401, not a 500.
- Ids are echoed at most 200 characters.
- Sequence sources stay within signed 64 bits.
- gunicorn's own 414/431/400 answers are problem+json.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pydantic import SecretStr, ValidationError

from gateway.ledger.flows import parse_flow
from gateway.ledger.ledger import Ledger
from gateway.net.outbound import RefusedURL, guarded_session
from gateway.push.dispatch import Dispatcher
from gateway.runtime import procs
from gateway.security import sign
from gateway.settings import Settings
from tests.conftest import TOKEN
from tests.test_outbound import LOOPBACK, ok, redirect, serve  # noqa: F401  (serve: a fixture)

PROBLEM = "application/problem+json"


def assert_problem(resp, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:300])
    assert resp.headers["Content-Type"].split(";")[0] == PROBLEM, resp.headers
    return resp.json()


# -- tenant names and the keys built from them -------------------------------------------------------------

@pytest.mark.parametrize("field,value,bad", [
    ("tokens", {"tok-secret-value-1": "acme:x"}, "acme:x"),
    ("tokens", {"tok-secret-value-1": "a{b}"}, "a{b}"),
    ("tokens", {"tok-secret-value-1": ""}, "''"),
    ("tokens", {"tok-secret-value-1": "x" * 65}, "xxxx"),
    ("secrets", {"acme:x": {"k": "v"}}, "acme:x"),
    ("source_roots", {"acme:x": ["/srv"]}, "acme:x"),
])
def test_a_bad_tenant_name_stops_the_start_naming_the_tenant_not_the_token(field, value, bad, tmp_path):
    with pytest.raises(ValidationError) as err:
        Settings(data_dir=tmp_path, **{field: value})
    text = str(err.value)
    assert "tenant name" in text and bad in text and "letters, digits" in text, text
    assert "tok-secret-value-1" not in text


def test_valid_tenant_names_and_the_shared_star_still_start(tmp_path):
    settings = Settings(data_dir=tmp_path, tokens={"t1": "acme", "t2": "Globex.eu_2", "t3": "default"},
                        secrets={"*": {"k": "v"}, "acme": {"k": "w"}}, source_roots={"*": ["/srv"]})
    assert set(settings.token_map().values()) == {"acme", "Globex.eu_2", "default"}


FLOW = {"id": "f", "version": "1", "stages": [{"name": "s"}], "source": {"type": "sequence", "count": 2}}


def test_a_flow_id_holding_a_colon_reaches_no_key_of_another_tenant(api, registry):
    """Data a tenant named ``acme:x`` stored before names were checked stays out of ``acme``'s reach."""
    registry.register("acme:x", parse_flow(FLOW))  # what tenant 'acme:x' registered (names unchecked then)
    for path in ("/v1/flows/x:f", "/v1/flows/x:f/versions/1"):
        assert_problem(api.get(path), 404)
    assert_problem(api.delete("/v1/flows/x:f/versions/1"), 404)
    assert_problem(api.post("/v1/jobs", json={"flow_id": "x:f"}), 422)
    assert_problem(api.post("/v1/jobs", json={"flow_id": "x", "flow_version": "f:1"}), 422)
    assert registry.get("acme:x", "f", "1")["flow"]["id"] == "f"  # still there, untouched
    assert api.get("/v1/jobs").json() == {"jobs": []}


def test_existing_flows_of_valid_tenants_are_read_under_their_keys(api, registry, redis_client, ledger):
    assert api.post("/v1/flows", json=FLOW).status_code == 201
    assert redis_client.exists(ledger.keys.flow("acme", "f", "1"))  # the key name of every release
    assert api.get("/v1/flows/f").json()["flow"]["id"] == "f"
    assert api.post("/v1/jobs", json={"flow_id": "f"}).status_code == 201


# -- ids echoed at most 200 characters ---------------------------------------------------------------------

@pytest.mark.parametrize("method,path", [
    ("GET", "/v1/jobs/job_{id}"), ("GET", "/v1/jobs/{id}"), ("POST", "/v1/jobs/job_{id}/pause"),
    ("GET", "/v1/flows/{id}"), ("GET", "/v1/flows/f/versions/{id}"), ("DELETE", "/v1/flows/{id}/versions/1"),
])
def test_a_404_echoes_at_most_200_characters_of_an_id(api, method, path):
    resp = api.request(method, path.format(id="a" * 3000))
    detail = assert_problem(resp, 404)["detail"]
    assert "a" * 150 in detail and "a" * 201 not in detail and "\u2026" in detail, detail
    assert len(resp.content) < 1000


# -- signed tokens -----------------------------------------------------------------------------------------

@pytest.mark.parametrize("claims", [{}, {"j": "job_x"}, {"j": "job_x", "s": 0, "st": 0, "a": 1},
                                    {"j": 5, "s": 0, "st": 0, "a": 1, "t": "x"},
                                    {"j": "job_x", "s": "0", "st": 0, "a": 1, "t": "x"}])
def test_a_genuine_callback_token_missing_fields_is_a_401(api, settings, claims):
    token = sign(claims, settings.signing_secret(), "callback", 60)
    resp = api.as_token(None).post(f"/v1/callbacks/{token}", json={"status": "succeeded", "output": {}})
    assert "lacks a valid" in assert_problem(resp, 401)["detail"]


def test_a_genuine_callback_token_naming_a_stage_the_job_lacks_is_a_404(api, settings, make_job):
    job_id = make_job(items=2, max_items=2, stages=("only",))
    token = sign({"j": job_id, "s": 0, "st": 7, "a": 1, "t": "x"}, settings.signing_secret(), "callback", 60)
    resp = api.as_token(None).post(f"/v1/callbacks/{token}", json={"status": "succeeded", "output": {}})
    assert "no stage 7" in assert_problem(resp, 404)["detail"]


def test_a_genuine_blob_token_missing_fields_is_a_401(api, settings):
    token = sign({"s": 0}, settings.signing_secret(), "blob", 60)
    assert_problem(api.as_token(None).get(f"/v1/blobs/{token}"), 401)


# -- chunked bodies ----------------------------------------------------------------------------------------

@pytest.fixture
def small_body_api(settings, redis_client):
    from gateway.api.app import create_app
    from tests.http import ApiClient, serve_app

    base, stop = serve_app(create_app(settings.model_copy(update={"max_body_bytes": 2048}), redis_client))
    yield ApiClient(base, TOKEN)
    stop()


def cut_valid(limit: int) -> bytes:
    """A body whose first ``limit`` bytes are a valid flow, followed by more bytes."""
    head = json.dumps(FLOW)[:-1] + ', "description": "'
    return (head + "d" * (limit - len(head) - 2) + '"}').encode() + b"  " * 4000


def test_a_chunked_body_over_the_limit_is_413_even_when_its_cut_is_valid_json(small_body_api):
    body = cut_valid(2048)
    assert json.loads(body[:2048])["id"] == "f"
    chunks = (body[i:i + 512] for i in range(0, len(body), 512))  # a generator: sent chunked
    resp = small_body_api.post("/v1/flows", data=chunks, headers={"Content-Type": "application/json"})
    assert "2048-byte limit" in assert_problem(resp, 413)["detail"]
    assert small_body_api.get("/v1/flows").json() == {"flows": []}


def test_a_chunked_body_within_the_limit_is_read_whole(small_body_api):
    body = json.dumps(FLOW).encode()
    chunks = (body[i:i + 16] for i in range(0, len(body), 16))
    resp = small_body_api.post("/v1/flows", data=chunks, headers={"Content-Type": "application/json"})
    assert resp.status_code == 201, resp.text


# -- a callback URL never follows a redirect to another origin ---------------------------------------------

def run_callback_attempt(settings, redis_client, make_job, url: str):
    own = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"],
                                      "secrets": {"acme": {"hook_key": SecretStr("hook-secret")}}})
    ledger = Ledger(redis_client, own)
    job_id = make_job(items=[1, 2], max_items=2, stage_defs=[
        {"name": "process", "retry": {"initial_interval": 0.05, "maximum_attempts": 1},
         "target": {"type": "http", "url": url, "mode": "callback", "auth_secret": "hook_key",
                    "auth_header": "X-Hook-Key", "auth_scheme": ""}}])
    lease = ledger.lease_stages(job_id, [0])
    Dispatcher.build(own, ledger).run_leased(ledger.spec(job_id), lease)
    events = [f for _, f in ledger.r.xrange(ledger.keys.job(job_id).log)]
    return ledger.batch_record(job_id, lease.seq), events


@pytest.mark.parametrize("status", [307, 308])
def test_a_callback_target_redirecting_to_another_origin_never_gets_the_callback_url_there(
        settings, redis_client, make_job, serve, status):  # noqa: F811
    elsewhere = serve(ok("accepted"))
    first = serve(redirect(elsewhere.url() + "/collect", status))
    batch, events = run_callback_attempt(settings, redis_client, make_job, first.url() + "/hook")
    assert "callback_url" in json.loads(first.log[0].body)  # the target itself got the envelope
    assert elsewhere.log == []  # nothing, callback URL included, was sent to the other origin
    errors = [e for e in events if e.get("event") == "platform_error"]
    assert errors and errors[0]["retry"] == "fatal" and "another origin" in errors[0]["error"], events
    assert batch["status"] == "failed"


def test_a_same_origin_redirect_of_a_callback_target_is_followed(settings, redis_client, make_job,
                                                                  serve):  # noqa: F811
    server = serve(lambda seen, n: redirect("/moved") if seen.path == "/hook" else ok("accepted"))
    batch, _ = run_callback_attempt(settings, redis_client, make_job, server.url() + "/hook")
    assert [s.path for s in server.log] == ["/hook", "/moved"]
    assert json.loads(server.log[1].body)["callback_url"] == json.loads(server.log[0].body)["callback_url"]
    assert batch["status"] == "leased"  # accepted: the answer comes by callback


def test_the_session_refuses_a_cross_origin_307_only_for_a_body_with_a_signed_url(serve):  # noqa: F811
    elsewhere = serve(ok("done"))
    first = serve(redirect(elsewhere.url() + "/next"))
    session = guarded_session(LOOPBACK)
    with pytest.raises(RefusedURL) as err:
        session.post(first.url(), data=b'{"blob": "http://gw/v1/blobs/abc.def"}', timeout=5)
    assert "signed batchgate URL" in err.value.refusal and elsewhere.log == []
    assert session.post(first.url(), data=b'{"items": [1]}', timeout=5).text == "done"  # no credential


# -- sequence bounds ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,field", [
    ({"type": "sequence", "count": 10, "start": 2**63 - 5}, "count"),
    ({"type": "sequence", "count": 1, "start": 2**63}, "start"),
    ({"type": "sequence", "count": 1, "start": -(2**63) - 1}, "start"),
    ({"type": "sequence", "count": 2**63, "start": 0}, "count"),
])
def test_a_sequence_past_64_bits_is_422(api, source, field):
    assert api.post("/v1/flows", json={**FLOW, "source": None}).status_code == 201
    detail = assert_problem(api.post("/v1/jobs", json={"flow_id": "f", "source": source}), 422)["detail"]
    assert f"'{field}'" in detail and "64-bit" in detail, detail


def test_a_sequence_up_to_the_last_64_bit_integer_runs(api):
    source = {"type": "sequence", "count": 3, "start": 2**63 - 3}
    assert api.post("/v1/flows", json={**FLOW, "source": source}).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease").json()
    done = api.post(f"/v1/jobs/{job_id}/batches/{env['seq']}/complete",
                    json={"lease_token": env["lease_token"], "output": env["items"]})
    assert done.status_code == 200, done.text  # what it emits, the API takes back
    assert max(env["items"]) == 2**63 - 1


# -- gunicorn's own errors ---------------------------------------------------------------------------------

GUNICORN_APP = "tests.test_tenant_walls:tiny_app"


def tiny_app(environ, start_response):  # pragma: no cover - only reached by a valid request
    start_response("200 OK", [("Content-Type", "text/plain")])
    return [b"ok"]


@pytest.fixture(scope="module")
def gunicorn_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # batchgate's gunicorn config takes the working directory off sys.path (children import nothing
    # from where they were started); the test app lives in this checkout, so name it explicitly
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
    proc = subprocess.Popen([sys.executable, "-m", "gunicorn", "--config", procs.GUNICORN_CONF,
                             "--bind", f"127.0.0.1:{port}",
                             "--workers", "1", "--log-level", "critical", GUNICORN_APP],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            break
        except OSError:
            time.sleep(0.05)
    yield port
    proc.terminate()
    proc.wait(10)


def raw_request(port: int, data: bytes) -> tuple[int, dict[str, str], bytes]:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
        sock.sendall(data)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
    head, _, body = answer.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}
    return int(lines[0].split()[1]), headers, body


@pytest.mark.parametrize("data,status", [
    (b"GET /" + b"a" * 5000 + b" HTTP/1.1\r\nHost: x\r\n\r\n", 414),
    (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"".join(b"X-%d: y\r\n" % i for i in range(150)) + b"\r\n", 431),
    (b"GET / HTTP/1.1\r\nHost: x\r\nX-Big: " + b"y" * 9000 + b"\r\n\r\n", 431),
    (b"BAD\x01LINE\r\n\r\n", 400),
])
def test_gunicorn_answers_its_own_errors_as_problems(gunicorn_port, data, status):
    got, headers, body = raw_request(gunicorn_port, data)
    assert got == status, body[:200]
    assert headers["content-type"] == PROBLEM
    problem = json.loads(body)
    assert problem["status"] == status and problem["title"] and len(problem["detail"]) <= 200
