"""No input crashes the API: every malformed body is a 4xx problem, every error is problem+json.

Deep nesting, lone surrogates, NaN/Infinity and out-of-range numbers, duplicate keys, non-JSON content
types, non-UTF-8 bytes; 404/405/413/415/500 as problems; a 204 without a content type; a 500 with an
opaque id whose log line never holds a signed URL's token; responses that strict clients can read.
"""

from __future__ import annotations

import json
import logging
import time

import pytest

from gateway.security import sign
from gateway.validation import MAX_DEPTH, strict_loads
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app

PROBLEM = "application/problem+json"
JSON = {"Content-Type": "application/json"}


def strict_json(text: str):
    """Parse as a strict client does: NaN, Infinity and duplicate keys are errors."""
    def refuse(name):
        raise ValueError(f"not JSON: {name}")

    def pairs(items):
        assert len({k for k, _ in items}) == len(items), "duplicate key"
        return dict(items)

    return json.loads(text, parse_constant=refuse, object_pairs_hook=pairs)


def assert_problem(resp, status: int) -> dict:
    assert resp.status_code == status, (resp.status_code, resp.text[:500])
    assert resp.headers["Content-Type"].split(";")[0] == PROBLEM, resp.headers
    body = strict_json(resp.text)
    assert {"type", "title", "status", "detail"} <= body.keys()
    assert body["status"] == status
    return body


FLOW = {"id": "f", "version": "1", "stages": [{"name": "score"}, {"name": "store"}],
        "batching": {"max_items": 2}, "source": {"type": "sequence", "count": 4}}


@pytest.fixture
def leased(api):
    """A running job whose batch 0 is leased: (job_id, envelope)."""
    assert api.post("/v1/flows", json=FLOW).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
    env = api.post(f"/v1/jobs/{job_id}/lease").json()
    return job_id, env


@pytest.fixture
def callback_url(settings, leased):
    job_id, _ = leased
    token = sign({"j": job_id, "s": 0, "st": 0, "a": 1, "t": "x"}, settings.signing_secret(), "callback", 60)
    return f"/v1/callbacks/{token}"


def json_routes(job_id: str, callback: str) -> list[str]:
    """Every route that reads a JSON body."""
    b = f"/v1/jobs/{job_id}/batches/0"
    return ["/v1/flows", "/v1/jobs", f"/v1/jobs/{job_id}/lease", f"{b}/heartbeat", f"{b}/complete",
            f"{b}/fail", f"/v1/jobs/{job_id}/cancel", f"/v1/jobs/{job_id}/resume", callback]


def snapshot(api, job_id):
    batches = api.get(f"/v1/jobs/{job_id}/batches").json()["batches"]
    return (api.get(f"/v1/jobs/{job_id}").json(), batches,
            [api.get(f"/v1/jobs/{job_id}/batches/{b['seq']}").json() for b in batches],
            api.get("/v1/flows").json())


# -- the decoder itself ----------------------------------------------------------------------------

@pytest.mark.parametrize("raw", [
    b"[" * 100_000 + b"]" * 100_000,
    b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
    b"[" * 100_000,  # unterminated
    b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    b'{"x": ' + b"[{" * 40 + b"}]" * 40 + b"}",
])
def test_decoder_refuses_deep_nesting_without_recursing(raw):
    from gateway.errors import MalformedBody

    start = time.monotonic()
    with pytest.raises(MalformedBody, match="deeper than"):
        strict_loads(raw)
    assert time.monotonic() - start < 1.0


def test_decoder_limits_count_brackets_outside_strings_only():
    deep_ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert strict_loads(deep_ok) is not None
    brackets_in_strings = json.dumps({"s": "[" * 10_000, "t": "\\\"{" * 500, "items": [[1]] * 1000})
    assert strict_loads(brackets_in_strings.encode())["s"] == "[" * 10_000


