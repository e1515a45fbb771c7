"""OpenTelemetry traces (the otel extra), recorded in memory: what an operator's collector would get.

A caller's traceparent is continued by the API's server span; the ledger's scripts are spans; a
worker's stage attempt wraps a platform.call span, and the platform receives a traceparent naming that
span, so its own trace joins ours. Off (the default: no OTEL_* variables), nothing is sent.
"""

from __future__ import annotations

import pytest

import gateway.push.dispatch
from gateway import tracing
from gateway.api.app import create_app
from gateway.ledger.ledger import Ledger
from gateway.push.dispatch import Dispatcher
from gateway.push.worker import PushWorker
from tests.conftest import TOKEN
from tests.http import ApiClient, serve_app
from tests.platforms import FakeHttpPlatform

pytest.importorskip("opentelemetry.sdk")
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter  # noqa: E402

CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
TRACEPARENT = f"00-{CALLER_TRACE}-00f067aa0ba902b7-01"


@pytest.fixture
def traced():
    exporter = InMemorySpanExporter()
    assert tracing.setup("batchgate-test", exporter=exporter)
    yield exporter
    tracing.shutdown()
    exporter.clear()


def test_configured_only_by_the_standard_variables():
    assert not tracing.configured({})
    assert tracing.configured({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"})
    assert tracing.configured({"OTEL_TRACES_EXPORTER": "console"})
    assert not tracing.configured({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "x"})
    assert not tracing.configured({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"})
    assert not tracing.enabled()


def test_a_push_job_is_one_trace_from_the_api_to_the_platform(traced, settings, redis_client, monkeypatch):
    settings = settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})
    with FakeHttpPlatform() as platform:
        base, stop = serve_app(create_app(settings, redis_client))
        try:
            api = ApiClient(base, TOKEN)
            flow = {"id": "t", "version": "1", "batching": {"max_items": 2},
                    "source": {"type": "sequence", "count": 4},
                    "stages": [{"name": "call", "target": {"type": "http", "url": platform.url, "mode": "sync"}}]}
            assert api.post("/v1/flows", json=flow).status_code == 201
            created = api.post("/v1/jobs", json={"flow_id": "t"}, headers={"traceparent": TRACEPARENT})
            job_id = created.json()["job_id"]
            d = Dispatcher.build(settings, Ledger(redis_client, settings))
            monkeypatch.setattr(gateway.push.dispatch, "_DISPATCHER", d)
            PushWorker(d.queue, concurrency=1, grace_s=1).run(burst=True, install_signals=False)
            assert api.get(f"/v1/jobs/{job_id}").json()["status"] == "succeeded"
        finally:
            stop()
        spans = traced.get_finished_spans()
        received = [r.headers.get("traceparent") for r in platform.requests]
    by_name: dict[str, list] = {}
    for s in spans:
        by_name.setdefault(s.name, []).append(s)
    create = by_name["HTTP POST /v1/jobs"][0]
    assert format(create.context.trace_id, "032x") == CALLER_TRACE  # the caller's trace continued
    assert create.attributes["http.response.status_code"] == 201
    assert "ledger.plan" in by_name and "ledger.complete" in by_name and "ledger.lease" in by_name
    calls = by_name["platform.call"]
    assert len(calls) == 2 == len(received)
    stages = by_name["stage call"]
    for call in calls:
        assert call.attributes["batchgate.outcome"] == "done"
        assert call.parent is not None and call.parent.span_id in {s.context.span_id for s in stages}
    sent = {(h.split("-")[1], h.split("-")[2]) for h in received if h}
    assert sent == {(format(c.context.trace_id, "032x"), format(c.context.span_id, "016x")) for c in calls}
    for s in spans:  # nothing secret or bulky in any attribute
        for value in (s.attributes or {}).values():
            assert TOKEN not in str(value) and "/v1/callbacks/" not in str(value)


def test_off_by_default_nothing_is_sent(settings):
    from gateway.net.outbound import session_for

    assert not tracing.enabled()
    with FakeHttpPlatform() as platform:
        session_for(settings.model_copy(update={"outbound_allow": ["127.0.0.1/32"]})).post(
            platform.url, json={"items": [], "idempotency_key": "k"}, timeout=5)
    assert platform.requests and all("traceparent" not in r.headers for r in platform.requests)
