"""The OpenAPI document: served without auth, built from the request models, true to the live API.

The schemathesis run drives the real stack (gunicorn, Redis) with a bounded example budget per
operation, positive and negative data: no 5xx, every status, content type and body as documented.
"""

from __future__ import annotations

import json
import re
import time

import pytest
import requests
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from connectors.base import Answer
from gateway.runtime import procs
from gateway.ledger.embedded import free_port
from gateway.api.openapi import EXAMPLES, REQUEST_MODELS, ROUTES, CallbackAnswer, document
from gateway.security import sign
from gateway.settings import Settings
from tests.conftest import TOKEN

AUTH = {"Authorization": f"Bearer {TOKEN}"}
MAX_EXAMPLES = 20  # per operation and mode: about a minute on 2 cores
FLOW = {"id": "f", "version": "1", "stages": [{"name": "score"}, {"name": "store"}],
        "batching": {"max_items": 5}, "source": {"type": "sequence", "count": 1000}}


# -- the document ----------------------------------------------------------------------------------

def _openapi_path(rule: str) -> str:
    return re.sub(r"<(?:[a-z]+(?:\([^)]*\))?:)?([a-z_]+)>", r"{\1}", rule)


def test_every_route_is_documented_and_nothing_else(api):
    app_routes = set()
    for rule in api.app.url_map.iter_rules():
        if rule.endpoint == "static" or rule.endpoint.startswith("console."):
            continue  # the web console's HTML pages are for people, not part of the API's contract
        for method in rule.methods - {"HEAD", "OPTIONS"}:
            app_routes.add((method.lower(), _openapi_path(rule.rule)))
    documented = {(r.method, r.path) for r in ROUTES}
    assert app_routes == documented


@pytest.fixture
def api(settings, redis_client):
    from gateway.api.app import create_app
    from tests.http import ApiClient, serve_app

    app = create_app(settings, redis_client)
    base, stop = serve_app(app)
    client = ApiClient(base, TOKEN)
    client.app = app
    yield client
    stop()


def test_document_is_served_without_auth_and_is_openapi_3_1(api):
    resp = api.as_token(None).get("/openapi.json")
    assert resp.status_code == 200 and resp.headers["Content-Type"] == "application/json"
    doc = resp.json()
    assert doc["openapi"] == "3.1.0" and doc == json.loads(json.dumps(document()))
    assert doc["components"]["securitySchemes"]["bearerAuth"] == {
        **doc["components"]["securitySchemes"]["bearerAuth"], "type": "http", "scheme": "bearer"}
    assert doc["security"] == [{"bearerAuth": []}]
    assert doc["paths"]["/healthz"]["get"]["security"] == []
    assert doc["paths"]["/v1/callbacks/{token}"]["post"]["security"] == []
    for path, item in doc["paths"].items():
        for method, op in item.items():
            problems = [s for s in op["responses"] if s.startswith(("4", "5"))]
            assert problems, (method, path)
            for status in problems:
                content = op["responses"][status]["content"]
                # a signed decision link is a page a person reads: its errors are pages too
                wanted = ["text/html"] if path.startswith("/decide/") else ["application/problem+json"]
                assert list(content) == wanted, (method, path, status)


def test_request_bodies_are_the_validating_models(api):
    doc = document()
    schemas = doc["components"]["schemas"]
    for model in REQUEST_MODELS:
        assert model.__name__ in schemas
    flow = schemas["FlowSpec"]
    assert flow["additionalProperties"] is False and "stages" in flow["required"]
    poll = schemas["Stage"]["properties"]["poll_interval"]["anyOf"][0]
    assert poll == {"type": "number", "minimum": 1e-6, "maximum": 86400.0}  # microsecond resolution
    body = doc["paths"]["/v1/jobs/{job_id}/batches/{seq}/complete"]["post"]["requestBody"]
    assert body["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/CompleteRequest"}