@pytest.mark.parametrize("raw, words", [
    (b'{"a": NaN}', "NaN"), (b'{"a": Infinity}', "Infinity"), (b'{"a": -Infinity}', "-Infinity"),
    (b'{"a": 1e999}', "out of range"), (b'{"a": -1e999}', "out of range"),
    (b'{"a": 123456789012345678901234567890}', "64 bits"),
    (b'{"a": ' + b"9" * 5000 + b"}", "64 bits"),
    (b'{"a": 1, "a": 2}', "duplicate key"),
    (b'{"a": {"b": 1, "b": 1}}', "duplicate key"),
    (b'{"a": "\\ud800"}', "surrogate"), (b'{"a": ["x", "\\udfff"]}', "surrogate"),
    (b'{"\\ud83d": 1}', "surrogate"), (b'"\\ud800"', "surrogate"),
    (b'{"a": "\\ude00\\ud83d"}', "surrogate"),  # reversed pair
    (b"\xff\xfe{}", "UTF-8"), (b'{"a": "\xed\xa0\x80"}', "UTF-8"),  # an encoded surrogate
])
def test_decoder_refuses_what_cannot_be_stored_or_echoed(raw, words):
    from gateway.errors import MalformedBody

    with pytest.raises(MalformedBody) as err:
        strict_loads(raw)
    assert words in err.value.detail


def test_decoder_accepts_strict_json():
    value = strict_loads(b'{"emoji": "\\ud83d\\ude00", "n": -18446744073709551615, "f": 1.5e300, '
                         b'"s": "\\\\ud800 is text", "z": -0.0}')
    assert value["emoji"] == "\U0001F600" and value["s"] == "\\ud800 is text"
    assert value["n"] == -(2**64 - 1) and value["f"] == 1.5e300


# -- every JSON route ------------------------------------------------------------------------------

