"""OpenTelemetry traces, off unless configured (``pip install batchgate[otel]`` and the standard OTEL_*).

With the SDK installed and ``OTEL_TRACES_EXPORTER`` (``otlp``, ``console``) or an OTLP endpoint
(``OTEL_EXPORTER_OTLP_ENDPOINT``, ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT``) set, and ``OTEL_SDK_DISABLED``
not true, every process traces:

- the API: one server span per request (``HTTP POST /v1/jobs/<job_id>/lease``: the route, never the
  path, which may hold a signed token), continuing a caller's W3C ``traceparent``;
- the ledger: one span per script run (``ledger.complete``), so a slow commit shows where it waited;
- the worker: one span per stage attempt (job, seq, stage, attempt as attributes) around a
  ``platform.call`` span per trigger or poll;
- every outbound request (platform calls, polls, source reads, webhooks) carries the current
  ``traceparent``, so a platform that traces (n8n, Dify and Coze behind a collector) joins the trace.

Without them nothing is imported and every helper is a no-op costing one flag check. Span attributes
never carry tokens, secrets, URLs with paths, items or outputs.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from typing import Any

_tracer: Any = None  # the OpenTelemetry tracer once set up; None: tracing off


def configured(environ: Any = None) -> bool:
    """Whether the standard OTEL_* variables ask for traces."""
    env = os.environ if environ is None else environ
    if env.get("OTEL_SDK_DISABLED", "").lower() == "true":
        return False
    exporter = env.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(exporter or env.get("OTEL_EXPORTER_OTLP_ENDPOINT") or env.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def setup(service: str, exporter: Any = None) -> bool:
    """Trace this process as ``service`` (batchgate-api, -supervisor, -worker) when configured (or given
    an ``exporter``, as tests do); True when tracing is on. Idempotent."""
    global _tracer
    if _tracer is not None:
        return True
    if exporter is None and not configured():
        return False
    try:
        from opentelemetry import trace
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
    except ImportError:  # configured, but the extra is not installed: say so once, run without
        import logging

        logging.getLogger(__name__).warning(
            "OTEL_* asks for traces but opentelemetry-sdk is not installed: pip install 'batchgate[otel]'")
        return False
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        resource = Resource.create({"service.name": os.environ.get("OTEL_SERVICE_NAME", service)})
        provider = TracerProvider(resource=resource)
        trace.set_tracer_provider(provider)
    if exporter is not None:
        provider.add_span_processor(SimpleSpanProcessor(exporter))
    else:
        provider.add_span_processor(BatchSpanProcessor(_configured_exporter()))
    _tracer = trace.get_tracer("batchgate")
    return True


def _configured_exporter() -> Any:
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

    return OTLPSpanExporter()  # reads OTEL_EXPORTER_OTLP_* itself


def shutdown() -> None:
    """Stop tracing in this process (tests); spans already ended are flushed."""
    global _tracer
    if _tracer is None:
        return
    _tracer = None
    from opentelemetry import trace

    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


def enabled() -> bool:
    return _tracer is not None


@contextlib.contextmanager
def span(name: str, kind: str = "internal", **attributes: Any) -> Iterator[Any]:
    """A span around the block (None when tracing is off)."""
    if _tracer is None:
        yield None
        return
    from opentelemetry import trace

    with _tracer.start_as_current_span(name, kind=getattr(trace.SpanKind, kind.upper()),
                                       attributes={k: v for k, v in attributes.items() if v is not None}) as s:
        yield s


def inject(headers: Any) -> None:
    """Add the current span's ``traceparent`` (and ``tracestate``) to outbound ``headers``."""
    if _tracer is None:
        return
    from opentelemetry import propagate

    propagate.inject(headers)


def start_server_span(name: str, headers: Any) -> Any:
    """A server span that outlives the call (Flask's before/after request); end it with
    :func:`end_span`. None when tracing is off."""
    if _tracer is None:
        return None
    from opentelemetry import context as otel_context
    from opentelemetry import propagate, trace

    s = _tracer.start_span(name, context=propagate.extract(headers), kind=trace.SpanKind.SERVER)
    token = otel_context.attach(trace.set_span_in_context(s))
    return s, token


def end_span(started: Any, status_code: int | None = None) -> None:
    if started is None:
        return
    from opentelemetry import context as otel_context
    from opentelemetry.trace import Status, StatusCode

    s, token = started
    if status_code is not None:
        s.set_attribute("http.response.status_code", status_code)
        if status_code >= 500:
            s.set_status(Status(StatusCode.ERROR))
    s.end()
    otel_context.detach(token)