def test_examples_are_valid_requests():
    by_name = {m.__name__: m for m in REQUEST_MODELS}
    for name, example in EXAMPLES.items():
        by_name[name].model_validate(example)
    for example in CallbackAnswer.model_config["json_schema_extra"]["examples"]:
        CallbackAnswer.model_validate(example)
        Answer.parse(example)  # the callback route's own parser agrees with the documented model


def test_documented_flow_example_registers_and_runs(api):
    assert api.post("/v1/flows", json=EXAMPLES["FlowSpec"]).status_code == 201
    assert api.post("/v1/jobs", json=EXAMPLES["JobRequest"]).status_code == 201


# -- schemathesis against gunicorn and Redis -------------------------------------------------------

@pytest.fixture(scope="module")
def live(redis_server, tmp_path_factory):
    """gunicorn (2 workers) on the test Redis, seeded with a flow and jobs.

    Yields (base url, job ids, the signing key gunicorn was given).
    """
    from gateway.ledger.embedded import client_for

    client_for(redis_server.url).flushdb()
    port = free_port()
    settings = Settings(data_dir=tmp_path_factory.mktemp("live"))
    env = procs.child_env(settings, redis_server.url, {TOKEN: "acme"})
    proc = procs.start_api(env, "127.0.0.1", port, workers=2)
    supervisor = procs.start_supervisor(env)  # /readyz answers 200 with one alive
    base = f"http://127.0.0.1:{port}"
    try:
        procs.wait_healthy(base, proc=proc)
        deadline = time.monotonic() + 20
        while requests.get(f"{base}/readyz", timeout=5).status_code != 200:
            assert time.monotonic() < deadline, "the supervisor never made /readyz ready"
            time.sleep(0.1)
        s = requests.Session()
        s.headers.update(AUTH)
        assert s.post(f"{base}/v1/flows", json=FLOW).status_code == 201
        assert s.post(f"{base}/v1/flows", json={**FLOW, "version": "doomed"}).status_code == 201
        jobs = [s.post(f"{base}/v1/jobs", json={"flow_id": "f", "flow_version": "1"}).json()["job_id"]
                for _ in range(3)]
        s.post(f"{base}/v1/jobs/{jobs[0]}/lease")  # batch 0 leased: batches, heartbeat, complete, fail
        yield base, jobs, settings.signing_secret()
    finally:
        procs.stop_all([proc, supervisor])


SEEN: dict[str, set[int]] = {}  # operation -> statuses answered
SENT: list[int] = []
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


def _run(strategy, base: str, failures: list, label: str, examples: int = MAX_EXAMPLES) -> None:
    """Up to ``examples`` cases from ``strategy``; a failing check is recorded, not raised.

    Example cases come with generated bearer tokens: they, and positive cases, get the valid one;
    negative cases keep what schemathesis chose (it may be testing the security scheme).
    """

    @given(case=strategy)
    @settings(max_examples=examples, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck), phases=[Phase.explicit, Phase.generate])
    def run(case):
        if case.meta is None or case.meta.generation.mode is not GenerationMode.NEGATIVE:
            case.headers = {**(case.headers or {}), **AUTH}
        resp = case.call(base_url=base, timeout=30)
        SEEN.setdefault(case.operation.label, set()).add(resp.status_code)
        SENT.append(resp.status_code)
        case.validate_response(resp, checks=CHECKS, headers=AUTH)

    try:
        run()
    except Unsatisfiable:  # negative mode where nothing can be made invalid (no parameters, no body)
        pass
    except (Exception, BaseExceptionGroup) as exc:  # schemathesis raises a FailureGroup
        failures.append(f"{label}: {type(exc).__name__}: {str(exc)[:2000]}")