BAD_BODIES = [
    ("deep arrays", b'{"params": ' + b"[" * 100_000 + b"]" * 100_000 + b"}"),
    ("deep objects", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("NaN", b'{"lease_token": "x", "output": NaN}'),
    ("Infinity", b'{"lease_token": "x", "progress": Infinity}'),
    ("overflow", b'{"lease_token": "x", "output": 1e999}'),
    ("huge int", b'{"lease_token": "x", "output": ' + b"7" * 4400 + b"}"),
    ("duplicate", b'{"lease_token": "x", "lease_token": "y"}'),
    ("surrogate", b'{"lease_token": "x", "output": {"note": "\\ud800"}}'),
    ("not utf-8", b'{"lease_token": "\xff"}'),
]


def test_every_json_route_refuses_malformed_bodies_with_400_and_changes_nothing(api, leased, callback_url):
    job_id, env = leased
    before = snapshot(api, job_id)
    for path in json_routes(job_id, callback_url):
        for what, raw in BAD_BODIES:
            body = assert_problem(api.post(path, data=raw, headers=JSON), 400)
            assert body["type"].endswith("malformed-body"), (path, what)
    assert snapshot(api, job_id) == before
    done = api.post(f"/v1/jobs/{job_id}/batches/0/complete",
                    json={"lease_token": env["lease_token"], "output": {"ok": True}})
    assert done.status_code == 200, done.text  # the lease survived all of it


@pytest.mark.parametrize("field, body", [
    ("params", lambda env: ("/v1/jobs", {"flow_id": "f", "params": {"name": "\ud800"}})),
    ("items", lambda env: (f"/v1/jobs/{env['job_id']}/batches/0/complete",
                           {"lease_token": env["lease_token"], "items": ["ok", "\udc00"]})),
    ("output", lambda env: (f"/v1/jobs/{env['job_id']}/batches/0/complete",
                            {"lease_token": env["lease_token"], "output": {"\udbff": 1}})),
    ("progress", lambda env: (f"/v1/jobs/{env['job_id']}/batches/0/heartbeat",
                              {"lease_token": env["lease_token"], "progress": "\ud800"})),
    ("description", lambda env: ("/v1/flows", {**FLOW, "version": "2", "description": "\ud800x"})),
    ("source", lambda env: ("/v1/jobs", {"flow_id": "f",
                                         "source": {"type": "inline", "items": ["\ud800"]}})),
    ("reason", lambda env: (f"/v1/jobs/{env['job_id']}/cancel", {"reason": "\udfff"})),
])
def test_lone_surrogates_are_400_naming_where(api, leased, field, body):
    job_id, env = leased
    path, payload = body(env)
    raw = json.dumps(payload)  # ensure_ascii: the surrogate travels as a \\u escape, as a client sends it
    assert "\\ud" in raw
    problem = assert_problem(api.post(path, data=raw, headers=JSON), 400)
    assert "surrogate" in problem["detail"] and field in problem["detail"]
    assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "running"


def test_valid_surrogate_pairs_and_unicode_are_stored_and_echoed(api, leased):
    job_id, env = leased
    raw = json.dumps({"lease_token": env["lease_token"], "output": {"mood": "\U0001F600 café"}})
    assert api.post(f"/v1/jobs/{job_id}/batches/0/complete", data=raw, headers=JSON).status_code == 200
    batch = strict_json(api.get(f"/v1/jobs/{job_id}/batches/0").text)
    assert batch["stages"]["score"]["output"] == {"mood": "\U0001F600 café"}


# -- content types ---------------------------------------------------------------------------------

@pytest.mark.parametrize("headers", [
    {"Content-Type": "text/plain"}, {"Content-Type": "application/x-www-form-urlencoded"},
    {"Content-Type": "multipart/form-data; boundary=x"}, {"Content-Type": "application/jsonx"},
    {"Content-Type": "text/json"}, {},  # requests sends no Content-Type for a str body
])
def test_non_json_content_types_are_415_on_every_route_that_takes_a_body(api, leased, callback_url, headers):
    job_id, _ = leased
    before = snapshot(api, job_id)
    control = [f"/v1/jobs/{job_id}/{action}" for action in ("pause", "release", "retry-failed")]
    for path in json_routes(job_id, callback_url) + control:
        body = assert_problem(api.post(path, data='{"flow_id": "f"}', headers=headers), 415)
        assert body["type"].endswith("unsupported-media-type")
    assert snapshot(api, job_id) == before


@pytest.mark.parametrize("ctype", ["application/json; charset=utf-8", "APPLICATION/JSON",
                                   "application/merge-patch+json"])
def test_json_media_types_are_accepted(api, leased, ctype):
    job_id, _ = leased
    resp = api.post(f"/v1/jobs/{job_id}/cancel", data='{"reason": "r"}', headers={"Content-Type": ctype})
    assert resp.status_code == 200, resp.text


def test_bodiless_posts_need_no_content_type(api, leased):
    job_id, _ = leased
    assert api.post(f"/v1/jobs/{job_id}/lease").status_code in (200, 204)
    assert api.post(f"/v1/jobs/{job_id}/pause", headers={"Content-Type": "text/plain"}).status_code == 200


# -- numbers and durations -------------------------------------------------------------------------

@pytest.mark.parametrize("stage", [
    {"poll_interval": -1}, {"poll_interval": 0}, {"poll_interval": "-PT1S"}, {"timeout": -5},
    {"timeout": 0}, {"retry": {"initial_interval": -0.5}}, {"retry": {"maximum_interval": 0}},
    {"poll_interval": 1e300}, {"timeout": 86_401}, {"lease": -1},
])
def test_negative_zero_and_absurd_durations_are_422(api, stage):
    flow = {**FLOW, "stages": [{"name": "s", **stage}]}
    assert_problem(api.post("/v1/flows", json=flow), 422)
    assert_problem(api.post("/v1/flows", json={**FLOW, "retention": -60}), 422)
    assert_problem(api.post("/v1/flows", json={**FLOW, "retention": 0}), 422)


def test_positive_durations_in_seconds_and_iso_8601_are_accepted(api):
    flow = {**FLOW, "stages": [{"name": "s", "poll_interval": 0.5, "timeout": "PT10S",
                                "retry": {"initial_interval": 0.05, "maximum_interval": "PT1M"}}]}
    assert api.post("/v1/flows", json=flow).status_code == 201


def test_responses_are_strict_json_even_for_non_finite_values_stored_before(api, leased, ledger):
    """A NaN that reached the ledger another way (older data, a platform's answer) goes out as null."""
    job_id, env = leased
    ledger.complete(job_id, env["seq"], env["lease_token"], {"score": float("nan"), "x": float("inf")})
    batch = strict_json(api.get(f"/v1/jobs/{job_id}/batches/0").text)
    assert batch["stages"]["score"]["output"] == {"score": None, "x": None}
    strict_json(api.get("/v1/jobs").text)  # the job list stays readable


# -- every error is a problem ----------------------------------------------------------------------

def test_unknown_routes_wrong_methods_and_big_bodies_are_problems(api, small_api):
    assert_problem(api.get("/nope"), 404)
    assert_problem(api.get("/v1/nope"), 404)
    resp = api.request("PUT", "/v1/jobs")
    assert_problem(resp, 405)
    assert set(resp.headers["Allow"].replace(" ", "").split(",")) >= {"GET", "POST"}
    resp = api.delete("/healthz")
    assert_problem(resp, 405)
    assert "GET" in resp.headers["Allow"]
    body = assert_problem(small_api.post("/v1/flows", json={**FLOW, "description": "x" * 4000}), 413)
    assert body["type"].endswith("body-too-large")


@pytest.fixture
def small_api(redis_server, redis_client, tmp_path):
    from gateway.api.app import create_app
    from gateway.settings import Settings

    settings = Settings(redis_url=redis_server.url, data_dir=tmp_path / "small", tokens={TOKEN: "acme"},
                        max_body_bytes=1024)
    base, stop = serve_app(create_app(settings, redis_client))
    yield ApiClient(base, TOKEN)
    stop()


def test_204_has_no_content_type_or_body(api):
    assert api.post("/v1/flows", json={**FLOW, "source": {"type": "sequence", "count": 0}}).status_code == 201
    job_id = api.post("/v1/jobs", json={"flow_id": "f"}).json()["job_id"]
    resp = api.post(f"/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and resp.content == b""
    assert "Content-Type" not in resp.headers and resp.headers["Batchgate-Job-Status"]
    resp = api.delete("/v1/flows/f/versions/1")
    assert resp.status_code == 204 and "Content-Type" not in resp.headers and resp.content == b""


def test_unexpected_error_is_an_opaque_500_and_its_log_line_holds_no_token(api, callback_url, monkeypatch,
                                                                           caplog):
    token = callback_url.rsplit("/", 1)[1]

    def explode(tok, *args, **kwargs):
        raise RuntimeError(f"boom while handling {tok}")

    monkeypatch.setattr("gateway.api.callbacks.verify", explode)
    with caplog.at_level(logging.ERROR, logger="gateway.api.app"):
        resp = api.post(callback_url, json={"status": "succeeded", "output": {}})
    body = assert_problem(resp, 500)
    assert token not in resp.text and "boom" not in resp.text
    error_id = body["error_id"]
    assert len(error_id) == 32 and body["instance"].endswith(error_id)
    lines = [r.getMessage() for r in caplog.records if r.name == "gateway.api.app"]
    line = next(m for m in lines if error_id in m)
    assert "RuntimeError" in line and "/v1/callbacks/" in line and "redacted" in line
    assert token not in line and all(token not in m for m in lines)
    assert token not in caplog.text


def test_500_on_an_ordinary_route_names_the_path(api, monkeypatch, caplog):
    def explode(*args, **kwargs):
        raise KeyError("whatever")

    monkeypatch.setattr("gateway.ledger.jobs.JobService.list", explode)
    with caplog.at_level(logging.ERROR, logger="gateway.api.app"):
        body = assert_problem(api.get("/v1/jobs"), 500)
    assert any(body["error_id"] in r.getMessage() and "GET /v1/jobs" in r.getMessage()
               for r in caplog.records)