def _existing_ids(op, jobs: list[str], signing_key: bytes) -> dict:
    """Path parameters that name things that exist: job 0 has a leased batch; job 1 takes the
    control actions, job 2 the cancel; DELETE retires a version kept for it; tokens are genuine."""
    control = op.path.rsplit("/", 1)[-1] in ("pause", "release", "resume", "retry-failed")
    job = jobs[2] if op.path.endswith("/cancel") else jobs[1] if control else jobs[0]
    real = {"job_id": job, "flow_id": "f", "version": "doomed" if op.method == "delete" else "1",
            "seq": 0}
    out = {p.name: real[p.name] for p in op.path_parameters if p.name in real}
    if any(p.name == "token" for p in op.path_parameters):
        purpose = "callback" if "/callbacks/" in op.path else "blob"
        out["token"] = sign({"j": jobs[0], "s": 0, "st": 0, "a": 1, "t": "x"}, signing_key, purpose, 600)
    return out


def test_live_api_conforms_to_its_document(live):
    """Every operation: its documented examples, then positive and negative data, once with generated
    path parameters and once with ids that exist (so operations get past their 404)."""
    base, jobs, signing_key = live
    schema = schemathesis.openapi.from_url(f"{base}/openapi.json")
    schema.config.update(headers=AUTH, base_url=base)  # a fixed, valid token: no generated ones
    failures: list[str] = []
    started = time.monotonic()
    operations = [result.ok() for result in schema.get_all_operations()]
    labels = {op.label for op in operations} | {"GET /openapi.json"}  # schemathesis skips its source
    assert labels == {f"{r.method.upper()} {r.path}" for r in ROUTES}
    for op in sorted(operations, key=lambda op: op.method == "delete"):  # retire flows last
        examples = schema.get_strategies_from_examples(op)
        if examples:
            _run(st.one_of(examples), base, failures, f"{op.label} examples", examples=3)
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            _run(op.as_strategy(generation_mode=mode), base, failures, f"{op.label} {mode.value}")
        names = {p.name for p in op.path_parameters}
        if names:
            fixed = _existing_ids(op, jobs, signing_key)
            _run(op.as_strategy(path_parameters=fixed), base, failures, f"{op.label} existing ids")
    elapsed = time.monotonic() - started
    print(f"schemathesis: {len(operations)} operations, {len(SENT)} requests in {elapsed:.1f} s; "
          f"statuses: {SEEN}")
    assert not failures, "\n\n".join(failures)
    # the budget reaches real behaviour, not only 404s and 422s
    assert {200, 201} & SEEN["POST /v1/flows"] and 201 in SEEN["POST /v1/jobs"]
    assert 200 in SEEN["GET /v1/jobs/{job_id}"] and 200 in SEEN["GET /v1/jobs/{job_id}/batches/{seq}"]
    assert {200, 204} & SEEN["POST /v1/jobs/{job_id}/lease"] and 200 in SEEN["POST /v1/jobs/{job_id}/cancel"]
    assert {400, 409, 422} <= set().union(*SEEN.values())


def test_live_stack_answers_204_without_content_type_and_errors_as_problems(live):
    base = live[0]
    s = requests.Session()
    s.headers.update(AUTH)
    s.post(f"{base}/v1/flows", json={**FLOW, "version": "empty", "source": {"type": "sequence",
                                                                           "count": 0}})
    job_id = s.post(f"{base}/v1/jobs", json={"flow_id": "f", "flow_version": "empty"}).json()["job_id"]
    resp = s.post(f"{base}/v1/jobs/{job_id}/lease")
    assert resp.status_code == 204 and "Content-Type" not in resp.headers and resp.content == b""
    for resp, status in [(s.get(f"{base}/nope"), 404), (s.put(f"{base}/v1/jobs"), 405),
                         (s.post(f"{base}/v1/jobs", data="x", headers={"Content-Type": "text/plain"}), 415),
                         (s.post(f"{base}/v1/jobs", data=b"[" * 100_000, headers={
                             "Content-Type": "application/json"}), 400)]:
        assert resp.status_code == status
        assert resp.headers["Content-Type"] == "application/problem+json"
